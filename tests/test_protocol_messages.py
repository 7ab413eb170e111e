"""Messages (strict msgpack schemas, versions), framing on in-memory streams, limits and byte budgets."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import torch

from protocol.codecs.registry import encode
from protocol.errors import ErrorCode, FrameTooLarge, MalformedMessage, RateLimited, VersionMismatch
from protocol.framing import HEADER, StreamEnded, frame_header, read_message, write_message
from protocol.limits import PeerBudgets, RpcLimits
from protocol.messages import (
    MESSAGE_KINDS,
    PROTOCOL_VERSION,
    Ack,
    AveragingPart,
    Backward,
    Busy,
    Error,
    Forward,
    Fraud,
    Hello,
    Infer,
    InferResult,
    Records,
    RecordsRequest,
    StateChunk,
    StateDigestRequest,
    StateRequest,
    Testimony,
    TestimonyRequest,
    Vouches,
    VouchesRequest,
    pack,
    unpack,
)

pytestmark = pytest.mark.timeout(60)

ENV = encode(torch.randn(2, 3), "int8")
SAMPLES = [
    Hello(PROTOCOL_VERSION, "run-abc", 2, "QmPeer", ["int8", "int4"]),
    Forward("run", 17, ["QmA", "QmB"], ENV, encode(torch.arange(6), "none"), False, 1700000000.5),
    Forward("run", 18, [], ENV, None, True, 0.0),
    Forward("run", 19, ["QmA"], ENV, None, False, 0.0, 41),
    Backward("run", 17, ["QmA"], ENV, 3.25, False),
    Backward("run", 18, ["QmA"], None, None, True),
    Backward("run", 19, ["QmA"], ENV, 3.25, False, False, ["QmB", "QmC"], 2**63 - 1),
    Forward("run", 20, ["QmA"], ENV, None, False, 0.0, None, None, b"key", b"sig"),
    Backward("run", 20, ["QmA"], ENV, 3.25, False, False, ["QmB"], 9, b"key", b"sig", [[b"d" * 32, b"s", b"k"]]),
    Ack(),
    Busy(0.5),
    Error(ErrorCode.WRONG_STAGE, "I serve stage 1"),
    AveragingPart("run", 1, 40, "QmA", [ENV, ENV], 1.0),
    StateRequest("run", 1, 3),
    StateDigestRequest("run", 1, 2**62, 64),
    StateChunk("run", 1, 1234, 0, 2, {"step": 5, "lr": 1e-3, "name": "x", "stash": True}, {"w.0": ENV}),
    Infer("run", 0, encode(torch.arange(6).view(1, 6), "none"), "int8"),
    InferResult(1, 250, ENV),
    RecordsRequest("run"),
    Records("run", [{"p": "QmA", "e": 1e9, "b": b"body", "k": b"key", "s": b"sig"},
                    {"p": "QmB", "e": 2e9, "b": b"", "k": b"k", "s": b"s", "c": b"credential"}]),
    VouchesRequest("run"),
    Vouches("run", ["QmA", "QmB"]),
    TestimonyRequest("run", "QmA", 17),
    Testimony(b"forward", b"backward", b"key", b"sig"),
    Fraud("run", "QmW", 17, b"testimony", [b"d" * 32, b"s", b"k"]),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_pack_unpack_roundtrip(msg) -> None:
    assert unpack(pack(msg)) == msg


def test_every_kind_is_sampled() -> None:
    assert {type(m) for m in SAMPLES} == set(MESSAGE_KINDS.values())


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: Hello(1, "run", True, "p", []), "Hello.stage"),
        (lambda: Hello(1, "run", 0, "p", "int8"), "Hello.capabilities"),
        (lambda: Forward("run", -1, [], ENV, None, False, 0.0), "Forward.mb_id"),
        (lambda: Forward("run", 1, [], ENV, None, 0, 0.0), "Forward.is_eval"),
        (lambda: Forward("run", 1, [], b"raw", None, False, 0.0), "Forward.activations"),
        (lambda: Backward("run", 1, [], None, float("nan"), False), "Backward.loss"),
        (lambda: Busy(float("inf")), "Busy.retry_after_s"),
        (lambda: Error(99, "x"), "Error.code"),
        (lambda: AveragingPart("run", 0, 0, "p", [ENV], -0.999), "AveragingPart.weight"),
        (lambda: AveragingPart("run", 0, 0, "p", [ENV], 0.0), "AveragingPart.weight"),
        (lambda: StateChunk("run", 0, 0, 2, 2, {}, {}), "chunk 2 must be below"),
        (lambda: StateChunk("run", 0, 0, 0, 1, {"x": [1]}, {}), "StateChunk.meta"),
        (lambda: StateRequest("r" * 300, 0, 0), "StateRequest.run_id"),
    ],
)
def test_strict_types_at_construction(build, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()


def _raw(version: object, kind: object, fields: object) -> bytes:
    return msgpack.packb([version, kind, fields], use_bin_type=True)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        _raw(PROTOCOL_VERSION, 1, [1, "run", 0, "p"]),  # missing a field
        _raw(PROTOCOL_VERSION, 1, [1, "run", 0, "p", [], "extra"]),
        _raw(PROTOCOL_VERSION, 42, []),
        _raw(PROTOCOL_VERSION, "Hello", []),
        _raw(PROTOCOL_VERSION, 4, {}),
        msgpack.packb({"v": 1}),
        _raw(PROTOCOL_VERSION, 5, [True]),  # bool is not a number here
        _raw(PROTOCOL_VERSION, 2, ["run", 1, [], [3, "float32", [2], b"12345678"], None, False, "now", None]),
        _raw(PROTOCOL_VERSION, 2, ["run", 1, [], [3, "float32", [-2], b""], None, False, 0.0, None]),
        _raw(PROTOCOL_VERSION, 2, ["run", 1, [], [3, "float32", [2], "text"], None, False, 0.0, None]),
        _raw(PROTOCOL_VERSION, 2, ["run", 1, [], [3, "float32", [2], b"12345678"], None, False, 0.0]),  # v1 Forward
        _raw(PROTOCOL_VERSION, 2, ["run", 1, [], [3, "float32", [2], b"12345678"], None, False, 0.0, -1]),
        _raw(PROTOCOL_VERSION, 9, ["run", 0, 0, 0, 1, {1: 2}, {}]),
        pack(Ack()) + b"\x00",  # trailing bytes
        msgpack.packb([PROTOCOL_VERSION, 4, [msgpack.ExtType(5, b"x")]]),
    ],
)
def test_unpack_rejects_malformed(data: bytes) -> None:
    with pytest.raises(MalformedMessage):
        unpack(data)


def test_version_mismatch_says_which_versions() -> None:
    with pytest.raises(VersionMismatch, match=rf"version 99.*speaks version\(s\) {PROTOCOL_VERSION}"):
        unpack(_raw(99, 4, []))
    with pytest.raises(VersionMismatch):
        unpack(_raw(99, "garbage", "fields"))  # the version is checked first


def _reader(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


class _Sink:
    """Minimal StreamWriter stand-in collecting what is written."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, b: bytes) -> None:
        self.data += b

    async def drain(self) -> None:
        return None


