"""Live: real `join` peers on 127.0.0.1; the dashboard drawn from their /status, and `monitor` reading the DHT.

One swarm serves the module: two peers first (the dashboard test), then a third joins (the monitor test).
With ASYNCMESH_DASHBOARD_SVG=DIR set, the dashboard test also saves the screenshots docs/dashboard.md shows.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from peer.ids import short_id
from peer.ops.dashboard import Dashboard
from peer.ops.procs import free_port, terminate
from peer.ops.status_server import fetch_status

ROOT = Path(__file__).resolve().parent.parent


class LivePeers:
    """`join` children with status endpoints; every one is reaped (SIGTERM, then SIGKILL by PID)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.peers: list[dict[str, Any]] = []
        self.initial: list[str] = []

    def spawn(self) -> dict[str, Any]:
        i = len(self.peers)
        d = self.workdir / f"peer{i}"
        d.mkdir()
        port = free_port()
        cmd = [sys.executable, "-m", "peer.cli", "join", "--no-tui", "--stage", "auto",
               "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity", str(d / "identity.key"),
               "--metrics-port", str(port), "--torch-threads", "1", "--log-level", "INFO",
               "--set", f"maddrs_file={d / 'maddrs.txt'}", "--set", "drain_timeout_s=3",
               "--set", "eval_every_s=3", "--set", "announce_every_s=2", "--set", "record_ttl_s=10"]
        if self.initial:
            cmd += ["--initial-peers", *self.initial]
        log = open(d / "log.txt", "wb")  # noqa: SIM115 - closed in stop()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        peer = {"proc": proc, "port": port, "dir": d, "log": log}
        self.peers.append(peer)
        if not self.initial:
            text = self._wait(lambda: (d / "maddrs.txt").exists() and (d / "maddrs.txt").read_text(), peer, 60)
            self.initial = [m for m in text.split() if "/p2p/" in m][:1]
        return peer

    def status(self, peer: dict[str, Any]) -> dict[str, Any] | None:
        try:
            return asyncio.run(fetch_status("127.0.0.1", peer["port"], timeout=2.0))
        except (OSError, ValueError, TimeoutError):
            return None

    def wait_training(self, peers: list[dict[str, Any]], timeout: float = 150) -> list[dict[str, Any]]:
        """Status snapshots of ``peers`` once every one of them trains (fails at once if any peer exits)."""
        deadline = time.monotonic() + timeout
        while True:
            snaps = [self.status(p) for p in peers]
            if all(s and s["state"] == "training" and s["local_step"] > 0 and s["tokens_per_s"] > 0 for s in snaps):
                return snaps
            self._check_alive()
            if time.monotonic() > deadline:
                states = [s and (s["state"], s["local_step"]) for s in snaps]
                pytest.fail(f"peers not training after {timeout:.0f} s ({states}):\n"
                            + "\n".join(self.log_tail(p) for p in peers))
            time.sleep(0.5)

    def _check_alive(self) -> None:
        for p in self.peers:
            if p["proc"].poll() is not None:
                pytest.fail(f"peer {p['dir'].name} exited with {p['proc'].returncode}:\n{self.log_tail(p)}")

    def _wait(self, fn: Any, peer: dict[str, Any], timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = fn()
            if value:
                return value
            self._check_alive()
            time.sleep(0.5)
        pytest.fail(f"peer not ready after {timeout:.0f} s:\n{self.log_tail(peer)}")

    @staticmethod
    def log_tail(peer: dict[str, Any]) -> str:
        peer["log"].flush()
        return (peer["dir"] / "log.txt").read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        terminate([p["proc"] for p in self.peers], 30.0)
        for p in self.peers:
            p["log"].close()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LivePeers]:
    peers = LivePeers(tmp_path_factory.mktemp("live"))
    try:
        yield peers
    finally:
        peers.stop()


async def fetch_text(port: int, path: str) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(-1), 10)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return body.decode()


def draw(renderable: Any) -> tuple[str, Console]:
    console = Console(record=True, width=80, color_system="truecolor", force_terminal=True)
    console.print(renderable)
    return console.export_text(clear=False), console


def tokens_per_s(text: str) -> float:
    value, suffix = re.search(r"([\d.]+)(k|M)? tok/s", text).groups()
    return float(value) * {"k": 1e3, "M": 1e6, None: 1.0}[suffix]


