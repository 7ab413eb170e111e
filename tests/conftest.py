"""Session-wide test set-up: one CPU thread per test process, and no child process outlives the session."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from peer.ops import names
from peer.ops.procs import descendants

torch.set_num_threads(1)
names.STRICT = True  # a counter name missing from peer/ops/names.py fails the test that counts it


LOG_TAIL_LINES = 40


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    """A failed multi-process test reports the log tail of every peer it started, not only of the one that failed
    (CI shows only this report: a stalled peer is most often explained by another's log)."""
    report = yield
    swarm = getattr(item, "funcargs", {}).get("swarm")
    if report.failed and call.when == "call" and hasattr(swarm, "peers"):
        for peer in swarm.peers:
            lines = peer.log().splitlines()[-LOG_TAIL_LINES:]
            report.sections.append((f"log of peer {peer.name} (last {len(lines)} lines)", "\n".join(lines)))
    return report


@pytest.fixture(scope="session", autouse=True)
def _reap_children_at_exit():
    """Last line of defence: kill any process this test session started that is still alive when it ends.

    Tests reap their own processes; this only catches what a crashed test left behind. It kills only our own
    descendants, found through /proc, by PID.
    """
    yield
    me = os.getpid()
    for pid in descendants(me):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

