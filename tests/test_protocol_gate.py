"""The flood gate: a stranger that used up its refusals is banned, its streams held unread and unanswered while the
ban lasts (so a flooder that waits for our answer stops cycling streams), and everyone else is served. The gate runs
in our own end of p2pd's streams (protocol/inbound.py), before any reader, writer or task exists for the stream.

Before the gate such streams were closed at once, unread: the attacker reopened them immediately, and ~1,500 streams
per second went through the victim's libp2p daemon and event loop (docs/security.md). The rules are tested on the
bookkeeping with a fake clock; the behaviour on a real libp2p server.
"""

from __future__ import annotations

import asyncio
import resource
import time
from collections import Counter

import pytest
from hivemind.p2p import P2P

from protocol.framing import frame_header, read_message
from protocol.gate import FloodGate, StrangerGate
from protocol.limits import RpcLimits
from protocol.messages import Ack, Backward, Hello, pack, unpack
from protocol.rpc import PROTOCOL_PREFIX, RpcServer, call

pytestmark = pytest.mark.timeout(120)
MiB = 2**20
HELLO = Hello(protocol_version=1, run_id="run", stage=0, peer_id="x", capabilities=[])


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _gate(clock: Clock, **kw: float) -> FloodGate:
    args = {"ban_s": 10.0, "max_ban_s": 40.0, "hold_s": 60.0, "max_held": 4, "max_held_per_peer": 3, **kw}
    return FloodGate(clock=clock, **args)


def test_a_ban_expires_and_doubles_while_the_peer_keeps_coming_back():
    clock = Clock()
    gate = _gate(clock)
    assert gate.banned_for("p") == 0.0 and gate.hold("p") == 0.0  # not banned: nothing to hold
    assert gate.ban("p") == 10.0 and gate.banned_for("p") == 10.0 and gate.bans == 1
    clock.t += 4
    assert gate.ban("p") == pytest.approx(6.0) and gate.bans == 1  # banning a banned peer changes nothing
    assert gate.banned_for("q") == 0.0  # others are not affected
    clock.t += 6
    assert gate.banned_for("p") == 0.0  # expired
    clock.t += 1
    assert gate.ban("p") == 20.0  # back soon after its ban: twice as long
    clock.t += 21
    assert gate.ban("p") == 40.0
    clock.t += 41
    assert gate.ban("p") == 40.0  # capped at max_ban_s
    clock.t += 40 + 2 * 40 + 1
    assert gate.ban("p") == 10.0  # quiet for long enough: forgiven


def test_hold_slots_are_bounded_per_peer_and_in_all_and_never_outlast_the_ban():
    clock = Clock()
    gate = _gate(clock, hold_s=5.0)
    gate.ban("a")
    gate.ban("b")
    assert [gate.hold("a") for _ in range(4)] == [5.0, 5.0, 5.0, 0.0]  # 3 per peer
    assert gate.hold("b") == 5.0 and gate.hold("b") == 0.0  # 4 in all
    assert gate.held == 4
    gate.release("a")
    assert gate.hold("b") == 5.0 and gate.held == 4
    clock.t += 8
    assert gate.hold("a") == 0.0  # 2 s of its ban left, but no slot
    gate.release("b")
    assert gate.hold("a") == pytest.approx(2.0)  # the rest of its ban, not hold_s
    gate.unban("a")
    assert gate.banned_for("a") == 0.0 and gate.hold("a") == 0.0


def test_the_gate_is_bounded_by_the_file_descriptors_this_process_may_open():
    gate = FloodGate.from_limits(RpcLimits(max_held_streams=10**6))
    assert gate.max_held <= resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 8
    assert gate.max_held_per_peer == RpcLimits().max_streams_per_peer


