"""Budgets strangers cannot exhaust: bytes are charged as they arrive, streams must keep a minimum rate, strangers
get a small allowance, and a flood from some identities leaves others served.

The attack of the issue in miniature: several identities each open streams that announce a full frame and then send
nothing. Before, the announced length was reserved from the shared in-flight budget, so every other request was
answered Busy until the read timeout; now nothing is reserved until it arrives and such streams are cut after
``rate_grace_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from hivemind.p2p import P2P

from protocol.errors import RemoteError
from protocol.framing import frame_header, read_message
from protocol.limits import InflightLedger, RpcLimits
from protocol.messages import Ack, Backward, Busy, Error, Hello, pack, unpack
from protocol.rpc import PROTOCOL_PREFIX, RpcServer, call

pytestmark = pytest.mark.timeout(120)

KiB, MiB = 2**10, 2**20
HELLO = Hello(protocol_version=1, run_id="run", stage=0, peer_id="x", capabilities=[])


def test_ledger_gives_strangers_a_small_allowance_and_a_shared_pool():
    lim = RpcLimits(max_inflight_bytes=10 * MiB, stranger_inflight_bytes=1 * MiB, strangers_inflight_bytes=3 * MiB)
    ledger = InflightLedger(lim)
    ledger.charge("s1", MiB, allowance=MiB)
    with pytest.raises(OverflowError):
        ledger.charge("s1", 1, allowance=MiB)  # its own allowance
    ledger.charge("s2", MiB, allowance=MiB)
    ledger.charge("s3", MiB, allowance=MiB)
    with pytest.raises(OverflowError):
        ledger.charge("s4", 1, allowance=MiB)  # the pool all strangers share
    ledger.charge("known", 7 * MiB, allowance=None)  # known peers keep the rest
    with pytest.raises(OverflowError):
        ledger.charge("known", 1, allowance=None)  # the server's total
    ledger.release("s1", MiB, stranger_bytes=MiB)
    ledger.charge("s4", MiB, allowance=MiB)
    assert ledger.total == 10 * MiB and ledger.strangers == 3 * MiB


async def _peers(n: int) -> list[P2P]:
    first = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    maddrs = await first.get_visible_maddrs()
    rest = await asyncio.gather(*(P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
                                  for _ in range(n - 1)))
    return [first, *rest]

@contextlib.asynccontextmanager
async def _ack_server(limits: RpcLimits):
    """A server answering Ack on "echo" under ``limits``, an honest client and an attacker (all shut down after)."""
    server, honest, attacker = await _peers(3)
    try:
        rpc = RpcServer(server, limits)

        async def echo(msg, peer):
            return Ack()

        await rpc.add_handler("echo", echo)
        yield rpc, server, honest, attacker
    finally:
        await asyncio.gather(*(p.shutdown() for p in (server, honest, attacker)), return_exceptions=True)



async def _stalled_stream(attacker: P2P, server: P2P, announce: int) -> asyncio.StreamWriter:
    """Open a stream to ``echo``, announce a frame of ``announce`` bytes and send nothing more."""
    _, _, writer = await attacker.call_binary_stream_handler(server.peer_id, PROTOCOL_PREFIX + "echo")
    writer.write(frame_header(announce, end=True))
    await writer.drain()
    return writer


def test_announced_but_unsent_bytes_reserve_nothing_and_stalled_streams_are_cut():
    """4 identities x 4 streams each announce 1 MiB against an 8 MiB server budget (today: 16 MiB reserved, every
    other request Busy until the 60 s read timeout). An honest stranger's call must still be served at once."""
    limits = RpcLimits(max_frame_bytes=MiB, send_frame_bytes=MiB, max_message_bytes=2 * MiB,
                       max_inflight_bytes=8 * MiB, read_timeout_s=60.0, rate_grace_s=2.0, linger_s=0.1)

    async def main() -> None:
        peers = await _peers(6)
        server, honest, attackers = peers[0], peers[1], peers[2:]
        try:
            rpc = RpcServer(server, limits)

            async def echo(msg, peer):
                return Ack()

            await rpc.add_handler("echo", echo)
            writers = await asyncio.gather(*(_stalled_stream(a, server, MiB) for a in attackers for _ in range(4)))
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            reply = await call(honest, server.peer_id, "echo", HELLO, timeout=10, limits=limits)
            assert isinstance(reply, Ack), reply
            assert time.monotonic() - t0 < 2.0
            assert rpc._inflight < MiB  # nothing was reserved for the silent streams
            # the silent streams are cut after the grace period, not after the 60 s read timeout
            deadline = time.monotonic() + limits.rate_grace_s + 3
            while rpc.cut_slow < 16 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert rpc.cut_slow == 16, rpc.rejected
            for w in writers:
                w.close()
        finally:
            await asyncio.gather(*(p.shutdown() for p in peers), return_exceptions=True)

    asyncio.run(main())


