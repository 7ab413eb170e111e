#!/usr/bin/env python3
"""netem.py: this project's user-space WAN link emulator, for kernels built without ``sch_netem``.

What it is for: benchmarks and tests that run each peer in its own network namespace and need the peers' traffic
to cross a slow, distant link. ``tools/wan.py`` creates the namespaces, starts this program and waits for its ready
line; you can also run it by hand.

How it works: the program opens one TUN device in every namespace named on the command line (``netem1`` in the first,
``netem2`` in the second, ...), gives namespace ``i`` (1-based) the address ``<subnet>.<i>/24`` and then forwards
every IPv4 packet a namespace sends to the namespace that owns its destination address. The topology is a star with
this process at the centre. Each packet, in order:

1. waits for its sender's uplink: a serialising link of ``--rate-mbit`` with a FIFO of at most ``--queue-ms`` (or
   ``--queue-bytes``) worth of bytes; a packet that does not fit is dropped at the tail, as by a router's full buffer;
2. is lost with probability ``--loss`` (it has used the uplink already: it is lost on the way, not before it);
3. arrives ``--delay-ms`` (+- uniform ``--jitter-ms``) after it left the uplink. The delay is added once per
   direction, so the round trip between two namespaces is 2 x delay. Jitter can reorder packets.

Addresses must lie in 100.64.0.0/10: libp2p does not gossip other private ranges such as 198.18.0.0/15. Only IPv4 is
forwarded (IPv6 is switched off on the devices); anything else read from a device is counted as ignored.

Usage (root; the namespaces must exist, e.g. ``ip netns add a; ip netns add b``)::

    python3 tools/netem.py --ns a b --delay-ms 25 --rate-mbit 100 --loss 0.001
    ip netns exec a ping 100.64.7.2            # ~50 ms

Output protocol (one line each, on stdout; ``tools/wan.py`` parses it):

* ``netem ready {json}`` once every device is up: namespaces, device names, addresses and the link settings;
* ``netem stats {json}`` on SIGUSR1 (and every ``--stats-every`` seconds): the packet counters below;
* ``netem exit {json}`` on SIGTERM or SIGINT, after which the process exits 0 and the devices disappear.

The counters: ``forwarded`` packets and ``forwarded_bytes``, packets ``dropped_loss`` (random loss),
``dropped_queue`` (uplink queue full), ``dropped_noroute`` (destination not one of ours), ``ignored`` (not IPv4),
``write_errors``, ``queued`` (in flight inside the emulator now) and ``per_ns``: for each namespace the packets and
bytes it sent and was delivered, and its packets dropped by loss and by its full queue.

The forwarding logic (``parse_ipv4``, ``Uplink``, ``DelayLine``, ``LinkEmulator``) touches no device, so it is unit
tested without root; only ``main`` and the helpers below it need root, TUN and ``ip``. Standard library only.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import heapq
import json
import os
import random
import re
import select
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

READY = "netem ready"
STATS = "netem stats"
EXIT = "netem exit"
DEVICE_PREFIX = "netem"
IPV4_MIN_HEADER = 20
READ_BUDGET = 64  # packets read from one device before the forwarder looks at its timers again

_SUBNET_RE = re.compile(r"100\.(6[4-9]|[7-9]\d|1[01]\d|12[0-7])\.(\d{1,3})")


# ----- pure logic: no devices, no root ----------------------------------------------------------------------------
def check_subnet(subnet: str) -> str | None:
    """None when ``subnet`` is three octets inside 100.64.0.0/10 (e.g. ``100.64.7``), else what is wrong."""
    m = _SUBNET_RE.fullmatch(subnet)
    if m is None or int(m.group(2)) > 255:
        return (f"subnet must be three octets inside 100.64.0.0/10 (e.g. 100.64.7), got {subnet!r}; libp2p does not "
                "gossip other private ranges such as 198.18.0.0/15")
    return None


def address(subnet: str, i: int) -> str:
    """Dotted address of namespace ``i`` (1-based)."""
    return f"{subnet}.{i}"


def device_name(i: int) -> str:
    """TUN device name of namespace ``i`` (1-based)."""
    return f"{DEVICE_PREFIX}{i}"


@dataclass(frozen=True)
class Ipv4Header:
    """The fields of an IPv4 header the emulator looks at."""

    header_len: int
    total_len: int
    protocol: int
    src: bytes
    dst: bytes


def _is_ipv4(pkt: bytes) -> bool:
    """True for a well-formed IPv4 packet: version 4, a header of 20+ bytes, a total length within the buffer."""
    if len(pkt) < IPV4_MIN_HEADER or pkt[0] >> 4 != 4:
        return False
    header_len = (pkt[0] & 0x0F) * 4
    return header_len >= IPV4_MIN_HEADER and header_len <= ((pkt[2] << 8) | pkt[3]) <= len(pkt)


def parse_ipv4(pkt: bytes) -> Ipv4Header | None:
    """The header of an IPv4 packet, or None for anything else (IPv6, truncated, a bad header or total length)."""
    if not _is_ipv4(pkt):
        return None
    return Ipv4Header((pkt[0] & 0x0F) * 4, (pkt[2] << 8) | pkt[3], pkt[9], bytes(pkt[12:16]), bytes(pkt[16:20]))


def ipv4_destination(pkt: bytes) -> bytes | None:
    """Destination address (4 bytes) of an IPv4 packet, or None: the only field the forwarder needs per packet."""
    return bytes(pkt[16:20]) if _is_ipv4(pkt) else None


class Uplink:
    """One sender's uplink: a link serialising ``rate`` bytes/s behind a FIFO holding at most ``queue_bytes``.

    The link is summarised by the time it next becomes idle, which is all a FIFO needs: a packet admitted at ``now``
    starts when the packets before it have left and leaves ``size / rate`` later. ``rate`` 0 means no cap (every
    packet leaves at once and nothing queues).
    """

    def __init__(self, rate_bytes_per_s: float, queue_bytes: int) -> None:
        if rate_bytes_per_s < 0 or queue_bytes < 0:
            raise ValueError("rate and queue size must be >= 0")
        self.rate = rate_bytes_per_s
        self.queue_bytes = queue_bytes
        self.idle_at = 0.0

    def backlog_bytes(self, now: float) -> float:
        """Bytes admitted but not yet sent at time ``now``."""
        return max(0.0, self.idle_at - now) * self.rate

    def admit(self, now: float, size: int) -> float | None:
        """The time the last byte of a ``size``-byte packet offered at ``now`` leaves, or None: the queue is full."""
        if not self.rate:
            return now
        if self.backlog_bytes(now) + size > self.queue_bytes:
            return None
        self.idle_at = max(now, self.idle_at) + size / self.rate
        return self.idle_at


def queue_limit_bytes(rate_mbit: float, queue_ms: float, queue_bytes: int | None, mtu: int) -> int:
    """Uplink buffer in bytes: ``queue_bytes`` when given, else ``queue_ms`` worth of the rate; at least one MTU."""
    limit = queue_bytes if queue_bytes is not None else int(rate_mbit * 1e6 / 8 * queue_ms / 1000)
    return max(limit, mtu)


class DelayLine:
    """Packets waiting to be delivered, earliest first; packets due at the same time keep their arrival order."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, bytes]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, due: float, dst: int, pkt: bytes) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (due, self._seq, dst, pkt))

    def next_due(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> Iterator[tuple[int, bytes]]:
        """Yield (destination, packet) for every packet due at or before ``now``, removing them."""
        while self._heap and self._heap[0][0] <= now:
            _, _, dst, pkt = heapq.heappop(self._heap)
            yield dst, pkt


def one_way_delay(rng: random.Random, delay_s: float, jitter_s: float) -> float:
    """Propagation delay of one packet: ``delay_s`` +- uniform ``jitter_s``, never negative."""
    if not jitter_s:
        return delay_s
    return max(0.0, delay_s + rng.uniform(-jitter_s, jitter_s))


@dataclass
class NsCounters:
    """Packet counters of one namespace."""

    sent_packets: int = 0
    sent_bytes: int = 0
    delivered_packets: int = 0
    delivered_bytes: int = 0
    dropped_loss: int = 0
    dropped_queue: int = 0


@dataclass
class Counters:
    """Packet counters of the whole emulator (see the module docstring)."""

    forwarded: int = 0
    forwarded_bytes: int = 0
    dropped_loss: int = 0
    dropped_queue: int = 0
    dropped_noroute: int = 0
    ignored: int = 0
    write_errors: int = 0
    per_ns: dict[str, NsCounters] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class LinkSettings:
    """The emulated link, the same for every namespace."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    rate_mbit: float = 0.0
    queue_bytes: int = 1500

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.rate_mbit < 0 or self.queue_bytes < 0:
            raise ValueError("delay, jitter, rate and queue must be >= 0")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"loss must be a probability in [0, 1), got {self.loss}")


class LinkEmulator:
    """The forwarder's decisions for a star of namespaces, separate from the devices so it can be tested.

    ``receive`` takes a packet a namespace sent and either schedules it or counts why not; ``deliver`` hands every
    packet that is due to a write function and counts it. Times are seconds on any monotonic clock.
    """

    def __init__(self, names: list[str], addresses: list[str], link: LinkSettings,
                 rng: random.Random | None = None) -> None:
        if len(names) != len(addresses):
            raise ValueError("one address per namespace")
        self.names = list(names)
        self.link = link
        self.rng = rng or random.Random()
        self.route = {bytes(int(o) for o in a.split(".")): i for i, a in enumerate(addresses)}
        rate = link.rate_mbit * 1e6 / 8
        self.uplinks = [Uplink(rate, link.queue_bytes) for _ in names]
        self.line = DelayLine()
        self.counters = Counters(per_ns={n: NsCounters() for n in names})
        self._ns = [self.counters.per_ns[n] for n in names]
        self._delay_s = link.delay_ms / 1000
        self._jitter_s = link.jitter_ms / 1000

    def receive(self, now: float, src: int, pkt: bytes) -> str:
        """Take a packet ``src`` sent at ``now``; 'queued', or why not ('ignored', 'noroute', 'queue', 'loss')."""
        c, ns = self.counters, self._ns[src]
        ns.sent_packets += 1
        ns.sent_bytes += len(pkt)
        dst_addr = ipv4_destination(pkt)
        if dst_addr is None:
            c.ignored += 1
            return "ignored"
        dst = self.route.get(dst_addr)
        if dst is None:
            c.dropped_noroute += 1
            return "noroute"
        leaves = self.uplinks[src].admit(now, len(pkt))
        if leaves is None:
            c.dropped_queue += 1
            ns.dropped_queue += 1
            return "queue"
        if self.link.loss and self.rng.random() < self.link.loss:
            c.dropped_loss += 1
            ns.dropped_loss += 1
            return "loss"
        self.line.push(leaves + one_way_delay(self.rng, self._delay_s, self._jitter_s), dst, pkt)
        return "queued"

    def deliver(self, now: float, write: Callable[[int, bytes], Any]) -> int:
        """Write every packet due by ``now`` with ``write(destination index, packet)``; returns how many were written.

        A write that raises OSError (the device went away, its queue is full) drops that packet and is counted.
        """
        c, done = self.counters, 0
        for dst, pkt in self.line.pop_due(now):
            try:
                write(dst, pkt)
            except OSError:
                c.write_errors += 1
                continue
            c.forwarded += 1
            c.forwarded_bytes += len(pkt)
            ns = self._ns[dst]
            ns.delivered_packets += 1
            ns.delivered_bytes += len(pkt)
            done += 1
        return done

    def next_due(self) -> float | None:
        return self.line.next_due()

    def snapshot(self) -> dict[str, Any]:
        """The counters as a JSON-ready dict, with the packets in flight now (``queued``)."""
        out = asdict(self.counters)
        out["queued"] = len(self.line)
        return out


# ----- devices: root, TUN, network namespaces -------------------------------------------------------------------
TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    """Move the calling thread into the network namespace open at ``fd``."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def open_tun(name: str) -> int:
    """Create TUN device ``name`` in the calling thread's network namespace; returns its non-blocking fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {res.stderr.strip()}")


def create_devices(names: list[str], subnet: str, mtu: int) -> list[int]:
    """One TUN device per namespace, up, addressed and without IPv6; returns their fds (closing one removes it)."""
    home = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    fds: list[int] = []
    try:
        for i, ns in enumerate(names, start=1):
            path = f"/var/run/netns/{ns}"
            if not os.path.exists(path):
                raise RuntimeError(f"network namespace {ns!r} does not exist (create it with `ip netns add {ns}`)")
            target = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                _setns(target)
                fds.append(open_tun(device_name(i)))
                try:  # /proc/sys/net shows the namespace of the thread that opens it: ours, now
                    with open(f"/proc/sys/net/ipv6/conf/{device_name(i)}/disable_ipv6", "w") as f:
                        f.write("1")
                except OSError:
                    pass  # no IPv6 in this kernel: nothing to switch off
            finally:
                _setns(home)
                os.close(target)
            _ip("-n", ns, "link", "set", "dev", device_name(i), "mtu", str(mtu), "up")
            _ip("-n", ns, "addr", "add", f"{address(subnet, i)}/24", "dev", device_name(i))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    finally:
        os.close(home)
    return fds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="User-space WAN link emulator between network namespaces (root).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ns", nargs="+", required=True, metavar="NAME", help="network namespaces (`ip netns` names)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per packet (RTT = 2 x delay)")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="uniform +- jitter on the delay (may reorder)")
    p.add_argument("--loss", type=float, default=0.0, help="probability that a packet is lost")
    p.add_argument("--rate-mbit", type=float, default=0.0, help="uplink cap per namespace in Mbit/s (0: none)")
    p.add_argument("--queue-ms", type=float, default=200.0, help="uplink buffer, in ms of the rate")
    p.add_argument("--queue-bytes", type=int, default=None, help="uplink buffer in bytes (overrides --queue-ms)")
    p.add_argument("--mtu", type=int, default=1500)
    p.add_argument("--subnet", default="100.64.7", help="first three octets; namespace i (1-based) gets <subnet>.<i>")
    p.add_argument("--seed", type=int, default=None, help="seed of the loss and jitter draws (None: a random seed)")
    p.add_argument("--stats-every", type=float, default=0.0, help="print the counters every this many s (0: never)")
    args = p.parse_args(argv)
    if reason := check_subnet(args.subnet):
        p.error(reason)
    if not 1 <= len(args.ns) <= 254 or len(set(args.ns)) != len(args.ns):
        p.error("--ns takes 1 to 254 distinct namespace names")
    if args.queue_ms < 0 or (args.queue_bytes is not None and args.queue_bytes < 0) or not 68 <= args.mtu <= 65535:
        p.error("--queue-ms and --queue-bytes must be >= 0 and --mtu within 68..65535")
    return args


def _emit(tag: str, payload: dict[str, Any]) -> None:
    print(f"{tag} {json.dumps(payload, separators=(',', ':'))}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        link = LinkSettings(delay_ms=args.delay_ms, jitter_ms=args.jitter_ms, loss=args.loss, rate_mbit=args.rate_mbit,
                            queue_bytes=queue_limit_bytes(args.rate_mbit, args.queue_ms, args.queue_bytes, args.mtu))
    except ValueError as e:
        print(f"netem: error: {e}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("netem: error: needs root (network namespaces and TUN devices)", file=sys.stderr)
        return 2
    addresses = [address(args.subnet, i) for i in range(1, len(args.ns) + 1)]
    emu = LinkEmulator(args.ns, addresses, link, random.Random(args.seed))

    # Signals only set flags; the wake-up pipe makes epoll return at once when one arrives.
    flags = {"stop": False, "dump": False}
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGTERM, lambda *_: flags.__setitem__("stop", True))
    signal.signal(signal.SIGINT, lambda *_: flags.__setitem__("stop", True))
    signal.signal(signal.SIGUSR1, lambda *_: flags.__setitem__("dump", True))

    try:
        fds = create_devices(args.ns, args.subnet, args.mtu)
    except (OSError, RuntimeError) as e:
        print(f"netem: error: {e}", file=sys.stderr)
        return 1
    src_of = {fd: i for i, fd in enumerate(fds)}
    poller = select.epoll()
    for fd in fds:
        poller.register(fd, select.EPOLLIN)
    poller.register(wake_r, select.EPOLLIN)
    _emit(READY, {"namespaces": args.ns, "devices": [device_name(i) for i in range(1, len(fds) + 1)],
                  "addresses": addresses, **asdict(link), "seed": args.seed})

    def write(dst: int, pkt: bytes) -> None:
        os.write(fds[dst], pkt)

    clock = time.monotonic
    started = clock()
    next_stats = started + args.stats_every if args.stats_every > 0 else float("inf")
    while not flags["stop"]:
        due = emu.next_due()
        wake_at = min(next_stats, due if due is not None else float("inf"))
        timeout = min(1.0, max(0.0, wake_at - clock()))
        events = poller.poll(timeout)
        now = clock()
        for fd, _ in events:
            if fd == wake_r:
                while True:
                    try:
                        if not os.read(wake_r, 512):
                            break
                    except BlockingIOError:
                        break
                continue
            src = src_of[fd]
            for _ in range(READ_BUDGET):
                try:
                    pkt = os.read(fd, 65536)
                except BlockingIOError:
                    break
                emu.receive(now, src, pkt)
        now = clock()
        emu.deliver(now, write)
        if flags["dump"] or now >= next_stats:
            flags["dump"] = False
            if now >= next_stats:
                next_stats = now + args.stats_every
            _emit(STATS, {**emu.snapshot(), "elapsed_s": round(now - started, 3)})
    _emit(EXIT, {**emu.snapshot(), "elapsed_s": round(clock() - started, 3)})
    for fd in fds:
        os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
