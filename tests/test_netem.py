"""tools/netem.py, the user-space link emulator.

The forwarding logic (IPv4 parsing, the uplink's rate and queue, delay scheduling, loss, counters) is tested without
root or devices. The tests marked ``wan`` bring up real namespaces through tools/wan.py and measure what the emulator
does to traffic: they need root, iproute2 and /dev/net/tun (run with ``pytest -m wan``).
"""

from __future__ import annotations

import json
import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.netem import (  # noqa: E402
    DelayLine,
    LinkEmulator,
    LinkSettings,
    Uplink,
    check_subnet,
    ipv4_destination,
    one_way_delay,
    parse_args,
    parse_ipv4,
    queue_limit_bytes,
)
from tools.wan import Wan, WanConfig, check_available, parse_emulator_line  # noqa: E402


def ipv4(src: str, dst: str, payload: bytes = b"", *, proto: int = 17, ihl: int = 5) -> bytes:
    """A minimal IPv4 packet (checksum left 0: the emulator does not look at it)."""
    options = b"\0" * (4 * (ihl - 5))
    total = 4 * ihl + len(payload)
    header = struct.pack("!BBHHHBBH4s4s", 0x40 | ihl, 0, total, 0, 0, 64, proto, 0, socket.inet_aton(src),
                         socket.inet_aton(dst))
    return header + options + payload


# ----- parsing --------------------------------------------------------------------------------------------------
def test_parse_ipv4_reads_the_header_fields():
    pkt = ipv4("100.64.7.1", "100.64.7.2", b"x" * 30, proto=6)
    h = parse_ipv4(pkt)
    assert h is not None
    assert (h.header_len, h.total_len, h.protocol) == (20, 50, 6)
    assert h.src == socket.inet_aton("100.64.7.1") and h.dst == socket.inet_aton("100.64.7.2")
    assert ipv4_destination(pkt) == socket.inet_aton("100.64.7.2")
    with_options = ipv4("100.64.7.1", "100.64.7.3", b"y", ihl=6)
    assert parse_ipv4(with_options).header_len == 24
    assert ipv4_destination(with_options) == socket.inet_aton("100.64.7.3")


def test_parse_ipv4_refuses_what_is_not_a_whole_ipv4_packet():
    good = ipv4("100.64.7.1", "100.64.7.2", b"z" * 10)
    ipv6 = bytes([0x60]) + good[1:]
    assert parse_ipv4(ipv6) is None and ipv4_destination(ipv6) is None
    assert parse_ipv4(good[:19]) is None                      # shorter than a header
    assert parse_ipv4(good[:-1]) is None                      # total length says more than the buffer holds
    assert parse_ipv4(bytes([0x44]) + good[1:]) is None        # header length 16 < 20
    assert parse_ipv4(good[:2] + struct.pack("!H", 12) + good[4:]) is None  # total length < header length
    assert parse_ipv4(good + b"pad") is not None               # trailing bytes beyond total length are allowed
    assert parse_ipv4(b"") is None


def test_subnets_outside_the_shared_address_range_are_refused():
    assert check_subnet("100.64.7") is None and check_subnet("100.127.255") is None
    for bad in ("198.18.0", "10.0.0", "100.128.0", "100.64.256", "100.64"):
        assert "100.64.0.0/10" in check_subnet(bad)
    with pytest.raises(SystemExit):
        parse_args(["--ns", "a", "--subnet", "198.18.0"])
    with pytest.raises(SystemExit):
        parse_args(["--ns", "a", "a"])
    args = parse_args(["--ns", "a", "b", "--delay-ms", "25", "--rate-mbit", "100", "--seed", "3"])
    assert args.ns == ["a", "b"] and args.delay_ms == 25.0 and args.queue_ms == 200.0 and args.seed == 3


# ----- the uplink: rate and queue ---------------------------------------------------------------------------------
def test_uplink_serialises_packets_back_to_back_at_the_rate():
    link = Uplink(1000.0, queue_bytes=3000)                   # 1000 B/s, 3 packets of 1000 B
    assert [link.admit(0.0, 1000) for _ in range(3)] == [1.0, 2.0, 3.0]
    assert link.backlog_bytes(0.0) == 3000 and link.backlog_bytes(1.5) == 1500
    assert link.admit(0.0, 1) is None                          # full: tail drop, the link's schedule is unchanged
    assert link.idle_at == 3.0
    assert link.admit(1.5, 1500) == 4.5                        # fits again once 1500 B have left
    assert link.admit(10.0, 500) == 10.5                       # an idle link starts at once


def test_uplink_without_a_rate_never_queues():
    link = Uplink(0.0, queue_bytes=0)
    assert all(link.admit(5.0, 65535) == 5.0 for _ in range(100))


def test_queue_limit_from_milliseconds_or_bytes():
    assert queue_limit_bytes(20.0, 200.0, None, 1500) == 500_000   # 20 Mbit/s = 2.5 MB/s, 200 ms of it
    assert queue_limit_bytes(100.0, 200.0, None, 1500) == 2_500_000
    assert queue_limit_bytes(100.0, 200.0, 64_000, 1500) == 64_000  # bytes win over ms
    assert queue_limit_bytes(0.1, 1.0, None, 1500) == 1500          # never less than one packet
    assert queue_limit_bytes(0.0, 200.0, None, 9000) == 9000


