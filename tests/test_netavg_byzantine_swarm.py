"""A real swarm with a Byzantine replica: 4 replicas of a 1-stage tiny run, one sending attacked averaging parts.

The attacker is an ordinary ``join`` peer with the red-team knob ``byzantine_attack`` (PeerConfig): it announces
itself and trains like the others, but its averaging parts are replaced by the attack, so it passes the membership
filter and only the distance checks and the robust aggregate stand between it and the honest weights. The honest
replicas' final validation loss is compared with the same swarm without the attacker (all four honest).
"""

from __future__ import annotations

import json
import re
import signal
import statistics
import time
from pathlib import Path

import pytest
from swarm_utils import TINY_RUN, swarm  # noqa: F401  (fixture)

TRAIN_S = 45.0  # seconds all four replicas train together


def _one_stage_run(tmp: Path, aggregator: str) -> Path:
    text = re.sub(r"^n_stages = \d+$", "n_stages = 1", TINY_RUN.read_text(), flags=re.M)
    text = text.replace('name = "test-tiny"', f'name = "test-tiny-1stage-{aggregator}"')
    text = text.replace('rule = "ema"', f'rule = "ema"\naggregator = "{aggregator}"')
    path = tmp / f"tiny1-{aggregator}.toml"
    path.write_text(text)
    return path


def _honest_val(swarm, tag: str, run: Path, attack: str) -> tuple[float, dict[str, int]]:  # noqa: F811
    """Mean last val loss of the 3 honest replicas after TRAIN_S seconds of all 4 (the 4th honest or attacking)
    training together, and the honest replicas' rejection counters."""
    first = swarm.start(f"{tag}-h0", stage="0", run=run)
    initial = first.wait_maddrs()[:1]
    honest = [first] + [swarm.start(f"{tag}-h{i}", stage="0", run=run, initial=initial)
                        for i in (1, 2)]
    fourth = swarm.start(f"{tag}-x", stage="0", run=run, initial=initial,
                         extra=(f"byzantine_attack={attack}",) if attack else ())
    for p in (*honest, fourth):
        p.wait_status(lambda s: s.get("state") == "training", 120, "training state")
    time.sleep(TRAIN_S)
    for p in (*honest, fourth):
        p.signal(signal.SIGTERM)
    for p in (*honest, fourth):
        assert p.wait_exit(60) == 0, p.log()[-3000:]
    sums = [p.summary() for p in honest]
    rejected: dict[str, int] = {}
    for s in sums:
        assert s["averaging_rounds_ok"] >= 3, s
        for k, v in s["rejected_avg"].items():
            rejected[k] = rejected.get(k, 0) + v
    return statistics.mean(s["val_losses"][-1] for s in sums), rejected


@pytest.mark.slow  # two swarms of 4 peers: about 5 minutes on 2 busy cores
@pytest.mark.timeout(900)
@pytest.mark.parametrize("attack", ["zeros"])
def test_one_byzantine_replica_of_four_keeps_the_honest_loss_near_the_control(swarm, tmp_path, attack):  # noqa: F811
    run = _one_stage_run(tmp_path, "trimmed")
    control, _ = _honest_val(swarm, "control", run, "")
    attacked, rejected = _honest_val(swarm, "attacked", run, attack)
    ratio = attacked / control
    print(json.dumps({"attack": attack, "control": control, "attacked": attacked, "ratio": ratio,
                      "rejected": rejected}))
    assert rejected.get("rejected:avg_outlier", 0) + rejected.get("rejected:avg_too_far", 0) >= 1, rejected
    assert ratio < 1.10, (control, attacked)  # the target is 5 %; the margin is the swarm's run-to-run noise
