"""Child peer processes: start ``asyncmesh-peer join`` children, read what they report, and reap them by PID.

One module for everything that manages peer processes from the outside, used by ``asyncmesh-peer swarm``, the
benchmarks in tools/ and the multi-process tests:

* ``join_command`` builds a child's command line with its files in one folder (identity key, checkpoints, summary,
  multiaddrs, log), so every caller lays a peer out the same way;
* ``PeerProcess`` wraps the running child: its ``/status``, multiaddrs, summary and log, with waits that fail with the
  peer's log tail instead of hanging;
* ``terminate`` ends children whatever happens: SIGTERM, a deadline, then SIGKILL of the child *and* its descendants
  (a peer's hivemind DHT process and p2pd) by PID; ``descendants`` walks /proc for them.

Everything here ends only processes it was handed or their descendants, never anything found by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from peer.ops.status_server import fetch_status

T = TypeVar("T")

logger = logging.getLogger(__name__)

CLK_TCK = os.sysconf("SC_CLK_TCK")
FAST_SETTINGS = ("announce_every_s=1", "record_ttl_s=4", "dht_timeout_s=3", "rpc_timeout_s=5",
                 "microbatch_timeout_s=15", "eval_every_s=3", "join_jitter_s=0.3", "drain_timeout_s=5",
                 "state_load_timeout_s=30", "reachability_timeout_s=3", "rebalance_every_s=0", "checkpoint_every_s=0",
                 "ban_base_s=1")
"""Peer settings (``--set``) for a loopback swarm that must act within seconds: the multi-process tests and the
lab tools (short timers, no rebalancing, no periodic checkpoints, an evaluation every 3 s)."""
StatusFetch = Callable[["PeerProcess"], "dict[str, Any] | None"]


def unwind_on_sigterm() -> None:
    """Make SIGTERM behave like Ctrl-C (KeyboardInterrupt) in this process, so that the ``finally`` blocks and
    ``with`` blocks of a tool that started peers reap them on both (Python's default SIGTERM ends the process at
    once and leaves its children running). A no-op outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


class PeerProcessError(RuntimeError):
    """A child peer exited or did not reach a state in time; the message ends with its log tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (the child binds it soon after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def descendants(root: int) -> list[int]:
    """PIDs of every live descendant of ``root``, found through /proc (children before grandchildren)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process (None once it has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, ValueError, IndexError):
        return None


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every descendant of it (descendants first found, then killed, so none is re-parented)."""
    for p in [*descendants(pid), pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def terminate(procs: Sequence[subprocess.Popen[bytes]], stop_timeout_s: float) -> None:
    """SIGTERM every live process, wait up to ``stop_timeout_s`` in all, then SIGKILL what is left with its
    descendants. Every process is reaped; a child that led its own session also has its process group killed, so
    nothing it started outlives it."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + stop_timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("pid %d ignored SIGTERM for %.0f s; killing it and its descendants", p.pid, stop_timeout_s)
            kill_tree(p.pid)
            p.wait()
    for p in procs:  # a child that led its own session leaves its group behind it: its DHT process, p2pd
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)


def join_command(workdir: Path, *, port: int, run: str | Path | None = None, stage: str | int = "auto",
                 mode: str | None = None, max_steps: int = 0, torch_threads: int = 1,
                 host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",), announce_maddrs: Sequence[str] = (),
                 settings: Sequence[str] = (), initial: Sequence[str] = (), extra: Sequence[str] = (),
                 checkpoints: bool = True) -> list[str]:
    """The command line of one ``join`` child whose files all live in ``workdir``.

    Args:
        workdir: the peer's folder: identity.key, ckpt/, summary.json, maddrs.txt (log.txt is the caller's).
        port: its ``--metrics-port`` (``/status`` and ``/metrics``).
        run: run TOML, or None for the embedded default run.
        settings: ``FIELD=VALUE`` peer settings, each passed with ``--set``.
        initial: multiaddrs to join through (none: the child starts a new swarm).
        extra: further arguments, appended as given.
        checkpoints: keep checkpoints in ``workdir/ckpt`` (benchmarks turn them off: they cost compute time).
    """
    cmd = [sys.executable, "-m", "peer.cli", "join", "--no-tui", "--stage", str(stage),
           "--identity", str(workdir / "identity.key"), "--summary-json", str(workdir / "summary.json"),
           "--metrics-port", str(port),
           "--max-steps", str(max_steps), "--torch-threads", str(torch_threads),
           "--host-maddrs", *host_maddrs, "--set", f"maddrs_file={workdir / 'maddrs.txt'}"]
    if checkpoints:
        cmd += ["--checkpoint-dir", str(workdir / "ckpt")]
    if announce_maddrs:
        cmd += ["--announce-maddrs", *announce_maddrs]
    if run is not None:
        cmd += ["--run", str(run)]
    if mode is not None:
        cmd += ["--mode", mode]
    for item in settings:
        cmd += ["--set", item]
    cmd += list(extra)
    if initial:
        cmd += ["--initial-peers", *initial]
    return cmd


