"""Two real hivemind peers on loopback talking through protocol.rpc: big tensors, refusals, error replies."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
import torch
import uvloop
from hivemind.p2p import P2P

from protocol.codecs.registry import decode, encode
from protocol.errors import ErrorCode, FrameTooLarge, PeerUnreachable, RemoteError, ValidationError
from protocol.framing import HEADER, frame_header, read_message
from protocol.limits import RpcLimits
from protocol.messages import PROTOCOL_VERSION, Ack, Busy, Error, Hello, StateChunk, StateRequest, pack, unpack
from protocol.rpc import PROTOCOL_PREFIX, RpcServer, call
from protocol.validation import TensorSpec

pytestmark = pytest.mark.timeout(120)

MiB = 2**20
BIG = torch.randn(16 * MiB, generator=torch.Generator().manual_seed(0))  # 64 MiB of fp32


async def _pair() -> tuple[P2P, P2P]:
    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client = await P2P.create(initial_peers=await server.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    return server, client


def run(coro_fn, loop: str = "asyncio") -> None:
    """Run an async test body with two fresh peers, shut down even on failure (uvloop: the daemon's loop)."""

    async def main() -> None:
        server, client = await _pair()
        try:
            await coro_fn(server, client)
        finally:
            await asyncio.gather(client.shutdown(), server.shutdown(), return_exceptions=True)

    if loop == "uvloop":
        uvloop.run(main())
    else:
        asyncio.run(main())


async def _state_server(server_p2p: P2P, limits: RpcLimits, codec: str) -> RpcServer:
    rpc = RpcServer(server_p2p, limits)

    async def on_state(msg: StateRequest, peer: str) -> StateChunk:
        assert isinstance(msg, StateRequest)
        env = await asyncio.get_running_loop().run_in_executor(None, encode, BIG, codec)
        return StateChunk(msg.run_id, msg.stage, 7, msg.chunk, 1, {"codec": codec}, {"w": env})

    async def on_upload(msg: StateChunk, peer: str) -> Ack:
        got = decode(msg.tensors["w"], TensorSpec(tuple(BIG.shape), torch.float32), peer=peer, field="w")
        if not torch.equal(got, BIG):
            return Error(ErrorCode.BAD_REQUEST, "upload differs")
        return Ack()

    await rpc.add_handler("state", on_state)
    await rpc.add_handler("upload", on_upload)
    return rpc


@pytest.mark.parametrize(
    ("codec", "bound", "loop"), [("none", 0.0, "asyncio"), ("none", 0.0, "uvloop"), ("int8", 0.01, "uvloop")]
)
def test_64mib_tensor_roundtrip(codec: str, bound: float, loop: str) -> None:
    async def body(server: P2P, client: P2P) -> None:
        limits = RpcLimits(max_message_bytes=80 * MiB)
        await _state_server(server, limits, codec)
        reply = await call(client, server.peer_id, "state", StateRequest("run", 0, 0), timeout=60, limits=limits)
        assert isinstance(reply, StateChunk) and reply.version == 7
        got = decode(reply.tensors["w"], TensorSpec(tuple(BIG.shape), torch.float32), peer="server", field="w")
        if codec == "none":
            assert torch.equal(got, BIG)
            # and the other direction, as a request spanning 64 frames
            up = StateChunk("run", 0, 7, 0, 1, {}, {"w": encode(BIG, "none")})
            assert isinstance(await call(client, server.peer_id, "upload", up, timeout=60, limits=limits), Ack)
        else:
            assert float((got - BIG).norm() / BIG.norm()) <= bound

    run(body, loop)


def test_oversized_frame_refused_fast_without_reading_body() -> None:
    async def body(server: P2P, client: P2P) -> None:
        rpc = await _state_server(server, RpcLimits(), "none")
        for announced in (2**40, RpcLimits().max_frame_bytes + 1):
            _, reader, writer = await client.call_binary_stream_handler(server.peer_id, PROTOCOL_PREFIX + "state")
            start = time.perf_counter()
            writer.write(frame_header(announced, end=True) + b"x" * 1000)  # the body never comes
            await writer.drain()
            reply = unpack(await read_message(reader, max_frame_bytes=MiB, max_message_bytes=MiB))
            elapsed = time.perf_counter() - start
            writer.close()
            assert isinstance(reply, Error) and reply.code == ErrorCode.TOO_LARGE, reply
            assert str(announced) in reply.message
            assert elapsed < 1.0
        assert rpc.rejected["too_large"] == 2

    run(body, "uvloop")


def test_message_limit_over_many_frames_and_local_refusal() -> None:
    async def body(server: P2P, client: P2P) -> None:
        rpc = await _state_server(server, RpcLimits(max_message_bytes=8 * MiB), "none")
        big_request = StateChunk("run", 0, 1, 0, 1, {}, {"w": encode(BIG[: 3 * MiB], "none")})  # 12 MiB in frames
        with pytest.raises(RemoteError) as info:
            await call(client, server.peer_id, "upload", big_request, timeout=10, limits=RpcLimits())
        assert info.value.code == ErrorCode.TOO_LARGE
        # our own limit refuses before sending anything
        with pytest.raises(FrameTooLarge):
            await call(client, server.peer_id, "upload", big_request, timeout=10,
                       limits=RpcLimits(max_message_bytes=8 * MiB))  # fmt: skip
        assert rpc.rejected["too_large"] == 1

    run(body)


def test_error_replies_for_junk_version_handler_failure_and_timeouts() -> None:
    async def body(server: P2P, client: P2P) -> None:
        limits = RpcLimits(read_timeout_s=2.0, handler_timeout_s=2.0)  # generous: the test host may be loaded
        served: Counter[str] = Counter()
        rpc = RpcServer(server, limits, count=lambda name, n: served.update({name: n}))

        async def echo(msg, peer: str):
            if isinstance(msg, Hello) and msg.stage == 1:
                raise KeyError("boom")
            if isinstance(msg, Hello) and msg.stage == 2:
                await asyncio.sleep(30)
            if isinstance(msg, Hello) and msg.stage == 3:
                decode(encode(torch.tensor([float("nan")]), "none"), peer=peer, field="activations")
            return msg

        await rpc.add_handler("echo", echo)
        hello = Hello(1, "run", 0, "me", [])
        sent: Counter[str] = Counter()
        assert await call(client, server.peer_id, "echo", hello, timeout=10,
                          count=lambda name, n: sent.update({name: n})) == hello
        size = len(pack(hello))  # traffic is counted on both sides, for the caller's and the server's figures
        assert sent == {"bytes_out": size, "bytes_in": size} and served == {"bytes_in": size, "bytes_out": size}

        async def raw(payload: bytes) -> Error:
            _, reader, writer = await client.call_binary_stream_handler(server.peer_id, PROTOCOL_PREFIX + "echo")
            try:
                writer.write(payload)
                await writer.drain()
                return unpack(await read_message(reader, max_frame_bytes=MiB, max_message_bytes=MiB))
            finally:
                writer.close()

        junk = b"\xc1\xc1 not msgpack"
        assert (await raw(frame_header(len(junk), end=True) + junk)).code == ErrorCode.BAD_REQUEST
        assert (await raw(b"GET / HTTP/1.1\r\n\r\n")).code == ErrorCode.BAD_REQUEST
        ahead = PROTOCOL_VERSION + 1  # a peer of a later version: [version, kind, fields]
        future = pack(hello).replace(bytes([0x93, PROTOCOL_VERSION]), bytes([0x93, ahead]), 1)
        reply = await raw(frame_header(len(future), end=True) + future)
        assert reply.code == ErrorCode.VERSION_MISMATCH
        assert str(PROTOCOL_VERSION) in reply.message and str(ahead) in reply.message
        assert (await raw(frame_header(100, end=True) + b"short")).code == ErrorCode.TIMEOUT

        for stage, code in ((1, ErrorCode.INTERNAL), (2, ErrorCode.TIMEOUT), (3, ErrorCode.BAD_REQUEST)):
            with pytest.raises(RemoteError) as info:
                await call(client, server.peer_id, "echo", Hello(1, "run", stage, "me", []), timeout=10)
            assert info.value.code == code
        assert "NaN" in info.value.message and "activations" in info.value.message
        assert rpc.rejected == {"bad_request": 3, "version_mismatch": 1, "timeout": 2, "internal": 1}

        with pytest.raises(PeerUnreachable):
            await call(client, server.peer_id, "no_such_handler", hello, timeout=10)
        with pytest.raises(TimeoutError):
            await call(client, server.peer_id, "echo", Hello(1, "run", 2, "me", []), timeout=0.2)

    run(body)


def test_per_peer_budget_and_stream_limit() -> None:
    async def body(server: P2P, client: P2P) -> None:
        # refill is slow enough (64 KiB/s) that a loaded machine cannot make the budget test pass by being slow
        limits = RpcLimits(per_peer_bytes_per_s=64 * 1024, per_peer_burst_bytes=4 * MiB, max_streams_per_peer=2)
        rpc = RpcServer(server, limits)
        release, both_inside = asyncio.Event(), asyncio.Event()
        inside = []

        async def slow(msg, peer: str):
            inside.append(peer)
            if len(inside) == 2:
                both_inside.set()
            await release.wait()
            return Ack()

        await rpc.add_handler("slow", slow)
        await rpc.add_handler("sink", lambda msg, peer: _ack())
        payload = StateChunk("run", 0, 1, 0, 1, {}, {"w": encode(BIG[: MiB // 2], "none")})  # 2 MiB
        assert isinstance(await call(client, server.peer_id, "sink", payload, timeout=10, limits=limits), Ack)
        with pytest.raises(RemoteError) as info:  # 2 + 2 (+ 2) MiB > 4 MiB burst
            for _ in range(2):
                await call(client, server.peer_id, "sink", payload, timeout=10, limits=limits)
        assert info.value.code == ErrorCode.RATE_LIMITED

        hello = Hello(1, "run", 0, "me", [])
        pending = [asyncio.create_task(call(client, server.peer_id, "slow", hello, timeout=60)) for _ in range(2)]
        await asyncio.wait_for(both_inside.wait(), 30)
        assert isinstance(await call(client, server.peer_id, "slow", hello, timeout=10), Busy)
        release.set()
        assert all(isinstance(r, Ack) for r in await asyncio.gather(*pending))
        assert rpc.rejected["rate_limited"] == 1 and rpc.rejected["busy"] == 1

        # a server whose global buffer is full answers Busy rather than buffering more
        small = RpcServer(server, RpcLimits(max_inflight_bytes=2 * MiB))
        await small.add_handler("small_sink", lambda msg, peer: _ack())
        assert isinstance(await call(client, server.peer_id, "small_sink", payload, timeout=10), Busy)
        assert small.rejected == {"busy": 1}

    run(body)


async def _ack() -> Ack:
    return Ack()


def test_header_is_twelve_bytes() -> None:
    assert HEADER.size == 12 and frame_header(5, end=True)[:2] == b"AM"


def test_validation_error_names_peer() -> None:
    with pytest.raises(ValidationError, match="QmPeer"):
        decode(encode(torch.ones(2), "none"), TensorSpec((3,), torch.float32), peer="QmPeer")


def test_a_large_request_keeps_its_stream_for_the_next_one_to_a_known_peer() -> None:
    """A request of at least ``keep_min_bytes`` asks to keep its stream (its flow-control window has grown); a
    known peer's server keeps it, the next such call reuses it, a stranger's is not kept, small calls never ask, and a
    kept stream the server closes instead of serving costs a fresh stream, not a failed call."""
    limits = RpcLimits(keep_min_bytes=64 * 1024, keep_idle_s=4.0)
    big = StateChunk("r", 0, 1, 0, 1, {}, {"w": encode(torch.zeros(30_000), "none")})  # 120 KB
    small = Hello(PROTOCOL_VERSION, "r", 0, "p", [])
    name = PROTOCOL_PREFIX + "hello"

    async def body(server: P2P, client: P2P) -> None:
        rpc = RpcServer(server, limits)
        seen: list[str] = []

        async def on_hello(msg: Hello | StateChunk, peer: str) -> Ack:
            seen.append(peer)
            return Ack()

        await rpc.add_handler("hello", on_hello)
        opened: Counter[str] = Counter()
        real_open = client.call_binary_stream_handler

        async def counting(peer_id, handler):  # every fresh stream the caller opens
            opened[handler] += 1
            return await real_open(peer_id, handler)

        client.call_binary_stream_handler = counting  # type: ignore[method-assign]
        me = client.peer_id.to_base58()

        async def hello(msg: Hello | StateChunk) -> None:
            assert isinstance(await call(client, server.peer_id, "hello", msg, timeout=10, limits=limits), Ack)
            await asyncio.sleep(0.05)  # the server is waiting on the kept stream by now

        for _ in range(2):  # a stranger: served, never kept
            await hello(big)
        assert opened[name] == 2 and not rpc._kept
        rpc.vouch(me)
        for _ in range(3):  # known: the first stream is kept and reused
            await hello(big)
        assert opened[name] == 3 and rpc._kept[me] == 1
        for _ in range(2):  # small requests do not ask
            await hello(small)
        assert opened[name] == 5 and rpc._kept[me] == 1
        rpc.revoke(me)  # the server closes the kept stream at the next request instead of serving it: retried fresh
        await hello(big)
        assert opened[name] == 6 and not rpc._kept and len(seen) == 8
        rpc.vouch(me)
        await hello(big)
        assert opened[name] == 7 and rpc._kept[me] == 1
        await asyncio.sleep(4.3)  # idle past keep_idle_s: the server closed it, the caller opens a fresh one
        assert not rpc._kept
        await hello(big)
        assert opened[name] == 8 and len(seen) == 10

    run(body)
