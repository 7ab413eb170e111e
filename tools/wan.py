#!/usr/bin/env python3
"""An emulated WAN for benchmarks: one network namespace per peer, joined through a user-space link emulator.

The kernel here has no ``netem`` queueing discipline, so the links come from this project's user-space emulator,
``tools/netem.py`` (run with this interpreter): it puts one TUN device in each namespace, addresses namespace ``i``
(0-based) as ``<subnet>.<i+1>`` and forwards IPv4 between them with a one-way delay (RTT = 2 x delay), a per-sender
rate cap with a bounded queue and optional loss, counting every packet it forwards or drops. Peers must use
100.64.x.y addresses: libp2p does not gossip 198.18.0.0/15.

``Wan`` is a context manager that owns everything it starts: the namespaces (named ``<prefix><pid>-<i>``, so a run
never touches namespaces it did not create), the emulator process and every command started with ``popen``. Leaving the
``with`` block -- normally, on an exception or on Ctrl-C/SIGTERM (``unwind_on_sigterm``) -- terminates the
commands (SIGTERM, then SIGKILL after ``stop_timeout_s``), kills anything still inside the namespaces, stops the
emulator with SIGTERM (its last line, the packet counters, is kept: ``counters()``), reaps all of them and deletes the
namespaces. ``LocalNet`` has the same interface on loopback.
``python tools/wan.py clean`` deletes namespaces left by a run that was itself SIGKILLed.

Example (root)::

    with Wan(WanConfig(n=2, delay_ms=25, rate_mbit=100)) as wan:
        print(wan.rtt(0, 1))                     # ~0.050 s
        proc = wan.popen(1, ["python3", "-m", "http.server", "--bind", wan.ip(1)])
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

if __package__ in (None, ""):  # run as a script: make the packages importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peer.ops.procs import terminate, unwind_on_sigterm  # noqa: E402 - one place reaps child processes

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_EMULATOR = REPO / "tools" / "netem.py"
READY, STATS, EXIT = "netem ready", "netem stats", "netem exit"  # the emulator's output lines (tools/netem.py)
CLONE_NEWNET = 0x40000000
LINGER_S = 3.0  # after its commands exit, wait this long for their children to leave the namespaces
T = TypeVar("T")


class WanError(RuntimeError):
    """The emulated WAN cannot be set up or used (the message says what to do)."""


@dataclass(frozen=True, kw_only=True)
class WanConfig:
    """One emulated network. Times are in seconds unless the name says ms."""

    n: int
    """Namespaces to create (one per peer)."""
    delay_ms: float = 0.0
    """One-way delay added to every packet (RTT = 2 x delay_ms)."""
    rate_mbit: float = 0.0
    """Per-namespace uplink cap in Mbit/s (0: uncapped; see docs/performance.md for the emulator's own ceiling)."""
    loss: float = 0.0
    """Random drop probability per packet."""
    jitter_ms: float = 0.0
    """Uniform +/- jitter on the delay (may reorder packets)."""
    subnet: str = "100.64.7"
    """First three octets of the addresses; namespace i gets <subnet>.<i+1>. Keep it inside 100.64.0.0/10."""
    prefix: str = "amb-"
    """Namespace name prefix; names are <prefix><pid>-<i>, and only those are ever deleted."""
    queue_ms: float = 200.0
    """Uplink buffer of the rate cap, in ms of the rate; a packet that does not fit is dropped."""
    seed: int | None = None
    """Seed of the emulator's loss and jitter draws (None: random)."""
    slow_start_after_idle: bool = True
    """TCP's restart from a small window on a connection idle for an RTO (Linux's default, per namespace). Off, a
    connection used in bursts (the synchronous barrier's gradient exchange, once a step) keeps its window: what a
    tuned cluster runs (``net.ipv4.tcp_slow_start_after_idle = 0``)."""
    emulator: Path = field(default_factory=lambda: DEFAULT_EMULATOR)
    """Path of the link emulator (tools/netem.py, run with this interpreter)."""
    ready_timeout_s: float = 15.0
    """Wait this long for the emulator to report its devices up."""
    stop_timeout_s: float = 10.0
    """After SIGTERM, wait this long for a process before SIGKILL."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "emulator", Path(self.emulator))
        if not 1 <= self.n <= 250:
            raise ValueError(f"n must be between 1 and 250 namespaces, got {self.n}")
        if self.delay_ms < 0 or self.rate_mbit < 0 or self.jitter_ms < 0 or self.queue_ms < 0:
            raise ValueError("delay_ms, rate_mbit, jitter_ms and queue_ms must be >= 0")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"loss must be in [0, 1), got {self.loss}")
        if not re.fullmatch(r"100\.(6[4-9]|[7-9]\d|1[01]\d|12[0-7])\.\d{1,3}", self.subnet) or \
                int(self.subnet.rsplit(".", 1)[1]) > 255:
            raise ValueError(f"subnet must be three octets inside 100.64.0.0/10 (e.g. 100.64.7), got "
                             f"{self.subnet!r}; libp2p does not gossip other private ranges such as 198.18.0.0/15")
        if not re.fullmatch(r"[a-z][a-z0-9-]{0,5}", self.prefix):
            raise ValueError(f"prefix must be 1-6 lowercase letters, digits or '-', got {self.prefix!r}")
        if self.ready_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise ValueError("ready_timeout_s and stop_timeout_s must be positive (seconds)")


def check_available(emulator: Path = DEFAULT_EMULATOR) -> str | None:
    """None when this machine can run a Wan, else the reason (root, ``ip``, /dev/net/tun, the emulator)."""
    if os.geteuid() != 0:
        return "network namespaces need root; run as root or benchmark on loopback only"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing; install iproute2"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing; load the tun module (modprobe tun) or give the container that device"
    if not Path(emulator).is_file():
        return (f"the link emulator {emulator} does not exist; pass the path of tools/netem.py from this "
                "repository")
    return None


def _setns(name: str) -> None:
    """Move the *calling thread* into network namespace ``name`` (a network namespace is per thread)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


class Wan:
    """N namespaces joined by the link emulator; every namespace and process it creates is removed on exit."""

    def __init__(self, cfg: WanConfig) -> None:
        self.cfg = cfg
        self.names = [f"{cfg.prefix}{os.getpid()}-{i}" for i in range(cfg.n)]
        self.created: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.emulator: subprocess.Popen | None = None
        self.emulator_log: list[str] = []
        self.devices: list[str] = [f"netem{i + 1}" for i in range(cfg.n)]  # replaced by what the ready line says
        self._counters: dict[str, Any] | None = None
        self._counters_seen = 0
        self._counters_cv = threading.Condition()
        self._reader: threading.Thread | None = None

    # ----- life ------------------------------------------------------------------------------------------------------
    def __enter__(self) -> Wan:
        reason = check_available(self.cfg.emulator)
        if reason:
            raise WanError(reason)
        try:
            self._up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _up(self) -> None:
        for name in self.names:
            res = _ip("netns", "add", name)
            if res.returncode != 0:
                raise WanError(f"ip netns add {name} failed: {res.stderr.strip()}")
            self.created.append(name)
            res = _ip("-n", name, "link", "set", "lo", "up")
            if res.returncode != 0:
                raise WanError(f"bringing lo up in {name} failed: {res.stderr.strip()}")
            if not self.cfg.slow_start_after_idle:
                res = _ip("netns", "exec", name, "sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0")
                if res.returncode != 0:
                    raise WanError(f"turning TCP's slow start after idle off in {name} failed: {res.stderr.strip()}")
        cmd = [sys.executable, "-u", str(self.cfg.emulator), "--ns", *self.names, "--delay-ms",
               str(self.cfg.delay_ms), "--jitter-ms", str(self.cfg.jitter_ms), "--loss", str(self.cfg.loss),
               "--rate-mbit", str(self.cfg.rate_mbit), "--queue-ms", str(self.cfg.queue_ms), "--subnet",
               self.cfg.subnet]
        if self.cfg.seed is not None:
            cmd += ["--seed", str(self.cfg.seed)]
        self.emulator = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                         start_new_session=True)
        ready = threading.Event()
        self._reader = threading.Thread(target=self._read_emulator, args=(ready,), daemon=True)
        self._reader.start()
        if not ready.wait(self.cfg.ready_timeout_s):
            tail = "".join(self.emulator_log[-10:])
            raise WanError(f"the link emulator did not come up within {self.cfg.ready_timeout_s:.0f} s "
                           f"(exit code {self.emulator.poll()}); its output:\n{tail}")
        logger.info("WAN up: %d namespaces %s.., one-way delay %.1f ms, uplink cap %s", self.cfg.n, self.names[0],
                    self.cfg.delay_ms, f"{self.cfg.rate_mbit:g} Mbit/s" if self.cfg.rate_mbit else "none")

    def _read_emulator(self, ready: threading.Event) -> None:
        assert self.emulator is not None and self.emulator.stdout is not None
        for line in self.emulator.stdout:
            self.emulator_log.append(line)
            del self.emulator_log[:-200]
            tag, payload = parse_emulator_line(line)
            if tag == READY:
                if payload and len(payload.get("devices", [])) == self.cfg.n:
                    self.devices = [str(d) for d in payload["devices"]]
                ready.set()
            elif tag in (STATS, EXIT) and payload is not None:
                with self._counters_cv:
                    self._counters = payload
                    self._counters_seen += 1
                    self._counters_cv.notify_all()

    def close(self) -> None:
        """Terminate commands, stop the emulator, delete our namespaces. Idempotent; never raises for a lost part."""
        terminate(self.procs, self.cfg.stop_timeout_s)
        deadline = time.monotonic() + LINGER_S  # a peer's DHT process and p2pd exit a moment after the peer
        while self.created and self._pids_inside() and time.monotonic() < deadline:
            time.sleep(0.1)
        for name, pid in self._pids_inside() if self.created else []:
            logger.warning("killing pid %s left in namespace %s", pid, name)  # started by us, or it would not be there
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        if self.emulator is not None:
            terminate([self.emulator], self.cfg.stop_timeout_s)
            if self._reader is not None:
                self._reader.join(timeout=2.0)  # its last line is the emulator's packet counts
            if self.emulator.stdout is not None:
                with contextlib.suppress(Exception):
                    self.emulator.stdout.close()
        failed = []
        for name in list(self.created):
            res = _ip("netns", "delete", name)
            if res.returncode == 0 or "No such file" in res.stderr:
                self.created.remove(name)
            else:
                failed.append(f"{name}: {res.stderr.strip()}")
        if failed:
            logger.error("could not delete namespaces (delete them with `ip netns delete NAME`): %s", failed)

    def _pids_inside(self) -> list[tuple[str, str]]:
        return [(name, pid) for name in self.created for pid in _ip("netns", "pids", name).stdout.split()]

    # ----- use -------------------------------------------------------------------------------------------------------
    def ip(self, i: int) -> str:
        """IPv4 address of namespace i inside the emulated network."""
        self._check_index(i)
        return f"{self.cfg.subnet}.{i + 1}"

    def popen(self, i: int, cmd: list[str], **kw: Any) -> subprocess.Popen:
        """Start ``cmd`` inside namespace i (``ip netns exec`` execs it, so the PID is the command's own)."""
        self._check_index(i)
        kw.setdefault("start_new_session", True)
        proc = subprocess.Popen(["ip", "netns", "exec", self.names[i], *cmd], **kw)
        self.procs.append(proc)
        return proc

    def run(self, i: int, cmd: list[str], *, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Run ``cmd`` to completion inside namespace i and return its result (output captured as text)."""
        self._check_index(i)
        return subprocess.run(["ip", "netns", "exec", self.names[i], *cmd], capture_output=True, text=True,
                              timeout=timeout)

    def call_in(self, i: int, fn: Callable[[], T], *, timeout: float = 30.0) -> T:
        """Run ``fn()`` on a fresh thread that has entered namespace i (its sockets live there)."""
        self._check_index(i)
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                _setns(self.names[i])
                box["value"] = fn()
            except BaseException as e:  # handed to the caller below
                box["error"] = e
        t = threading.Thread(target=target, daemon=True, name=f"netns-{i}")
        t.start()
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"call inside {self.names[i]} did not finish within {timeout} s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def rtt(self, src: int, dst: int, *, samples: int = 5, port: int = 9) -> float:
        """Median round trip src -> dst: the time a TCP connect to a closed port takes to be refused (SYN, RST)."""
        host = self.ip(dst)

        def probe() -> list[float]:
            out = []
            for _ in range(samples):
                with socket.socket() as s:
                    s.settimeout(5.0)
                    t0 = time.perf_counter()
                    try:
                        s.connect((host, port))
                    except ConnectionRefusedError:
                        out.append(time.perf_counter() - t0)
                        continue
                    except OSError as e:
                        raise WanError(f"{host} is unreachable from {self.names[src]}: {e}") from e
                raise WanError(f"something listens on {host}:{port}; probe another port")
            return out
        times = sorted(self.call_in(src, probe))
        return times[len(times) // 2]

    def tcp_throughput(self, src: int, dst: int, *, nbytes: int = 20_000_000, port: int = 5201,
                       timeout: float = 120.0) -> float:
        """Goodput in bit/s of one TCP transfer of ``nbytes`` from src to dst.

        Measured at the receiver from its first byte to its last, so the handshake is left out but slow start is
        not: use enough bytes for the transfer to last several seconds.
        """
        listener = self.call_in(dst, lambda: socket.create_server((self.ip(dst), port)))  # a socket keeps its netns
        box: dict[str, Any] = {}

        def receive() -> None:
            try:
                listener.settimeout(timeout)
                conn, _ = listener.accept()
                with conn:
                    conn.settimeout(timeout)
                    got, first, first_len = 0, 0.0, 0
                    while got < nbytes:
                        chunk = conn.recv(1 << 20)
                        if not chunk:
                            break
                        if not got:
                            first, first_len = time.perf_counter(), len(chunk)
                        got += len(chunk)
                    box["result"] = (got, first_len, time.perf_counter() - first)
            except BaseException as e:  # handed to the caller below
                box["error"] = e

        def send() -> None:
            block = b"\0" * (1 << 20)
            with socket.create_connection((self.ip(dst), port), timeout=timeout) as s:
                left = nbytes
                while left > 0:
                    left -= s.send(block[:left])
        reader = threading.Thread(target=receive, daemon=True)
        reader.start()
        try:
            self.call_in(src, send, timeout=timeout)
            reader.join(timeout)
        finally:
            listener.close()
        if "error" in box:
            raise box["error"]
        got, first_len, seconds = box.get("result", (0, 0, 0.0))
        if got < nbytes or seconds <= 0:
            raise WanError(f"TCP transfer {self.names[src]} -> {self.names[dst]} delivered {got} of {nbytes} bytes")
        return (got - first_len) * 8 / seconds

    def link_bytes(self, i: int) -> dict[str, int]:
        """Bytes namespace i sent (``tx``) and received (``rx``) through the emulated link so far."""
        self._check_index(i)
        res = _ip("-n", self.names[i], "-j", "-s", "link", "show", "dev", self.devices[i])
        if res.returncode != 0:
            raise WanError(f"cannot read the link counters of {self.names[i]}: {res.stderr.strip()}")
        stats = json.loads(res.stdout)[0]["stats64"]
        return {"tx": int(stats["tx"]["bytes"]), "rx": int(stats["rx"]["bytes"])}

    def counters(self, *, refresh: bool = True, timeout: float = 5.0) -> dict[str, Any] | None:
        """The emulator's packet counters (forwarded, dropped_loss, dropped_queue, ..., per_ns; see tools/netem.py).

        With ``refresh`` and the emulator running, asks it for fresh ones (SIGUSR1) and waits up to ``timeout`` s;
        otherwise, or if none comes, returns the last ones it printed (after ``close``: its final counts), or None.
        """
        with self._counters_cv:
            seen = self._counters_seen
            if refresh and self.emulator is not None and self.emulator.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.emulator.pid, signal.SIGUSR1)
                self._counters_cv.wait_for(lambda: self._counters_seen > seen, timeout=timeout)
            return self._counters

    def _check_index(self, i: int) -> None:
        if not 0 <= i < self.cfg.n:
            raise IndexError(f"namespace index {i} out of range 0..{self.cfg.n - 1}")


class LocalNet:
    """The same interface as ``Wan`` on this machine's loopback (no namespaces, no emulator): for baselines."""

    def __init__(self, n: int, *, stop_timeout_s: float = 10.0) -> None:
        self.cfg = WanConfig(n=n, stop_timeout_s=stop_timeout_s)
        self.names = ["loopback"] * n
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> LocalNet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        terminate(self.procs, self.cfg.stop_timeout_s)

    def ip(self, i: int) -> str:
        return "127.0.0.1"

    def popen(self, i: int, cmd: list[str], **kw: Any) -> subprocess.Popen:
        kw.setdefault("start_new_session", True)
        proc = subprocess.Popen(cmd, **kw)
        self.procs.append(proc)
        return proc

    def call_in(self, i: int, fn: Callable[[], T], *, timeout: float = 30.0) -> T:
        return fn()

    def link_bytes(self, i: int) -> None:
        return None

    def counters(self, *, refresh: bool = True, timeout: float = 5.0) -> None:
        return None


def parse_emulator_line(line: str) -> tuple[str | None, dict[str, Any] | None]:
    """Split one line of the emulator's output into its tag (READY, STATS, EXIT or None) and its JSON payload."""
    for tag in (READY, STATS, EXIT):
        if line.startswith(tag):
            try:
                payload = json.loads(line[len(tag):])
            except ValueError:
                return tag, None
            return tag, payload if isinstance(payload, dict) else None
    return None, None


def clean_leftovers(prefix: str = "amb-") -> list[str]:
    """Delete namespaces named ``<prefix><pid>-<i>`` whose creating process no longer runs; returns their names."""
    res = _ip("netns", "list")
    removed = []
    for line in res.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(re.escape(prefix) + r"(\d+)-\d+", name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            for pid in _ip("netns", "pids", name).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            if _ip("netns", "delete", name).returncode == 0:
                removed.append(name)
    return removed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Emulated WAN (network namespaces + tools/netem.py): probe it or clean "
                                            "up.")
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("probe", help="bring up N namespaces, measure RTT (and TCP goodput) between the first two, "
                                      "print the emulator's counters, tear down")
    pr.add_argument("--n", type=int, default=2)
    pr.add_argument("--delay-ms", type=float, default=25.0)
    pr.add_argument("--rate-mbit", type=float, default=100.0)
    pr.add_argument("--loss", type=float, default=0.0)
    pr.add_argument("--samples", type=int, default=5, help="RTT probes (the median is printed)")
    pr.add_argument("--throughput-mb", type=float, default=0.0,
                    help="also time one TCP transfer of this many MB from the first namespace to the second")
    pr.add_argument("--emulator", type=Path, default=DEFAULT_EMULATOR,
                    help="path of the link emulator (default: tools/netem.py of this repository)")
    cl = sub.add_parser("clean", help="delete namespaces left behind by killed runs (only <prefix><dead pid>-<i>)")
    cl.add_argument("--prefix", default="amb-")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.cmd == "clean":
        removed = clean_leftovers(args.prefix)
        print(f"deleted {len(removed)} leftover namespaces: {' '.join(removed) or '-'}")
        return 0
    unwind_on_sigterm()
    try:
        with Wan(WanConfig(n=max(2, args.n), delay_ms=args.delay_ms, rate_mbit=args.rate_mbit, loss=args.loss,
                           emulator=args.emulator)) as wan:
            rtt = wan.rtt(0, 1, samples=max(1, args.samples))
            print(f"RTT {wan.names[0]} -> {wan.names[1]}: {rtt * 1000:.1f} ms (configured {2 * args.delay_ms:.1f})")
            if args.throughput_mb > 0:
                bps = wan.tcp_throughput(0, 1, nbytes=int(args.throughput_mb * 1e6))
                cap = f"{args.rate_mbit:g} Mbit/s" if args.rate_mbit else "none"
                print(f"TCP goodput {wan.names[0]} -> {wan.names[1]}: {bps / 1e6:.1f} Mbit/s "
                      f"({args.throughput_mb:g} MB; uplink cap {cap})")
            print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, {os.cpu_count()} cores")
        print(f"emulator counters: {json.dumps(wan.counters(refresh=False))}")
    except WanError as e:
        print(f"wan: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