def test_a_trickling_stream_is_cut_at_the_minimum_rate():
    limits = RpcLimits(rate_grace_s=1.0, min_bytes_per_s=64 * KiB, linger_s=0.1)

    async def main() -> None:
        server, client = await _peers(2)
        try:
            rpc = RpcServer(server, limits)

            async def echo(msg, peer):
                return Ack()

            await rpc.add_handler("echo", echo)
            _, reader, writer = await client.call_binary_stream_handler(server.peer_id, PROTOCOL_PREFIX + "echo")
            writer.write(frame_header(MiB, end=True))
            t0 = time.monotonic()
            cut = None
            for _ in range(100):  # 1 KiB every 0.1 s: 10 KiB/s, well below the minimum rate
                try:
                    writer.write(b"\0" * KiB)
                    await writer.drain()
                except (ConnectionError, OSError):
                    break
                if rpc.cut_slow:
                    cut = time.monotonic() - t0
                    break
                await asyncio.sleep(0.1)
            assert cut is not None and cut < limits.rate_grace_s + 2.5, (cut, rpc.rejected)
            writer.close()
        finally:
            await asyncio.gather(client.shutdown(), server.shutdown(), return_exceptions=True)

    asyncio.run(main())


def test_a_flood_of_never_writing_streams_from_one_id_does_not_stall_others():
    limits = RpcLimits(rate_grace_s=2.0, linger_s=0.1)

    async def main() -> None:
        async with _ack_server(limits) as (rpc, server, honest, attacker):
            base = 0.0
            for _ in range(5):  # honest latency before the flood, on this machine now
                t0 = time.monotonic()
                await call(honest, server.peer_id, "echo", HELLO, timeout=10, limits=limits)
                base = max(base, time.monotonic() - t0)
            name = PROTOCOL_PREFIX + "echo"
            opened = await asyncio.gather(*(attacker.call_binary_stream_handler(server.peer_id, name)
                                            for _ in range(200)), return_exceptions=True)
            worst = 0.0
            for _ in range(5):
                t0 = time.monotonic()
                assert isinstance(await call(honest, server.peer_id, "echo", HELLO, timeout=10, limits=limits), Ack)
                worst = max(worst, time.monotonic() - t0)
            assert worst < 1.0 + 3 * base, (worst, base)  # (the issue saw 2-8 s stalls; base: the machine's load)
            # a stranger holds at most a few streams: the others were refused Busy (until it had used up the refusals
            # a stranger may cause: 2 x stranger_refusals_per_s at once), then it was banned: the rest were held
            # unread (16 of them) or closed unread, or cut for silence
            deadline = time.monotonic() + limits.rate_grace_s + 5
            handled = lambda: rpc.rejected["busy"] + rpc.rejected["banned"] + rpc.cut_slow  # noqa: E731
            while handled() < 200 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            assert handled() >= 200, (rpc.rejected, rpc.cut_slow)
            assert rpc.rejected["busy"] >= 2 * limits.stranger_refusals_per_s and rpc.rejected["banned"] >= 100
            assert rpc.flood.bans == 1 and rpc.flood.held == limits.max_streams_per_peer
            for o in opened:
                if not isinstance(o, BaseException):
                    o[2].close()

    asyncio.run(main())


