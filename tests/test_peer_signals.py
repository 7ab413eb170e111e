"""SIGTERM is honoured in every start-up phase of ``join``: while the DHT join is retried and while the stage's state
is being loaded from a donor that does not answer. The peer exits within 5 s either way (multi-process)."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
from swarm_utils import swarm  # noqa: F401  (fixture)

from peer.ops.procs import free_port

# a well-formed peer id nobody runs, on a port nobody listens on: the join fails and is retried with backoff
NOBODY = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def _stops_within(peer, seconds: float) -> float:
    t0 = time.monotonic()
    peer.signal(signal.SIGTERM)
    peer.wait_exit(seconds + 10)
    took = time.monotonic() - t0
    assert took < seconds, f"{peer.name} took {took:.1f} s to stop:\n{peer.log()[-2000:]}"
    return took


@pytest.mark.timeout(120)
def test_sigterm_during_dht_join_retries_stops_at_once(swarm):  # noqa: F811
    p = swarm.start("p", stage="0", initial=[NOBODY])
    p.wait_for(lambda: "joining the DHT failed" in p.log(), 60, "a failed DHT join")
    time.sleep(0.5)  # inside the backoff (or the next attempt)
    _stops_within(p, 5.0)
    assert p.proc.returncode == 0
    assert "Traceback" not in p.log()


@pytest.mark.timeout(240)
def test_sigterm_while_loading_state_from_a_silent_donor_stops_at_once(swarm):  # noqa: F811
    a = swarm.start("a", stage="0")
    first = a.wait_maddrs()[:1]
    b = swarm.start("b", stage="1", initial=first, extra=("record_ttl_s=60",))
    a.wait_status(lambda s: s["local_step"] >= 3, 120, "3 steps")
    b.signal(signal.SIGSTOP)  # the donor stops answering, its record stays
    try:
        c = swarm.start("c", stage="1", initial=first, extra=("state_load_timeout_s=120",))
        c.wait_for(lambda: "state sources" in c.log(), 90, "the state load")
        time.sleep(1.0)  # waiting on the silent donor's first chunk
        _stops_within(c, 5.0)
        assert c.proc.returncode == 0
        assert "Traceback" not in c.log()
        assert not (c.dir / "ckpt" / "stage-1.pt").exists()  # an unloaded worker is never checkpointed
    finally:
        b.signal(signal.SIGCONT)


@pytest.mark.timeout(60)
def test_a_tool_killed_with_sigterm_unwinds_and_reaps_its_children(tmp_path):
    """The benchmark tools start peers and reap them in ``finally``; Python's default SIGTERM would skip that and
    leave the peers running (orphans of a killed benchmark). ``unwind_on_sigterm`` makes SIGTERM unwind."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "tool.py"
    script.write_text(
        "import subprocess, sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})\n"
        "from peer.ops.procs import terminate, unwind_on_sigterm\n"
        "unwind_on_sigterm()\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(tmp_path / 'child.pid')!r}, 'w').write(str(child.pid))\n"
        "try:\n"
        "    time.sleep(120)\n"
        "finally:\n"
        "    terminate([child], 5.0)\n"
        f"    open({str(tmp_path / 'reaped')!r}, 'w').write('yes')\n")
    tool = subprocess.Popen([sys.executable, str(script)])
    try:
        pid_file = tmp_path / "child.pid"
        deadline = time.monotonic() + 30
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        child = int(pid_file.read_text())
        tool.send_signal(signal.SIGTERM)
        tool.wait(20)
        assert (tmp_path / "reaped").read_text() == "yes"
        assert not Path(f"/proc/{child}").exists() or "zombie" in Path(f"/proc/{child}/status").read_text().lower()
    finally:
        if tool.poll() is None:
            tool.kill()
            tool.wait()
        if (tmp_path / "child.pid").exists():  # reaped by the tool unless the test failed
            with contextlib.suppress(ProcessLookupError):
                os.kill(int((tmp_path / "child.pid").read_text()), signal.SIGKILL)
