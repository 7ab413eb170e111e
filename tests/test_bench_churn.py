"""The churn benchmark's short version: 4 auto peers of the tiny run, kill -9 of the bootstrap peer and its restart
with the same identity, a graceful restart; no sample may be lost, no process orphaned, and the restarted peers resume
at their step and train again. (With 4 peers the bootstrap may be the only peer of its stage, so its kill can lose
that stage's state: ``states_lost`` is asserted only by the full run.) The full benchmark (6 peers, a whole stage
killed, a whole-swarm restart, a clean control) takes about 4 minutes on 2 busy cores; both runs are marked slow
(``pytest -m slow tests/test_bench_churn.py``)."""

from __future__ import annotations

import json

import pytest

from tools.bench_churn import main, stage_resumed


def _run(tmp_path, *args: str) -> dict:
    out = tmp_path / "churn.json"
    assert main([*args, "--workdir", str(tmp_path / "peers"), "--json", str(out)]) == 0
    return json.loads(out.read_text())


def _check(res: dict) -> None:
    assert res["orphans"] == 0, res["runs"]
    assert res["samples_lost"] == 0, res["runs"]
    for r in res["restart_resumed_step"]:  # a peer back on its own stage resumes at least where it stopped
        if r["stage"] == r["stage_before"]:
            assert r["after"] >= r["before"] > 0, res["restart_resumed_step"]
    for stage, r in res["stage_resumed_step"].items():  # and every stage resumes where its best replica stopped
        assert r["after"] >= r["before"], (stage, res["stage_resumed_step"])
    assert res["final_val_loss"]["churn"] is not None


def test_a_stage_left_training_by_its_other_replicas_counts_as_kept():
    # a stage-0 peer restarts onto stage 1: stage 0 goes on at its other replica's step, stage 1 at the mover's
    moved = {"peer": "p2", "stage_before": 0, "before": 1043, "stage": 1, "after": 1162, "stage_kept": 1060}
    assert stage_resumed([moved]) == {0: {"before": 1043, "after": 1060}, 1: {"before": 0, "after": 1162}}
    # the only replica of stage 0 comes back on stage 1 and nobody holds stage 0 any more: that is a loss
    lost = dict(moved, stage_kept=0)
    assert stage_resumed([lost])[0] == {"before": 1043, "after": 0}


@pytest.mark.slow  # 88 s on 2 cores; churn in the default run: tests/test_peer_swarm.py (kill -9, auto joiner)
@pytest.mark.timeout(480)
def test_short_churn_run_loses_nothing(tmp_path):
    res = _run(tmp_path, "--only", "churn", "--peers", "4", "--steps", "120", "--events", "kill_bootstrap,graceful",
               "--timeout-s", "400")
    _check(res)
    assert res["restart_resumed_step"], "the graceful restart resumed"
    assert res["joiner_first_step_s"], "the restarted peers trained again"


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_full_churn_benchmark_meets_its_targets(tmp_path):
    res = _run(tmp_path, "--peers", "6", "--steps", "300", "--seed", "1")
    _check(res)
    assert res["states_lost"] == 0, res["runs"]  # needs copies of neighbouring stages: not met yet (reliability.md)
    assert res["stalls_over_10s"] == 0, res["runs"]["churn"]["stalls"]
    clean, churn = res["final_val_loss"]["clean"], res["final_val_loss"]["churn"]
    assert churn <= clean * 1.05, res["final_val_loss"]


def test_wan_options_are_checked():
    from tools.bench_churn import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--delay-ms", "-1"])
    assert parse_args([]).delay_ms == 0.0  # loopback by default


@pytest.mark.wan
@pytest.mark.timeout(480)
def test_short_churn_run_on_the_emulated_wan_loses_nothing(tmp_path):
    """The short run on the emulated WAN (101 ms RTT, 100 Mbit/s uplinks): peers listen in their own namespaces, a
    restarted peer comes back in its own, and the bootstrap's kill and a graceful restart lose nothing."""
    from tools.wan import check_available

    if check_available() is not None:
        pytest.skip(check_available())
    res = _run(tmp_path, "--only", "churn", "--peers", "4", "--steps", "60", "--events", "kill_bootstrap,graceful",
               "--timeout-s", "400", "--delay-ms", "50.5", "--rate-mbit", "100")
    _check(res)
    assert res["network"] == {"delay_ms": 50.5, "rtt_ms": 101.0, "rate_mbit": 100.0}
    assert res["joiner_first_step_s"], "the restarted peers trained again"