def test_framing_roundtrip_many_frames() -> None:
    async def main() -> None:
        payload = bytes(range(256)) * 1000
        sink = _Sink()
        await write_message(sink, payload, frame_bytes=1000)  # type: ignore[arg-type]
        assert len(sink.data) == len(payload) + 256 * HEADER.size
        got = await read_message(_reader(bytes(sink.data)), max_frame_bytes=1000, max_message_bytes=10**6)
        assert got == payload
        sink = _Sink()
        await write_message(sink, b"", frame_bytes=10)  # type: ignore[arg-type]
        assert await read_message(_reader(bytes(sink.data)), max_frame_bytes=10, max_message_bytes=100) == b""

    asyncio.run(main())


def test_framing_refuses_before_reading_body() -> None:
    async def main() -> None:
        reader = _reader(frame_header(2**40, end=True), eof=False)  # no body, and the stream stays open
        with pytest.raises(FrameTooLarge, match="1099511627776"):
            await asyncio.wait_for(read_message(reader, max_frame_bytes=2**20, max_message_bytes=2**30), 1.0)
        many = b"".join(frame_header(10, end=False) + bytes(10) for _ in range(20))
        with pytest.raises(FrameTooLarge, match="message"):
            await read_message(_reader(many), max_frame_bytes=100, max_message_bytes=300)
        empties = frame_header(0, end=False) * 10**4  # empty frames still count their headers
        with pytest.raises(FrameTooLarge):
            await read_message(_reader(empties), max_frame_bytes=100, max_message_bytes=1000)
        refused = []

        def admit(n: int) -> None:
            refused.append(n)
            raise RateLimited("no budget")

        with pytest.raises(RateLimited):  # budgets are charged per chunk as it arrives, not on announcement
            await read_message(_reader(frame_header(50, end=True) + bytes(50)), max_frame_bytes=100,
                               max_message_bytes=1000, admit=admit)  # fmt: skip
        assert refused == [50]

    asyncio.run(main())