@pytest.mark.timeout(300)
def test_dashboard_of_a_live_two_peer_swarm(live: LivePeers) -> None:
    a = live.spawn()
    b = live.spawn()
    first = live.wait_training([a, b])
    assert sorted(s["stage"] for s in first) == [0, 1]
    time.sleep(4)
    for before, after in zip(first, live.wait_training([a, b]), strict=True):
        text_before, _ = draw(Dashboard(before).render())
        text_after, console = draw(Dashboard(after).render())
        for field in ("state", "training", "progress", "tok/s", "loss", "train", "staleness", "pipeline",
                      "batches", "in flight", "dropped", "retries", "network", "B/token", "averaging",
                      "rounds", "swarm", "rejected", f"stage {after['stage']}"):
            assert field in text_after, field
        assert short_id(after["peer_id"]) in text_after  # the one abbreviation (peer.ids)
        assert tokens_per_s(text_before) > 0 and tokens_per_s(text_after) > 0
        step_before = int(re.search(r"step ([\d,]+)", text_before).group(1).replace(",", ""))
        step_after = int(re.search(r"step ([\d,]+)", text_after).group(1).replace(",", ""))
        assert step_after > step_before, (step_before, step_after)
        assert after["tokens_total"] > before["tokens_total"]
        # traffic is counted where it crosses the wire (protocol.rpc), both directions, and shown per token
        assert after["bytes_in_per_s"] > 0 and after["bytes_out_per_s"] > 0 and after["bytes_per_token"] > 0
        assert "in 0 B/s" not in text_after and "out 0 B/s" not in text_after
        if after["stage"] == 0 and os.environ.get("ASYNCMESH_DASHBOARD_SVG"):
            console.save_svg(str(Path(os.environ["ASYNCMESH_DASHBOARD_SVG"]) / "dashboard.svg"),
                             title="asyncmesh-peer join")
    table, _ = draw(Dashboard([live.status(a), live.status(b)]).render())
    assert "2/2 peers up" in table and "stages 0:1 1:1" in table

    # the CLI and the Prometheus endpoint of a live peer report the same peer and figures that only move forward
    out = subprocess.run([sys.executable, "-m", "peer.cli", "status", "--port", str(a["port"]), "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    prom = asyncio.run(fetch_text(a["port"], "/metrics"))
    assert f'peer_id="{snap["peer_id"]}"' in prom
    step = float(re.search(r"^asyncmesh_local_step (\S+)$", prom, re.M).group(1))
    tokens = float(re.search(r"^asyncmesh_tokens_total (\S+)$", prom, re.M).group(1))
    assert step >= snap["local_step"] > 0 and tokens >= snap["tokens_total"] > 0


@pytest.mark.timeout(300)
def test_monitor_lists_every_peer_of_a_live_three_peer_swarm(live: LivePeers) -> None:
    if len(live.peers) < 2:
        pytest.skip("needs the two peers of the dashboard test")
    third = live.spawn()
    snaps = live.wait_training(live.peers)
    expected = {s["peer_id"]: s["stage"] for s in snaps}
    deadline = time.monotonic() + 60
    while True:  # records are re-announced every 2 s; the newcomer may take one round to appear
        out = subprocess.run([sys.executable, "-m", "peer.cli", "monitor", "--initial-peers", *live.initial,
                              "--once", "--json", "--timeout", "5"], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        view = json.loads(out.stdout)
        listed = {p["peer_id"]: s["stage"] for s in view["stages"] for p in s["peers"]}
        if all(listed.get(pid) == stage for pid, stage in expected.items()) or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert listed == expected
    assert view["coverage"] == 1.0 and view["n_peers"] == 3
    assert view["swarm_tokens_per_s"] > 0
    if os.environ.get("ASYNCMESH_DASHBOARD_SVG"):
        from peer.cli.monitor import render

        _, console = draw(Dashboard([live.status(p) for p in live.peers]).render())
        console.save_svg(str(Path(os.environ["ASYNCMESH_DASHBOARD_SVG"]) / "dashboard.swarm.svg"),
                         title="asyncmesh-peer swarm")
        _, console = draw(render(view))
        console.save_svg(str(Path(os.environ["ASYNCMESH_DASHBOARD_SVG"]) / "dashboard.monitor.svg"),
                         title="asyncmesh-peer monitor")
    assert third["proc"].poll() is None


@pytest.mark.slow  # ~45 s; the drain countdown and the fork guard also have fast unit tests
@pytest.mark.timeout(300)
def test_ctrl_c_on_the_dashboard_shows_the_drain_countdown_and_exits_cleanly(live: LivePeers, tmp_path: Path) -> None:
    """`join` with its dashboard on a terminal (a pty): Ctrl-C turns the panel to 'draining' with a countdown."""
    import pty
    import select

    if not live.initial:  # run alone (pytest -m slow): start a peer for it to join
        live.spawn()
    pid, fd = pty.fork()
    if pid == 0:  # the child: a peer with its dashboard on the pty
        os.chdir(ROOT)
        os.environ.update(COLUMNS="80", LINES="30")
        os.execv(sys.executable, [sys.executable, "-m", "peer.cli", "join", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                                  "--identity", str(tmp_path / "identity.key"), "--torch-threads", "1",
                                  "--set", "drain_timeout_s=6", "--initial-peers", *live.initial])
    out = b""

    def read_until(pattern: bytes, timeout: float) -> bool:
        nonlocal out
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if re.search(pattern, strip(out)):
                return True
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                try:
                    out += os.read(fd, 65536)
                except OSError:  # the child closed the pty: it exited
                    return bool(re.search(pattern, strip(out)))
        return False

    def strip(data: bytes) -> bytes:
        return re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]", b"", data)

    try:
        assert read_until(rb"training for \d+s", 150), strip(out)[-3000:].decode(errors="replace")
        os.kill(pid, signal.SIGINT)
        assert read_until(rb"stopped for", 90), strip(out)[-3000:].decode(errors="replace")
        _, status = os.waitpid(pid, 0)
        pid = 0
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)
    text = strip(out).decode(errors="replace")
    after = text[text.index("SIGINT"):] if "SIGINT" in text else text
    assert re.search(r"draining for \d+s", after) and re.search(r"\d+ s left · \d+ in flight", after), after[-3000:]
    assert os.waitstatus_to_exitcode(status) == 0
