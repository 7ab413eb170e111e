"""Multi-process swarm helpers for tests: start `asyncmesh-peer join` children, read their files, reap them by PID.

``Swarm`` (used through the ``swarm`` fixture) remembers every process it started and, at teardown, sends SIGTERM
then SIGKILL to each by PID, pass or fail, so no peer outlives its test.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
TINY_RUN = REPO / "tests" / "runs" / "tiny.toml"

# timers short enough for a test swarm of a few seconds (each is a PeerConfig field, see peer/config.py)
FAST = ("announce_every_s=1", "record_ttl_s=4", "dht_timeout_s=3", "rpc_timeout_s=5", "microbatch_timeout_s=15",
        "eval_every_s=3", "join_jitter_s=0.3", "drain_timeout_s=5", "state_load_timeout_s=30",
        "reachability_timeout_s=3", "rebalance_every_s=0", "checkpoint_every_s=0", "ban_base_s=1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Peer:
    def __init__(self, name: str, proc: subprocess.Popen, workdir: Path, port: int) -> None:
        self.name, self.proc, self.dir, self.port = name, proc, workdir, port

    def status(self) -> dict[str, Any] | None:
        """The peer's /status snapshot, or None when it does not answer (yet)."""
        from peer.status_server import fetch_status

        try:
            return asyncio.run(fetch_status("127.0.0.1", self.port, timeout=2.0))
        except Exception:
            return None

    def wait_status(self, pred, timeout: float, what: str) -> dict[str, Any]:
        """Poll /status until ``pred(snapshot)`` holds; fails with the peer's log tail otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            snap = self.status()
            if snap is not None and pred(snap):
                return snap
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited ({self.proc.returncode}) before {what}:\n"
                                     f"{self.log()[-3000:]}")
            time.sleep(0.3)
        raise AssertionError(f"{self.name}: no {what} within {timeout} s:\n{self.log()[-3000:]}")

    @property
    def maddrs(self) -> list[str]:
        path = self.dir / "maddrs.txt"
        return path.read_text().split() if path.exists() else []

    def summary(self) -> dict[str, Any] | None:
        path = self.dir / "summary.json"
        return json.loads(path.read_text()) if path.exists() else None

    def log(self) -> str:
        return (self.dir / "log.txt").read_text(errors="replace")

    def wait_maddrs(self, timeout: float = 60.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.maddrs:
                return self.maddrs
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            time.sleep(0.1)
        raise AssertionError(f"{self.name} did not listen within {timeout} s:\n{self.log()[-3000:]}")

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not exit within {timeout} s:\n{self.log()[-3000:]}") from None

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)


class Swarm:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.peers: list[Peer] = []

    def start(self, name: str, *args: str, stage: str = "auto", initial: list[str] | None = None,
              run: Path = TINY_RUN, max_steps: int = 0, extra: tuple[str, ...] = ()) -> Peer:
        d = self.root / name
        d.mkdir(parents=True, exist_ok=True)
        port = free_port()
        cmd = [sys.executable, "-m", "peer.cli", "join", "--no-tui", "--run", str(run), "--stage", stage,
               "--identity", str(d / "identity.key"), "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
               "--summary-json", str(d / "summary.json"), "--checkpoint-dir", str(d / "ckpt"),
               "--max-steps", str(max_steps), "--torch-threads", "1", "--metrics-port", str(port),
               "--set", f"maddrs_file={d / 'maddrs.txt'}",
               *[x for item in (*FAST, *extra) for x in ("--set", item)], *args]
        if initial:
            cmd += ["--initial-peers", *initial]
        with open(d / "log.txt", "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        peer = Peer(name, proc, d, port)
        self.peers.append(peer)
        return peer

    def reap(self) -> None:
        """SIGTERM every peer, SIGKILL what is left after 10 s, then kill each peer's process group: a peer killed
        with SIGKILL leaves its hivemind DHT process and p2pd behind, and they must not outlive the test."""
        for p in self.peers:
            p.signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.peers:
            try:
                p.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.kill(p.proc.pid, signal.SIGKILL)
                p.proc.wait()
        for p in self.peers:  # each peer leads its own session (start_new_session), so its pgid is its pid
            try:
                os.killpg(p.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def swarm(tmp_path: Path):
    s = Swarm(tmp_path)
    try:
        yield s
    finally:
        s.reap()