def test_a_burst_of_a_strangers_streams_is_judged_as_it_arrives_and_known_peers_are_never_banned():
    """Streams are counted as they pass the gate: a stranger's streams over its share (4) are charged as refusals
    there, so a burst of 100 at once gets 4 served, 40 answered Busy (its burst of refusals), then a ban: 16 held,
    the rest closed. (Charged only once their tasks ran, 200 streams at once got 196 Busy replies and no ban.)"""
    rejected: Counter[str] = Counter()
    gate = StrangerGate(RpcLimits(stranger_streams=4, stranger_refusals_per_s=20.0), is_known=lambda p: p == "known",
                        rejected=rejected)
    verdicts = [gate.early("s") for _ in range(100)]
    assert verdicts[:44] == [None] * 44 and sum(gate.over("s") for _ in range(100)) == 40
    assert all(v > 0 for v in verdicts[44:60]) and verdicts[60:] == [0.0] * 40
    assert gate.flood.bans == 1 and gate.flood.held == 16 and rejected["banned"] == 56
    assert [gate.early("known") for _ in range(100)] == [None] * 100  # a known peer: Busy beyond 16, never banned
    assert sum(gate.over("known") for _ in range(100)) == 84 and gate.flood.bans == 1
    for _ in range(44):
        gate.done("s")
    assert "s" not in gate.streams


async def _peers(n: int) -> list[P2P]:
    first = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    maddrs = await first.get_visible_maddrs()
    rest = await asyncio.gather(*(P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
                                  for _ in range(n - 1)))
    return [first, *rest]


async def _reply_or_eof(reader: asyncio.StreamReader, timeout: float) -> str:
    """What the caller sees within ``timeout``: the reply's kind, "eof" (closed unanswered) or "nothing" (held)."""
    try:
        async with asyncio.timeout(timeout):
            return type(unpack(await read_message(reader, max_frame_bytes=MiB, max_message_bytes=MiB))).__name__
    except TimeoutError:
        return "nothing"
    except Exception:
        return "eof"


def test_a_banned_strangers_streams_are_held_unread_and_others_are_served():
    """A stranger that sends the wrong kind of message until its refusals are spent is banned: its next streams, even
    with a valid request on them, are neither read nor answered nor closed until the ban ends; a known peer and
    another stranger are served meanwhile without delay. (Before: closed at once, and reopened at once.)"""
    limits = RpcLimits(stranger_refusals_per_s=1.0, stranger_ban_s=2.5, stranger_max_ban_s=10.0, linger_s=0.1)

    async def main() -> None:
        peers = await _peers(4)
        server, known, stranger, attacker = peers
        try:
            rpc = RpcServer(server, limits)
            seen: list[str] = []

            async def echo(msg, peer):
                seen.append(peer)
                return Ack()

            await rpc.add_handler("echo", echo)
            rpc.restrict("echo", kinds=(Hello,))
            rpc.vouch(known.peer_id.to_base58())
            wrong = Backward(run_id="r", mb_id=1, route=["a"], gradient=None, loss=None, is_eval=False)
            for _ in range(2):  # its burst of refusals: 2 x stranger_refusals_per_s
                _, reader, writer = await attacker.call_binary_stream_handler(server.peer_id, PROTOCOL_PREFIX + "echo")
                writer.write(frame_header(len(pack(wrong)), end=True) + pack(wrong))
                assert await _reply_or_eof(reader, 5.0) == "Error"
                writer.close()
            before_in, tasks = rpc.bytes_in, len(asyncio.all_tasks())
            t_ban = time.monotonic()
            held = []
            for _ in range(5):  # a valid request now: not read, not answered, not closed
                _, reader, writer = await attacker.call_binary_stream_handler(server.peer_id, PROTOCOL_PREFIX + "echo")
                writer.write(frame_header(len(pack(HELLO)), end=True) + pack(HELLO))
                held.append((reader, writer))
            outcomes = await asyncio.gather(*(_reply_or_eof(r, 1.0) for r, _ in held))
            assert outcomes == ["nothing"] * 5, outcomes
            assert rpc.flood.bans == 1 and rpc.flood.held == 5 and rpc.rejected["banned"] == 5
            assert rpc.bytes_in == before_in and not seen  # nothing of them was read or handled
            assert len(asyncio.all_tasks()) <= tasks + 1  # held by the listener: no task (reader, writer) per stream
            for peer in (known, stranger):  # everyone else is served at once
                t0 = time.monotonic()
                assert isinstance(await call(peer, server.peer_id, "echo", HELLO, timeout=5, limits=limits), Ack)
                assert time.monotonic() - t0 < 1.0
            # the ban ends: its held streams are closed unanswered, and it is heard again
            outcomes = await asyncio.gather(*(_reply_or_eof(r, 5.0) for r, _ in held))
            assert outcomes == ["eof"] * 5 and time.monotonic() - t_ban >= limits.stranger_ban_s - 0.3, outcomes
            assert rpc.flood.held == 0
            assert isinstance(await call(attacker, server.peer_id, "echo", HELLO, timeout=5, limits=limits), Ack)
            for _, w in held:
                w.close()
        finally:
            await asyncio.gather(*(p.shutdown() for p in peers), return_exceptions=True)

    asyncio.run(main())


