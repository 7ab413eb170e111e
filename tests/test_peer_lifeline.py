"""A peer's hivemind DHT process and p2pd die with it, even by kill -9, and its identity can be reused at once.

Multi-process: real ``join`` children on the tiny run through tests/swarm_utils.py (reaped by PID pass or fail).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from swarm_utils import swarm  # noqa: F401  (fixture)

from peer.ops.procs import descendants


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an orphan's zombie is reaped by init, never by us)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.mark.timeout(150)
def test_kill9_takes_dht_process_and_p2pd_down_and_the_identity_rejoins(swarm):  # noqa: F811
    a = swarm.start("a", stage="0")
    first = a.wait_maddrs()[:1]
    b = swarm.start("b", stage="1", initial=first)
    b.wait_status(lambda s: s.get("state") == "training", 90, "training state")
    children = descendants(b.proc.pid)
    names = {p: open(f"/proc/{p}/comm").read().strip() for p in children if _alive(p)}
    assert any("p2pd" in n for n in names.values()), names  # the chain is peer -> DHT process -> p2pd
    assert len(children) >= 2, names

    b.signal(signal.SIGKILL)
    b.proc.wait(timeout=10)
    left = _wait_gone(children, 5.0)
    assert not left, f"orphans after kill -9 of the peer: {[(p, names.get(p)) for p in left]}"

    # the same identity, folder and stage right away: the swarm must not think it is taken
    b2 = swarm.start("b", stage="1", initial=first)
    b2.wait_status(lambda s: s.get("state") == "training", 90, "training state after the restart")
    assert b2.alive()
    assert "already taken" not in b2.log()


def test_dht_process_ignores_nothing_of_the_parents_sigterm_handling(tmp_path):
    """A child forked from a process whose asyncio loop handles SIGTERM still dies of SIGTERM (hivemind's
    ``terminate()`` relies on it) after ``_reset_inherited_signals``."""
    code = textwrap.dedent("""
        import asyncio, os, signal, sys, time
        from peer.membership.lifeline import _reset_inherited_signals

        async def main():
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGTERM, lambda: None)
            pid = os.fork()
            if pid == 0:
                if sys.argv[1] == "reset":
                    _reset_inherited_signals()
                time.sleep(30)
                os._exit(3)
            await asyncio.sleep(0.3)
            os.kill(pid, signal.SIGTERM)
            for _ in range(50):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    print("exited", os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM)
                    return
                await asyncio.sleep(0.1)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            print("ignored")

        asyncio.run(main())
    """)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    inherited = subprocess.run([sys.executable, "-c", code, "keep"], capture_output=True, text=True, env=env,
                               timeout=30)
    reset = subprocess.run([sys.executable, "-c", code, "reset"], capture_output=True, text=True, env=env,
                           timeout=30)
    assert inherited.stdout.strip() == "ignored", inherited  # the bug: an inherited asyncio handler swallows it
    assert reset.stdout.strip() == "exited True", reset