def test_a_rate_capped_stream_arrives_at_the_rate():
    rate_mbit, size = 20.0, 1500
    emu = LinkEmulator(["a", "b"], ["100.64.7.1", "100.64.7.2"],
                       LinkSettings(rate_mbit=rate_mbit, queue_bytes=queue_limit_bytes(rate_mbit, 200, None, 1500)))
    pkt = ipv4("100.64.7.1", "100.64.7.2", b"\0" * (size - 20))
    verdicts = [emu.receive(0.0, 0, pkt) for _ in range(400)]  # a burst far larger than 200 ms of the link
    queued = verdicts.count("queued")
    assert queued == 500_000 // size and verdicts.count("queue") == 400 - queued
    arrivals: list[float] = []
    t = 0.0
    while emu.next_due() is not None:
        t = emu.next_due()
        emu.deliver(t, lambda dst, p, t=t: arrivals.append(t))
    assert len(arrivals) == queued
    assert (len(arrivals) * size * 8) / arrivals[-1] == pytest.approx(rate_mbit * 1e6, rel=1e-9)
    c = emu.counters
    assert c.dropped_queue == 400 - queued and c.per_ns["a"].dropped_queue == c.dropped_queue
    assert c.forwarded == queued and c.per_ns["b"].delivered_bytes == queued * size


# ----- delay, jitter, loss ------------------------------------------------------------------------------------------
def test_delay_line_releases_packets_when_due_in_arrival_order_for_ties():
    line = DelayLine()
    line.push(0.30, 1, b"c")
    line.push(0.10, 0, b"a")
    line.push(0.10, 1, b"b")
    assert line.next_due() == 0.10 and len(line) == 3
    assert list(line.pop_due(0.09)) == []
    assert list(line.pop_due(0.10)) == [(0, b"a"), (1, b"b")]
    assert list(line.pop_due(1.0)) == [(1, b"c")] and line.next_due() is None


def test_each_packet_waits_the_one_way_delay():
    emu = LinkEmulator(["a", "b", "c"], ["100.64.7.1", "100.64.7.2", "100.64.7.3"], LinkSettings(delay_ms=25.0))
    assert emu.receive(1.0, 0, ipv4("100.64.7.1", "100.64.7.3")) == "queued"
    assert emu.receive(1.01, 2, ipv4("100.64.7.3", "100.64.7.1")) == "queued"
    out: list[tuple[int, bytes]] = []
    assert emu.deliver(1.0249, lambda d, p: out.append((d, p))) == 0
    assert emu.deliver(1.025, lambda d, p: out.append((d, p))) == 1 and out[0][0] == 2
    assert emu.deliver(1.035, lambda d, p: out.append((d, p))) == 1 and out[1][0] == 0
    assert emu.next_due() is None


def test_jitter_stays_within_its_bounds_and_is_reproducible_with_a_seed():
    draws = [one_way_delay(random.Random(7), 0.05, 0.01) for _ in range(3)]
    assert draws[0] == draws[1] == draws[2]
    rng = random.Random(1)
    sample = [one_way_delay(rng, 0.05, 0.01) for _ in range(10_000)]
    assert 0.04 <= min(sample) < 0.041 and 0.059 < max(sample) <= 0.06
    assert sum(sample) / len(sample) == pytest.approx(0.05, abs=5e-4)
    assert min(one_way_delay(rng, 0.001, 0.01) for _ in range(1000)) == 0.0  # never negative
    assert one_way_delay(rng, 0.02, 0.0) == 0.02


def test_loss_drops_the_configured_fraction_and_a_seed_repeats_it():
    def run(seed: int) -> list[str]:
        emu = LinkEmulator(["a", "b"], ["100.64.7.1", "100.64.7.2"], LinkSettings(loss=0.1), random.Random(seed))
        pkt = ipv4("100.64.7.1", "100.64.7.2", b"p")
        out = [emu.receive(0.0, 0, pkt) for _ in range(10_000)]
        assert emu.counters.dropped_loss == out.count("loss") == emu.counters.per_ns["a"].dropped_loss
        return out
    first = run(42)
    assert abs(first.count("loss") - 1000) < 4 * (10_000 * 0.1 * 0.9) ** 0.5  # 4 sigma of a binomial
    assert run(42) == first and run(43) != first