def test_per_handler_limits_and_message_kinds():
    async def main() -> None:
        server, client = await _peers(2)
        try:
            rpc = RpcServer(server, RpcLimits())
            seen = []

            async def forward(msg, peer):
                seen.append(msg)
                return Ack()

            await rpc.add_handler("forward", forward)
            rpc.restrict("forward", kinds=(Backward,), max_message_bytes=32 * KiB)
            with pytest.raises(RemoteError) as e:  # wrong kind: refused before the handler, no traceback
                await call(client, server.peer_id, "forward", HELLO, timeout=10)
            assert e.value.code.name == "BAD_REQUEST" and rpc.rejected["wrong_kind"] == 1 and not seen
            # a frame announcing more than the handler's limit is refused before its body is read
            _, reader, writer = await client.call_binary_stream_handler(server.peer_id, PROTOCOL_PREFIX + "forward")
            writer.write(frame_header(64 * KiB, end=True))
            await writer.drain()
            reply = unpack(await read_message(reader, max_frame_bytes=MiB, max_message_bytes=MiB))
            assert isinstance(reply, Error) and reply.code.name == "TOO_LARGE", reply
            writer.close()
            ok = Backward(run_id="r", mb_id=1, route=["a"], gradient=None, loss=None, is_eval=False)
            assert len(pack(ok)) < 32 * KiB
            assert isinstance(await call(client, server.peer_id, "forward", ok, timeout=10), Ack)
        finally:
            await asyncio.gather(client.shutdown(), server.shutdown(), return_exceptions=True)

    asyncio.run(main())


def test_vouched_peers_get_the_full_budget_and_strangers_only_their_allowance():
    limits = RpcLimits(max_frame_bytes=MiB, max_message_bytes=4 * MiB, stranger_inflight_bytes=MiB,
                       stranger_streams=2, rate_grace_s=2.0, linger_s=0.1)

    async def main() -> None:
        server, client = await _peers(2)
        try:
            rpc = RpcServer(server, limits)
            gate = asyncio.Event()

            async def slow(msg, peer):
                await gate.wait()
                return Ack()

            await rpc.add_handler("slow", slow)
            calls = [asyncio.create_task(call(client, server.peer_id, "slow", HELLO, timeout=10, limits=limits))
                     for _ in range(3)]
            await asyncio.sleep(1.0)
            done = [t for t in calls if t.done()]
            assert len(done) == 1 and isinstance(done[0].result(), Busy)  # a stranger holds 2 streams at most
            gate.set()
            await asyncio.gather(*calls)
            rpc.vouch(client.peer_id.to_base58())
            gate.clear()
            calls = [asyncio.create_task(call(client, server.peer_id, "slow", HELLO, timeout=10, limits=limits))
                     for _ in range(3)]
            await asyncio.sleep(1.0)
            assert not any(t.done() for t in calls)  # known: all three are being served
            gate.set()
            assert all(isinstance(r, Ack) for r in await asyncio.gather(*calls))
        finally:
            await asyncio.gather(client.shutdown(), server.shutdown(), return_exceptions=True)

    asyncio.run(main())


def test_a_stranger_that_keeps_being_refused_has_its_streams_closed_unread_and_others_are_served():
    # banned for 0.2-0.4 s once its refusals are spent, its streams closed at once (held: tests/test_protocol_gate.py)
    limits = RpcLimits(stranger_refusals_per_s=5.0, strangers_refusals_per_s=1000.0, stranger_ban_s=0.2,
                       stranger_max_ban_s=0.4, banned_hold_s=0.0)

    async def main() -> None:
        async with _ack_server(limits) as (rpc, server, honest, attacker):
            rpc.restrict("echo", kinds=(Hello,))
            wrong = Backward(run_id="r", mb_id=1, route=["a"], gradient=None, loss=None, is_eval=False)
            replies = []
            for _ in range(30):  # the wrong kind of message, over and over: refused BAD_REQUEST, then not read at all
                try:
                    replies.append(type(await call(attacker, server.peer_id, "echo", wrong, timeout=5)).__name__)
                except RemoteError as e:
                    replies.append(e.code.name)
                except Exception as e:  # the stream closed unanswered
                    replies.append(type(e).__name__)
            assert replies[:10] == ["BAD_REQUEST"] * 10, replies  # its burst: 2 x stranger_refusals_per_s
            # then only what its budget refills (5 per second) is read; the rest is closed unanswered
            assert rpc.rejected["banned"] >= 15 and replies[10:].count("BAD_REQUEST") <= 5, (replies, rpc.rejected)
            for _ in range(30):  # a stranger whose requests succeed is never charged
                assert isinstance(await call(honest, server.peer_id, "echo", HELLO, timeout=10), Ack)
            await asyncio.sleep(2 / limits.stranger_refusals_per_s + 0.2)  # ban over, budget refilled: heard again
            with pytest.raises(RemoteError):
                await call(attacker, server.peer_id, "echo", wrong, timeout=5)

    asyncio.run(main())