def test_vouching_for_a_banned_peer_lifts_its_ban():
    limits = RpcLimits(stranger_refusals_per_s=1.0, linger_s=0.1)

    async def main() -> None:
        server, client = await _peers(2)
        try:
            rpc = RpcServer(server, limits)

            async def echo(msg, peer):
                return Ack()

            await rpc.add_handler("echo", echo)
            pid = client.peer_id.to_base58()
            rpc.flood.ban(pid)
            _, reader, writer = await client.call_binary_stream_handler(server.peer_id, PROTOCOL_PREFIX + "echo")
            writer.write(frame_header(len(pack(HELLO)), end=True) + pack(HELLO))
            assert await _reply_or_eof(reader, 1.0) == "nothing"
            writer.close()
            rpc.vouch(pid)  # it did validated work for us
            assert rpc.flood.banned_for(pid) == 0.0
            assert isinstance(await call(client, server.peer_id, "echo", HELLO, timeout=5, limits=limits), Ack)
        finally:
            await asyncio.gather(client.shutdown(), server.shutdown(), return_exceptions=True)

    asyncio.run(main())


def test_streams_closed_while_all_strangers_are_over_budget_count_against_each_one():
    """A flood from many identities spends the budget all strangers share before any one of them has used up its
    own; its streams are then closed unread. Each such close is one of that stranger's refusals, so every flooding
    identity is banned (and held) in its turn instead of cycling streams for as long as the flood lasts."""
    limits = RpcLimits(stranger_refusals_per_s=2.0, strangers_refusals_per_s=1.0, linger_s=0.1)

    async def main() -> None:
        server, first, second = await _peers(3)
        try:
            rpc = RpcServer(server, limits)

            async def echo(msg, peer):
                return Ack()

            await rpc.add_handler("echo", echo)
            rpc.restrict("echo", kinds=(Hello,))
            wrong = Backward(run_id="r", mb_id=1, route=["a"], gradient=None, loss=None, is_eval=False)
            _, reader, writer = await first.call_binary_stream_handler(server.peer_id, PROTOCOL_PREFIX + "echo")
            writer.write(frame_header(len(pack(wrong)), end=True) + pack(wrong))
            assert await _reply_or_eof(reader, 5.0) == "Error"  # the one refusal all strangers may cause at once
            writer.close()
            outcomes = []
            for _ in range(6):  # the second stranger's valid requests: closed unread, then held
                _, reader, writer = await second.call_binary_stream_handler(server.peer_id, PROTOCOL_PREFIX + "echo")
                writer.write(frame_header(len(pack(HELLO)), end=True) + pack(HELLO))
                outcomes.append(await _reply_or_eof(reader, 0.5))
                writer.close()
            assert outcomes[:3] == ["eof"] * 3 and outcomes[-1] == "nothing", (outcomes, rpc.rejected)
            assert rpc.flood.banned_for(second.peer_id.to_base58()) > 0 and rpc.rejected["flood"] >= 3
        finally:
            await asyncio.gather(server.shutdown(), first.shutdown(), second.shutdown(), return_exceptions=True)

    asyncio.run(main())
