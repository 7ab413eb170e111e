"""`asyncmesh-peer swarm` start-up: phases, progress-based give-up, late peers, Ctrl-C in every phase, exit codes."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from peer.cli import swarm as cmd_swarm
from peer.ops.dashboard import render_swarm
from peer.ops.procs import PeerProcess, descendants
from peer.ops.startup import StartupWatch, phase

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "tests" / "runs" / "tiny.toml"


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_phase_names_every_step_of_a_start_up():
    assert phase({"name": "peer3", "phase": "waiting"}) == "waiting"
    assert phase({"name": "peer3", "error": "exited"}) == "exited"
    assert phase({"state": "joining", "peer_id": ""}) == "joining DHT"
    assert phase({"state": "joining", "peer_id": "12D3KooWx"}) == "choosing stage"
    assert phase({"state": "loading_state", "peer_id": "x"}) == "loading state"
    assert phase({"state": "training", "peer_id": "x"}) == "training"


def test_a_peer_is_stuck_only_after_stall_s_without_any_progress():
    clock = Clock()
    w = StartupWatch(10.0, clock=clock)
    starting = {"name": "p", "phase": "starting"}
    w.observe(starting, log_bytes=0, cpu_s=1.0)
    for _ in range(5):  # importing torch: silent, but it burns CPU: progress
        clock.t += 8
        w.observe(starting, log_bytes=0, cpu_s=1.0 + clock.t / 4)
        assert not w.stalled()
    snap = {"state": "joining", "peer_id": "", "state_for_s": 1.0, "uptime_s": 3.0}
    for _ in range(5):  # a growing log is progress
        clock.t += 8
        w.observe({**snap, "state_for_s": clock.t}, log_bytes=int(clock.t), cpu_s=None)
        assert not w.stalled() and w.phase == "joining DHT"
    same = {**snap, "state_for_s": 0.0}
    w2 = StartupWatch(10.0, clock=clock)
    w2.observe(same, log_bytes=5, cpu_s=None)
    clock.t += 10.5
    w2.observe({**same, "state_for_s": 99.0}, log_bytes=5, cpu_s=None)
    assert w2.stalled() and w2.idle_s() == pytest.approx(10.5)
    w2.observe({**same, "peer_id": "12D3KooWnew"}, log_bytes=5, cpu_s=None)  # a new phase is progress
    assert not w2.stalled() and w2.phase == "choosing stage"


def _args(**kw: object) -> argparse.Namespace:
    base = dict(peers=3, run=None, mode="async", max_steps=0, overrides=[], startup_stall_s=10.0, timeout=0.0)
    return argparse.Namespace(**{**base, **kw})


def _sleeper(tmp_path: Path, name: str, i: int) -> PeerProcess:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    (tmp_path / name).mkdir(exist_ok=True)
    return PeerProcess(name, proc, tmp_path / name, 0, i=i)


def _stuck(swarm: cmd_swarm.Swarm, i: int) -> None:
    clock = Clock()
    swarm.watches[i] = StartupWatch(10.0, clock=clock)
    swarm.watches[i].observe({"name": "x", "phase": "starting"}, log_bytes=0, cpu_s=None)
    clock.t = 11.0


def test_a_late_peer_that_stalls_is_given_up_on_and_the_swarm_goes_on(tmp_path):
    swarm = cmd_swarm.Swarm(_args(), tmp_path, n_stages=2)
    kids = [_sleeper(tmp_path, f"peer{i}", i) for i in range(3)]
    try:
        swarm.children = kids
        swarm.status = {0: {"stage": 0, "state": "training"}, 1: {"stage": 1, "state": "training"}}
        swarm.trained = {0, 1}
        for i in range(3):
            swarm.watches[i] = StartupWatch(10.0)
        _stuck(swarm, 2)
        swarm.step_startup()  # must not raise: every stage trains already
        assert 2 in swarm.failed and kids[2].proc.poll() is not None  # stopped and reaped
        assert kids[0].alive() and kids[1].alive()
        assert "peer2 showed no progress" in swarm.notes[-1] and "goes on without it" in swarm.notes[-1]
        assert swarm.finished(2) is None  # the given-up peer does not end the swarm
        assert swarm.summary()["failed_to_start"]["peer2"].startswith("showed no progress")
    finally:
        swarm.reap(1.0)
    assert all(k.proc.poll() is not None for k in kids)


def test_a_peer_that_stalls_before_the_stages_fill_ends_the_start_up_in_one_line(tmp_path):
    swarm = cmd_swarm.Swarm(_args(), tmp_path, n_stages=2)
    kids = [_sleeper(tmp_path, f"peer{i}", i) for i in range(2)]
    try:
        swarm.children = kids
        swarm.status = {0: {"stage": 0, "state": "training"}}
        swarm.trained = {0}
        swarm.watches[0] = StartupWatch(10.0)
        _stuck(swarm, 1)
        with pytest.raises(cmd_swarm.SwarmStartError) as e:
            swarm.step_startup()
        assert "\n" not in str(e.value) and "--startup-stall-s" in str(e.value) and e.value.exit_code == 3
    finally:
        swarm.reap(1.0)


def test_the_swarm_table_shows_a_row_per_starting_peer_and_its_phase():
    rows = [{"name": "peer0", "state": "training", "peer_id": "12D3KooWAAAAAAAAAAAAA", "stage": 0, "healthy": True,
             "local_step": 3},
            {"name": "peer1", "state": "joining", "peer_id": "", "stage": None, "healthy": True},
            {"name": "peer2", "phase": "starting"}, {"name": "peer3", "phase": "waiting"}]
    console = Console(record=True, width=80)
    console.print(render_swarm(rows, "tiny"))
    text = console.export_text()
    lines = text.splitlines()
    assert any("peer1" in ln and "dht" in ln for ln in lines), text
    assert any("peer2" in ln and "start" in ln for ln in lines), text
    assert any("peer3" in ln and "wait" in ln for ln in lines), text
    assert "1/4 peers up (3 starting)" in text


def test_swarm_help_documents_its_exit_codes(capsys):
    from peer.cli import main

    with pytest.raises(SystemExit):
        main(["swarm", "--help"])
    out = capsys.readouterr().out
    for code in ("0 ", "1 ", "2 ", "3 ", "130"):
        assert f"\n  {code}" in out
    assert "--startup-stall-s" in out


@pytest.mark.timeout(120)
def test_ctrl_c_during_start_up_stops_the_swarm_within_5_s_and_reaps_every_child(tmp_path):
    cmd = [sys.executable, "-m", "peer.cli", "swarm", "--peers", "2", "--run", str(TINY), "--no-tui",
           "--workdir", str(tmp_path), "--set", "join_jitter_s=0.3"]
    parent = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 60
        while not descendants(parent.pid) and time.monotonic() < deadline:  # the first child is up
            time.sleep(0.2)
        time.sleep(1.0)
        kids = descendants(parent.pid)
        assert kids, "swarm started no child"
        t0 = time.monotonic()
        parent.send_signal(signal.SIGINT)
        out, _ = parent.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    assert took < 5 + 2, (took, out)  # STARTING_STOP_S plus the parent's own exit
    assert parent.returncode == 130, out
    assert "Traceback" not in out, out
    time.sleep(0.5)
    alive = [p for p in kids if os.path.exists(f"/proc/{p}") and "zombie" not in _state(p)]
    assert not alive, f"children outlived the swarm: {alive}\n{out}"


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((ln for ln in f if ln.startswith("State:")), "").lower()
    except OSError:
        return "zombie"


def test_a_peer_still_starting_when_the_run_ends_is_not_counted_as_a_failure(tmp_path):
    swarm = cmd_swarm.Swarm(_args(), tmp_path, n_stages=2)
    kids = [_sleeper(tmp_path, f"peer{i}", i) for i in range(3)]
    swarm.children, swarm.trained = kids, {0, 1}
    swarm.reap(1.0)  # the run ended while peer2 was still importing: the swarm stopped it
    s = swarm.summary()
    assert len(s["per_peer"]) == 2 and s["stopped_while_starting"] == ["peer2"]
    assert [c.name for c in swarm.counted()] == ["peer0", "peer1"]
