"""A whole-swarm restart from checkpoints with ``--stage auto`` resumes every stage at its step (multi-process).

Two auto peers train the tiny run, both are stopped with SIGTERM (each writes its final checkpoint), and both are
restarted with the same identities and folders in the opposite order: each must take the stage it holds a checkpoint
for and resume from it, never from the seeded init or from a less-trained donor.
"""

from __future__ import annotations

import signal

import pytest
import torch
from swarm_utils import swarm  # noqa: F401  (fixture)


def _ckpt_steps(peer) -> dict[int, int]:
    out = {}
    for path in sorted((peer.dir / "ckpt").glob("stage-?.pt")):
        out[int(path.stem.split("-")[1])] = torch.load(path, weights_only=True)["step"]
    return out


@pytest.mark.timeout(300)
def test_whole_swarm_restart_resumes_every_stage_at_its_step(swarm):  # noqa: F811
    a = swarm.start("a", stage="auto")
    first = a.wait_maddrs()[:1]
    a.wait_status(lambda s: s.get("state") == "training", 90, "training state")
    b = swarm.start("b", stage="auto", initial=first)
    b.wait_status(lambda s: s.get("state") == "training", 90, "training state")
    driver = a if a.status()["stage"] == 0 else b
    driver.wait_status(lambda s: s["local_step"] >= 25, 120, "25 steps")
    for p in (a, b):
        p.signal(signal.SIGTERM)
    for p in (a, b):
        assert p.wait_exit(30) == 0
    before = {p.name: (p.summary()["stage"], p.summary()["steps"]) for p in (a, b)}
    assert {s for s, _ in before.values()} == {0, 1}
    assert all(step > 0 for _, step in before.values()), before
    for p in (a, b):
        assert _ckpt_steps(p)[before[p.name][0]] == before[p.name][1]
        (p.dir / "maddrs.txt").unlink()

    # restart in the opposite order: the first one back starts a new swarm, the other joins it
    b2 = swarm.start("b", stage="auto")
    b2.wait_status(lambda s: s.get("state") == "training", 90, "training state after the restart")
    a2 = swarm.start("a", stage="auto", initial=b2.wait_maddrs()[:1])
    a2.wait_status(lambda s: s.get("state") == "training", 90, "training state after the restart")
    for p, name in ((a2, "a"), (b2, "b")):
        stage, step = before[name]
        snap = p.status()
        assert snap["stage"] == stage, (name, snap["stage"], before)
        assert snap["local_step"] >= step, (name, snap["local_step"], before)
        assert f"stage {stage} state from checkpoint (local step {step})" in p.log()
    for p in (a2, b2):
        p.signal(signal.SIGTERM)
    for p in (a2, b2):
        assert p.wait_exit(30) == 0
        assert "Traceback" not in p.log()
    for p, name in ((a2, "a"), (b2, "b")):  # checkpoints only ever moved forward
        stage, step = before[name]
        assert _ckpt_steps(p)[stage] >= step
