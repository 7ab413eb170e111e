"""Multi-process swarm helpers for tests: `asyncmesh-peer join` children on the tiny run, reaped by PID.

``Swarm`` (used through the ``swarm`` fixture) remembers every process it started and, at teardown, sends SIGTERM
then SIGKILL to each by PID, pass or fail, so no peer outlives its test. The process handling itself is
``peer.ops.procs``, shared with ``asyncmesh-peer swarm`` and the benchmarks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from peer.ops.procs import FAST_SETTINGS, PeerProcess, free_port, join_command, terminate

REPO = Path(__file__).resolve().parent.parent
TINY_RUN = REPO / "tests" / "runs" / "tiny.toml"

FAST = FAST_SETTINGS  # timers short enough for a test swarm of a few seconds (PeerConfig fields, see peer/config.py)

Peer = PeerProcess


class Swarm:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.peers: list[PeerProcess] = []

    def start(self, name: str, *args: str, stage: str = "auto", initial: list[str] | None = None,
              run: Path = TINY_RUN, max_steps: int = 0, extra: tuple[str, ...] = ()) -> PeerProcess:
        d = self.root / name
        port = free_port()
        cmd = join_command(d, port=port, run=run, stage=stage, max_steps=max_steps, settings=(*FAST, *extra),
                           extra=args, initial=initial or ())
        peer = PeerProcess.spawn(name, cmd, d, port, cwd=REPO)
        self.peers.append(peer)
        return peer

    def reap(self) -> None:
        """SIGTERM every peer, SIGKILL what is left after 10 s with its descendants (a peer killed with SIGKILL
        may leave its hivemind DHT process and p2pd behind, and they must not outlive the test)."""
        terminate([p.proc for p in self.peers], 10.0)


@pytest.fixture
def swarm(tmp_path: Path):
    s = Swarm(tmp_path)
    try:
        yield s
    finally:
        s.reap()