@pytest.mark.parametrize(
    "data",
    [
        b"XX\x01\x01" + bytes(8),  # magic
        b"AM\x02\x01" + bytes(8),  # framing version
        b"AM\x01\x05" + bytes(8),  # reserved flag bit
        b"AM\x01\x02" + bytes(8),  # KEEP without END
        b"AM\x01",  # truncated header
        frame_header(5, end=True),  # truncated body
    ],
)
def test_framing_rejects_bad_headers_and_truncation(data: bytes) -> None:
    async def main() -> None:
        with pytest.raises(MalformedMessage):
            await read_message(_reader(data), max_frame_bytes=100, max_message_bytes=1000)

    asyncio.run(main())


def test_keep_rides_on_the_last_frame_only() -> None:
    async def main() -> None:
        for keep in (False, True):
            w = _Sink()
            await write_message(w, b"x" * 250, frame_bytes=100, keep=keep)  # type: ignore[arg-type]
            flags = [w.data[i + 3] for i in (0, 112, 224)]
            assert flags == [0, 0, 1 | (2 if keep else 0)]
            kept: list[bool] = []
            assert await read_message(_reader(bytes(w.data)), max_frame_bytes=100, max_message_bytes=1000,
                                      kept=kept) == b"x" * 250
            assert kept == [keep]
        head = frame_header(3, end=True)  # a header read ahead (a kept stream's next request) is used first
        assert await read_message(_reader(b"abc"), max_frame_bytes=10, max_message_bytes=100, first=head) == b"abc"

    asyncio.run(main())


def test_stream_ended_is_malformed() -> None:
    assert issubclass(StreamEnded, MalformedMessage)


def test_peer_budgets_refill() -> None:
    now = [0.0]
    budgets = PeerBudgets(rate=100.0, burst=1000, max_peers=2, clock=lambda: now[0])
    budgets.take("a", 1000)
    with pytest.raises(RateLimited, match="peer a"):
        budgets.take("a", 1)
    budgets.take("b", 1000)  # budgets are per peer
    now[0] = 5.0
    budgets.take("a", 500)
    with pytest.raises(RateLimited):
        budgets.take("a", 100)
    budgets.take("c", 10)
    assert len(budgets._buckets) == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_frame_bytes": 0},
        {"send_frame_bytes": 8 * 2**20},
        {"max_message_bytes": 2**20},
        {"read_timeout_s": 0},
        {"per_peer_burst_bytes": 10},
        {"busy_retry_s": -1},
    ],
)
def test_limits_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="RpcLimits"):
        RpcLimits(**kwargs)


def test_a_records_reply_is_bounded_and_shaped() -> None:
    from protocol.messages import MAX_GOSSIP_RECORDS
    from protocol.schema import SchemaError

    rec = {"p": "QmA", "e": 1e9, "b": b"b", "k": b"k", "s": b"s"}
    with pytest.raises(SchemaError):
        Records("run", [rec] * (MAX_GOSSIP_RECORDS + 1))
    for bad in ({**rec, "x": b""}, {k: v for k, v in rec.items() if k != "s"}, {**rec, "b": "text"},
                {**rec, "k": b"k" * 9000}, {**rec, "e": -1.0}, [rec]):
        with pytest.raises(SchemaError):
            Records("run", [bad])


def test_a_backward_naming_no_downstream_packs_as_peers_before_the_field_read_it() -> None:
    plain = pack(Backward("run", 17, ["QmA"], ENV, 3.25, False))
    assert len(msgpack.unpackb(plain)[2]) == 7  # the two trailing fields are left out
    named = unpack(pack(Backward("run", 17, ["QmA"], ENV, 3.25, False, downstream=["QmB"], downstream_id=5)))
    assert isinstance(named, Backward) and (named.downstream, named.downstream_id) == (["QmB"], 5)
    with pytest.raises(ValueError, match="downstream"):  # a spot check's two replicas at most
        Backward("run", 17, ["QmA"], ENV, 3.25, False, downstream=["QmB", "QmC", "QmD"], downstream_id=5)