def test_counters_cover_every_packet_and_are_json():
    emu = LinkEmulator(["a", "b"], ["100.64.7.1", "100.64.7.2"], LinkSettings())
    assert emu.receive(0.0, 0, ipv4("100.64.7.1", "100.64.7.9")) == "noroute"
    assert emu.receive(0.0, 0, bytes([0x60]) + b"\0" * 39) == "ignored"
    assert emu.receive(0.0, 1, ipv4("100.64.7.2", "100.64.7.1", b"abc")) == "queued"
    assert emu.receive(0.0, 1, ipv4("100.64.7.2", "100.64.7.1", b"abcd")) == "queued"

    def flaky(dst: int, pkt: bytes) -> None:
        if len(pkt) == 24:
            raise OSError("device gone")
    assert emu.deliver(0.0, flaky) == 1
    snap = json.loads(json.dumps(emu.snapshot()))
    assert snap["dropped_noroute"] == 1 and snap["ignored"] == 1 and snap["write_errors"] == 1
    assert snap["forwarded"] == 1 and snap["forwarded_bytes"] == 23 and snap["queued"] == 0
    assert snap["per_ns"]["a"]["sent_packets"] == 2 and snap["per_ns"]["b"]["sent_bytes"] == 47
    assert snap["per_ns"]["a"]["delivered_packets"] == 1 and snap["per_ns"]["a"]["delivered_bytes"] == 23


def test_bad_link_settings_are_refused():
    with pytest.raises(ValueError, match="loss"):
        LinkSettings(loss=1.0)
    with pytest.raises(ValueError):
        LinkSettings(delay_ms=-1)
    with pytest.raises(ValueError, match="one address"):
        LinkEmulator(["a"], [], LinkSettings())


def test_wan_reads_the_emulator_lines():
    assert parse_emulator_line('netem ready {"devices": ["netem1"]}\n') == ("netem ready", {"devices": ["netem1"]})
    assert parse_emulator_line('netem exit {"forwarded": 3}') == ("netem exit", {"forwarded": 3})
    assert parse_emulator_line("netem stats not json") == ("netem stats", None)
    assert parse_emulator_line("Traceback (most recent call last):") == (None, None)


# ----- on real namespaces (root) ------------------------------------------------------------------------------------
REASON = check_available()


def needs_wan(test):
    """Mark a test as needing root and namespaces: selected by ``-m wan``, skipped with the reason elsewhere."""
    for mark in (pytest.mark.wan, pytest.mark.timeout(180), pytest.mark.skipif(bool(REASON), reason=REASON or "")):
        test = mark(test)
    return test


def our_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"amb-{os.getpid()}-")]


@needs_wan
@pytest.mark.parametrize("delay_ms", [10.0, 40.0])
def test_rtt_between_namespaces_is_twice_the_delay(delay_ms: float):
    with Wan(WanConfig(n=3, delay_ms=delay_ms)) as wan:
        for src, dst in ((0, 1), (2, 0)):
            rtt = wan.rtt(src, dst, samples=7)
            # delay is added once each way; a busy 2-core machine adds a few ms of scheduling, never removes any
            assert 2 * delay_ms / 1000 <= rtt <= 2 * delay_ms / 1000 + 0.015, (src, dst, rtt)
        running = wan.counters()  # asked for with SIGUSR1 while the emulator runs
        assert running is not None and running["forwarded"] >= 4 * 7 and running["dropped_loss"] == 0
        emulator = wan.emulator
    assert our_namespaces() == [] and emulator.poll() == 0
    final = wan.counters(refresh=False)
    assert final["forwarded"] >= running["forwarded"] and set(final["per_ns"]) == set(wan.names)


@needs_wan
def test_tcp_through_a_20_mbit_cap_runs_at_the_cap():
    with Wan(WanConfig(n=2, delay_ms=5.0, rate_mbit=20.0)) as wan:
        bps = wan.tcp_throughput(0, 1, nbytes=10_000_000)
        counters = wan.counters()
    # goodput is the IP rate less TCP/IP headers (~4 %); the queue (200 ms of the rate) absorbs the bursts
    assert 0.75 * 20e6 <= bps <= 1.25 * 20e6, bps
    assert counters is not None and counters["per_ns"][wan.names[0]]["sent_bytes"] >= 10_000_000
    assert our_namespaces() == []


@needs_wan
def test_loss_drops_about_the_configured_fraction_of_datagrams():
    n, loss = 2000, 0.2
    with Wan(WanConfig(n=2, delay_ms=1.0, loss=loss, seed=5)) as wan:
        receiver = wan.call_in(1, lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
        receiver.bind((wan.ip(1), 9999))
        receiver.settimeout(1.0)
        got = 0

        def receive() -> None:  # reads while the sender sends: a full socket buffer would drop datagrams too
            nonlocal got
            try:
                while True:
                    receiver.recv(2048)
                    got += 1
            except TimeoutError:
                pass
        before = wan.counters()
        reader = threading.Thread(target=receive, daemon=True)
        reader.start()

        def send() -> None:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                for k in range(n):
                    s.sendto(b"d" * 100, (wan.ip(1), 9999))
                    if k % 50 == 49:
                        time.sleep(0.005)  # stay far below the device queues: only the emulator may drop
        wan.call_in(0, send)
        reader.join(30)
        receiver.close()
        after = wan.counters()
    dropped = after["dropped_loss"] - before["dropped_loss"]
    assert abs(dropped - n * loss) < 4 * (n * loss * (1 - loss)) ** 0.5, dropped  # 4 sigma of a binomial
    assert got == n - dropped and after["dropped_queue"] == 0
    assert our_namespaces() == []