def fetch_status_http(peer: PeerProcess) -> dict[str, Any] | None:
    """The peer's ``/status`` on 127.0.0.1, or None when it does not answer (yet)."""
    try:
        return asyncio.run(fetch_status("127.0.0.1", peer.port, timeout=2.0))
    except (OSError, ValueError, TimeoutError):
        return None


class PeerProcess:
    """One running ``join`` child and the files it writes in its folder.

    Args:
        name: label used in messages ("peer3").
        proc: the child (started by the caller: ``spawn`` below, or inside a network namespace by tools/wan.py).
        workdir: the folder ``join_command`` pointed it at; its output goes to ``workdir/log.txt``.
        port: its status port.
        fetch: how to read its ``/status`` (default: HTTP on 127.0.0.1; a namespace needs its own).
    """

    def __init__(self, name: str, proc: subprocess.Popen[bytes], workdir: Path, port: int, *,
                 fetch: StatusFetch = fetch_status_http, **info: Any) -> None:
        self.name, self.proc, self.dir, self.port, self._fetch = name, proc, workdir, port, fetch
        self.info = info  # caller's labels (index, planned stage, ...)

    @classmethod
    def spawn(cls, name: str, cmd: list[str], workdir: Path, port: int, *, cwd: Path | None = None,
              popen: Callable[..., subprocess.Popen[bytes]] = subprocess.Popen, **info: Any) -> PeerProcess:
        """Start ``cmd`` in its own session (so its group can be killed), output appended to ``workdir/log.txt``."""
        workdir.mkdir(parents=True, exist_ok=True)
        with open(workdir / "log.txt", "ab") as log:
            proc = popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return cls(name, proc, workdir, port, **info)

    # ----- what it reports ------------------------------------------------------------------------------------------
    def alive(self) -> bool:
        return self.proc.poll() is None

    def status(self) -> dict[str, Any] | None:
        return self._fetch(self)

    @property
    def maddrs(self) -> list[str]:
        path = self.dir / "maddrs.txt"
        return path.read_text().split() if path.exists() else []

    def summary(self) -> dict[str, Any]:
        """Its ``--summary-json`` with its exit code, or an error entry when it wrote none."""
        path = self.dir / "summary.json"
        try:
            entry = json.loads(path.read_text()) if path.exists() else {"error": "no summary written"}
        except (OSError, ValueError) as e:
            entry = {"error": f"unreadable summary: {e}"}
        entry["exit_code"] = self.proc.returncode
        return entry

    def log(self) -> str:
        path = self.dir / "log.txt"
        return path.read_text(errors="replace") if path.exists() else ""

    def fail(self, what: str) -> PeerProcessError:
        return PeerProcessError(f"{self.name} {what}; {self.dir / 'log.txt'} ends:\n{self.log()[-3000:]}")

    # ----- waiting --------------------------------------------------------------------------------------------------
    def wait_for(self, fn: Callable[[], T | None], timeout: float, what: str, every_s: float = 0.2) -> T:
        """Poll ``fn()`` until it returns something truthy; fail at once if the child exits."""
        deadline = time.monotonic() + timeout
        while True:
            value = fn()
            if value:
                return value
            if not self.alive():
                raise self.fail(f"exited with code {self.proc.returncode} before {what}")
            if time.monotonic() > deadline:
                raise self.fail(f"gave no {what} within {timeout:.0f} s")
            time.sleep(every_s)

    def wait_status(self, pred: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            s = self.status()
            return s if s is not None and pred(s) else None
        return self.wait_for(ready, timeout, what, 0.3)

    def wait_maddrs(self, timeout: float = 60.0) -> list[str]:
        return self.wait_for(lambda: self.maddrs, timeout, "multiaddrs", 0.1)

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise self.fail(f"did not exit within {timeout:.0f} s") from None

    def signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)


def p2p_maddrs(maddrs: Sequence[str], host: str | None = None) -> list[str]:
    """The full multiaddrs (with ``/p2p/ID``) among ``maddrs``, optionally only those on ``host``."""
    return [m for m in maddrs if "/p2p/" in m and (host is None or f"/{host}/" in m)]
