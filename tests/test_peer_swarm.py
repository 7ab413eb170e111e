"""Swarms of real peer processes on loopback: training, averaging, validation, SIGTERM, restart, churn.

Each test starts `asyncmesh-peer join` children through tests/swarm_utils.py, whose fixture reaps every child by PID
whether the test passes or fails. The tiny run (tests/runs/tiny.toml) keeps each test within about a minute on two
shared cores.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from swarm_utils import REPO, swarm  # noqa: F401  (fixture)

STEPS = 100  # stage 0 stops here: long enough for a few averaging rounds on each stage (1.5-s clock)
RARE_AVG = REPO / "tests" / "runs" / "tiny_rare_avg.toml"  # no averaging round falls inside a test


def _no_traceback(peer) -> None:
    log = peer.log()
    assert "Traceback" not in log, f"{peer.name} logged an exception:\n{log[-4000:]}"


@pytest.mark.timeout(240)
def test_two_by_two_swarm_trains_averages_evaluates_and_restarts_from_checkpoint(swarm):  # noqa: F811
    ex = ()  # the run (tests/runs/tiny.toml) averages every 2 local steps on a 1.5 s clock
    a = swarm.start("a", stage="0", max_steps=STEPS, extra=ex)
    first = a.wait_maddrs()[:1]
    c = swarm.start("c", stage="0", initial=first, max_steps=STEPS, extra=ex)
    # both stage-0 replicas train before stage 1 comes: stage 0 cannot step without it, so a cannot reach STEPS
    # (~2 s on the tiny run) while c is still starting, which once left the pair 1.2 s together and no round
    c.wait_status(lambda s: s.get("state") == "training", 120, "c training")
    b = swarm.start("b", stage="1", initial=first, max_steps=STEPS, extra=ex)
    d = swarm.start("d", stage="1", initial=first, max_steps=STEPS, extra=ex)
    assert a.wait_exit(180) == 0 and c.wait_exit(60) == 0  # stage 0 stops at max_steps after a final evaluation
    t0 = time.monotonic()
    b.signal(signal.SIGTERM)
    d.signal(signal.SIGTERM)
    assert b.wait_exit(30) == 0 and d.wait_exit(30) == 0
    assert time.monotonic() - t0 < 5 + 15  # drain_timeout_s=5 plus shutdown
    sums = {p.name: p.summary() for p in (a, b, c, d)}
    uniform = math.log(256)  # ~5.55: the loss of the seeded init, which predicts bytes about uniformly
    for name in ("a", "c"):  # c may join late and load a's trained state; both must end far below the init
        s = sums[name]
        assert s["steps"] >= STEPS
        assert s["final_loss"] < uniform - 1.0, s  # loss falls clearly (5.5 -> 3.4-4.3 on this run)
        assert s["final_val_loss"] is not None and s["final_val_loss"] < uniform - 1.0, s
        assert s["final_val_loss_from"] == "final evaluation", s  # not an early periodic one standing in
        assert s["tokens_per_s"] > 0
    for pair in (("a", "c"), ("b", "d")):  # each stage's replicas averaged at least once
        assert sum(sums[n]["averaging_rounds_ok"] for n in pair) >= 1, sums
    assert sums["b"]["steps"] + sums["d"]["steps"] >= STEPS
    for p in (a, b, c, d):
        _no_traceback(p)
    # SIGTERM wrote b's final checkpoint; a restart (no donor left) resumes from it
    ckpt = b.dir / "ckpt" / "stage-1.pt"
    saved = torch.load(ckpt, weights_only=True)
    assert saved["state"]["local_step"] == sums["b"]["steps"] > 0
    b2 = swarm.start("b", stage="1", max_steps=STEPS)
    b2.wait_status(lambda s: s.get("state") == "training", 60, "training state")
    assert f"stage 1 state from checkpoint (local step {sums['b']['steps']})" in b2.log()
    b2.signal(signal.SIGTERM)
    assert b2.wait_exit(30) == 0


@pytest.mark.timeout(240)
def test_churn_kill9_replica_then_auto_joiner_loads_donor_state_and_contributes(swarm):  # noqa: F811
    # stage-0 peers keep long-lived records so that pausing them does not make stage 0 look empty; stage-1 peers
    # expire in 4 s so the killed replica vanishes quickly; no averaging rounds fall inside the test, so the donor's
    # weights stay frozen while the joiner copies them
    # every peer announces the same fixed throughput: measured figures swing with the load of the shared cores (once
    # stage 0's two replicas read 2.8x slower per micro-batch than stage 1's survivor, so stage 0 was the bottleneck)
    keep = ("record_ttl_s=60", "throughput=1.0")
    short = ("record_ttl_s=4", "state_snapshot_max_age_s=2", "throughput=1.0")
    # both stage-0 replicas load step 0 before stage 1 exists to train them: one that joined later would load a
    # donor already some steps on, and with no averaging rounds the two would drift apart in activation norm until
    # stage 1's guard refused the laggard, so its throughput (and stage 0's capacity) would read near zero
    a = swarm.start("a", stage="0", extra=keep, run=RARE_AVG)
    first = a.wait_maddrs()[:1]
    c = swarm.start("c", stage="0", initial=first, extra=keep, run=RARE_AVG)
    c.wait_status(lambda s: s.get("state") == "training", 90, "training state")
    b = swarm.start("b", stage="1", initial=first, extra=short, run=RARE_AVG)
    d = swarm.start("d", stage="1", initial=first, extra=short, run=RARE_AVG)
    a.wait_status(lambda s: s["local_step"] >= 10, 120, "10 steps")
    d.proc.kill()  # kill -9 one replica mid-run
    d.proc.wait()
    # the swarm keeps training after the kill: stage 0 makes 10 more steps, on either replica. Not on a alone: early
    # in a run one stage-0 replica can fall behind the other, and stage 1's loss check then refuses its micro-batches
    # until averaging, rare in this run, pulls it back (once on CI: a's loss 6.19 against a ceiling of 4.76, while c
    # trained on)
    before = {p: p.status()["local_step"] for p in (a, c)}

    def stage0_progressed() -> bool:
        return any((s := p.status()) is not None and s["local_step"] >= before[p] + 10 for p in (a, c))

    a.wait_for(stage0_progressed, 60, "progress of stage 0 after the kill", 0.3)
    time.sleep(4.5)  # the killed peer's record expires
    a.signal(signal.SIGSTOP)  # freeze training so the donor's weights stay put while the joiner loads them
    c.signal(signal.SIGSTOP)
    try:
        time.sleep(1.0)
        e = swarm.start("e", stage="auto", initial=b.maddrs[:1], extra=short, run=RARE_AVG)
        snap = e.wait_status(lambda s: s.get("state") == "training", 90, "training state")
        assert snap["stage"] == 1, "the joiner must pick the under-served stage"
        assert "stage 1 state from donor" in e.log()
        loaded = torch.load(e.dir / "ckpt" / "stage-1.pt", weights_only=True)["state"]
        b.signal(signal.SIGTERM)  # the donor's final checkpoint holds the weights the joiner copied
        assert b.wait_exit(30) == 0
    finally:
        a.signal(signal.SIGCONT)
        c.signal(signal.SIGCONT)
    donor = torch.load(b.dir / "ckpt" / "stage-1.pt", weights_only=True)["state"]
    assert loaded["local_step"] == donor["local_step"] > 0
    for name, w in donor["model"].items():
        torch.testing.assert_close(loaded["model"][name], w, rtol=0, atol=1e-6)
    start = e.status()["local_step"]
    e.wait_status(lambda s: s["local_step"] >= start + 5, 60, "the joiner's own steps")  # it contributes
    for p in (a, c, e):
        p.signal(signal.SIGTERM)
    for p in (a, c, e):
        assert p.wait_exit(30) == 0
        _no_traceback(p)
    # whatever was in flight at the killed replica and timed out was dropped, counted, and its sample re-queued
    requeued = a.summary()["microbatches_requeued"] + c.summary()["microbatches_requeued"]
    assert requeued == a.summary()["microbatches_dropped"] + c.summary()["microbatches_dropped"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_replacement_loads_the_live_replica_while_the_dead_one_is_still_announced(swarm):  # noqa: F811
    """A stage of two loses a replica to kill -9 and a replacement joins at once, while the dead replica's record is
    still announced: the dead one is the live donor's only witness and ties the vote. The replacement asks again
    once the record lapses and loads the live replica's state, instead of starting over from the seeded init.
    (~45 s: the dead record must outlive the replacement's start-up, so records live 15 s here, not the test 4 s.)"""
    keep = ("record_ttl_s=60", "throughput=1.0")
    ttl = ("record_ttl_s=15", "announce_every_s=2", "throughput=1.0")
    a = swarm.start("a", stage="0", extra=keep, run=RARE_AVG)
    first = a.wait_maddrs()[:1]
    b = swarm.start("b", stage="1", initial=first, extra=ttl, run=RARE_AVG)
    d = swarm.start("d", stage="1", initial=first, extra=ttl, run=RARE_AVG)
    for p in (b, d):
        p.wait_status(lambda s: s["local_step"] >= 10, 120, "10 steps")
    d.proc.kill()
    d.proc.wait()
    e = swarm.start("e", stage="1", initial=first, extra=ttl, run=RARE_AVG)
    e.wait_status(lambda s: s.get("state") == "training", 90, "training state")
    log = e.log()
    assert "is not loaded" in log, log[-3000:]  # the first vote: the dead witness's silence tied it
    assert "the stage's announced replicas changed" in log and "stage 1 state from donor" in log, log[-3000:]
    start = e.status()["local_step"]
    assert start >= 10
    e.wait_status(lambda s: s["local_step"] >= start + 5, 60, "the replacement's own steps")
    for p in (a, b, e):
        p.signal(signal.SIGTERM)
    for p in (a, b, e):
        assert p.wait_exit(30) == 0
        _no_traceback(p)


@pytest.mark.timeout(240)
def test_auto_peer_rebalances_to_a_stage_that_lost_its_server(swarm):  # noqa: F811
    """Regression: when c restarted stage 0 from its init, stage 1's guard refused its activations for good (their
    norm is >8x below a trained stage 0's, and refused norms never entered the learnt window); it now relearns."""
    fixed = ("record_ttl_s=4",)
    a = swarm.start("a", stage="0", extra=fixed)
    first = a.wait_maddrs()[:1]
    b = swarm.start("b", stage="1", initial=first, extra=fixed)
    b.wait_status(lambda s: s.get("state") == "training", 90, "training state")
    c = swarm.start("c", stage="auto", initial=first, extra=("rebalance_every_s=2",))
    joined = c.wait_status(lambda s: s.get("state") == "training", 90, "training state")["stage"]
    # the fixed peer of the other stage dies: that stage is empty, c's own stage keeps a server, so c moves
    victim = b if joined == 0 else a
    victim.proc.kill()
    victim.proc.wait()
    c.wait_status(lambda s: s.get("stage") == 1 - joined and s.get("state") == "training", 90, "a move")
    assert f"moving from stage {joined} to under-served stage {1 - joined}" in c.log()
    driver = a if joined == 0 else c  # whoever serves stage 0 now drives the pipeline
    start = driver.status()["local_step"]
    driver.wait_status(lambda s: s["local_step"] >= start + 5, 60, "training after the move")
    for p in (a, b, c):
        if p is not victim:
            p.signal(signal.SIGTERM)
            assert p.wait_exit(30) == 0
            _no_traceback(p)


@pytest.mark.timeout(240)
def test_sync_mode_swarm_keeps_every_replica_in_lockstep(swarm):  # noqa: F811
    """--mode sync on 2 x 2 processes: every flush is one barrier on every stage, keyed by stage 0's flush number.

    Regression: later stages used to find flush ends by counting backwards, and one retried or re-routed hop shifted
    a replica off its partner for good, so the swarm stalled at a barrier until sync_timeout_s (docs/performance.md).
    Started as tools/bench_swarm.py starts it: the later stage first, then both stage-0 replicas at once (a replica
    that joins a synchronous swarm mid-run still costs its partners one barrier timeout; see docs/performance.md)."""
    flushes = 25
    a = swarm.start("a", "--mode", "sync", stage="1")
    first = a.wait_maddrs()[:1]
    b = swarm.start("b", "--mode", "sync", stage="1", initial=first)
    for p in (a, b):
        p.wait_status(lambda s: s.get("state") == "training", 90, "training state")
    c = swarm.start("c", "--mode", "sync", stage="0", initial=first, max_steps=flushes)
    d = swarm.start("d", "--mode", "sync", stage="0", initial=first, max_steps=flushes)
    assert c.wait_exit(180) == 0 and d.wait_exit(60) == 0
    late = {p.name: p.status()["local_step"] for p in (a, b)}
    for p in (a, b):
        p.signal(signal.SIGTERM)
        assert p.wait_exit(30) == 0
    sums = {p.name: p.summary() for p in (a, b, c, d)}
    assert sums["c"]["steps"] == sums["d"]["steps"] == flushes
    # a later stage closes a flush as soon as its share of it is done (its barrier overlaps the drain), so it
    # closes every flush, the last one included
    assert late["a"] == late["b"] == flushes, late
    for p in (a, b, c, d):
        _no_traceback(p)
        assert "averaged without" not in p.log(), f"{p.name} hit a barrier timeout:\n{p.log()[-3000:]}"
        # honest replicas on one machine hold bit-identical weights: the barriers' digests never see a fork
        assert "our weights differ" not in p.log(), f"{p.name} saw a fork:\n{p.log()[-3000:]}"
    assert sums["c"]["final_loss"] < math.log(256) - 0.5, sums["c"]


def _pids_using(path: str) -> list[int]:
    """PIDs of live processes whose command line mentions ``path`` (the swarm launcher's children)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read().decode(errors="replace")  # noqa: SIM115
            except OSError:
                continue
            if path in cmdline:
                pids.append(int(entry))
    return pids


@pytest.mark.timeout(300)
def test_swarm_command_runs_the_newcomers_job_to_the_end_and_reaps_its_peers(tmp_path):
    """`asyncmesh-peer swarm` itself (the README's main job, here without the dashboard and with --max-steps)."""
    from swarm_utils import TINY_RUN

    workdir = tmp_path / "w"
    cmd = [sys.executable, "-m", "peer.cli", "swarm", "--peers", "4", "--run", str(TINY_RUN), "--max-steps", "40",
           "--no-tui", "--workdir", str(workdir), "--summary-json", str(tmp_path / "s.json"), "--timeout", "200"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=260)
    finally:
        if proc.poll() is None:  # the launcher reaps its peers on SIGTERM
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        for pid in _pids_using(str(workdir)):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-4000:]
    assert "stopping the swarm:" in out, out[-2000:]
    s = json.loads((tmp_path / "s.json").read_text())
    assert [p["exit_code"] for p in s["per_peer"]] == [0] * len(s["per_peer"]), s["per_peer"]
    assert s["steps"] >= 40 and s["final_loss"] < s["initial_loss"], s
    assert not _pids_using(str(workdir)), "a peer outlived the swarm command"
