"""Fuzzing every decoder with random and mutated inputs: only our typed errors may come out, memory stays bounded.

Each decoder sees FUZZ_INPUTS (10,000) inputs: a third random bytes, the rest valid inputs mutated by bit flips, byte
writes, insertions, deletions and truncation. Hypothesis drives the search (derandomised, so CI sees the same inputs
every run); each hypothesis example draws a seed from which a batch of BATCH inputs is generated with `random`,
because hypothesis' own per-example overhead (~1-7 ms) would make 10,000 examples per decoder cost minutes.
The counters assert that all inputs ran and that both outcomes (accepted, rejected) occurred.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.codecs.registry import CODEC_IDS, decode, encode
from protocol.envelope import TensorEnvelope
from protocol.errors import ProtocolError
from protocol.framing import frame_header, read_message
from protocol.messages import (
    Ack,
    AveragingPart,
    Backward,
    Busy,
    Error,
    Forward,
    Hello,
    Infer,
    InferResult,
    Message,
    StateChunk,
    StateRequest,
    pack,
    unpack,
)  # fmt: skip

pytestmark = pytest.mark.timeout(240)

FUZZ_INPUTS = 10_000
BATCH = 25
FUZZ = settings(
    max_examples=FUZZ_INPUTS // BATCH, deadline=None, derandomize=True, database=None,
    suppress_health_check=list(HealthCheck),
)  # fmt: skip
MAX_ELEMENTS = 2**16  # the fuzzer's decoded tensors stay small; the memory test below covers the defaults

_gen = torch.Generator().manual_seed(3)
ENVELOPES = [
    encode(torch.randn(3, 70, generator=_gen), codec)
    for codec in ("none", "fp16", "bf16", "int8", "int4", "int8q", "int3", "ecq")
] + [encode(torch.randn(300, generator=_gen), "topk:0.05"), encode(torch.arange(10), "none"),
     encode(torch.randn(5, generator=_gen).to(torch.bfloat16), "none")]  # fmt: skip
MESSAGES: list[Message] = [
    Hello(1, "run", 1, "QmPeer", ["int8"]),
    Forward("run", 5, ["QmA"], ENVELOPES[3], ENVELOPES[7], False, 12.5),
    Backward("run", 5, ["QmA", "QmB"], ENVELOPES[4], 2.5, False),
    AveragingPart("run", 0, 3, "QmA", ENVELOPES[5:7], 1.0),
    StateChunk("run", 0, 9, 0, 1, {"step": 9, "lr": 0.1}, {"a": ENVELOPES[0], "b": ENVELOPES[8]}),
    StateRequest("run", 0, 0), Ack(), Busy(1.0), Error(5, "too large"),
    Infer("run", 1, ENVELOPES[3], "fp16"), InferResult(1, 7, ENVELOPES[1]),
]  # fmt: skip
PACKED = [pack(m) for m in MESSAGES]
FRAMED = [frame_header(len(p), end=True) + p for p in PACKED] + [
    frame_header(10, end=False) + PACKED[1][:10] + frame_header(len(PACKED[1]) - 10, end=True) + PACKED[1][10:]
]


OPS = ("flip", "set", "insert", "delete", "truncate")


def mutate(rng: random.Random, seed: bytes) -> bytes:
    data = bytearray(seed)
    for _ in range(rng.randint(1, 6)):
        op, at, value = rng.choice(OPS), rng.randint(0, len(data)), rng.randint(0, 255)
        if op == "flip" and data:
            data[at % len(data)] ^= 1 << (value % 8)
        elif op == "set" and data:
            data[at % len(data)] = value
        elif op == "insert":
            data[at:at] = bytes([value]) * (1 + value % 4)
        elif op == "delete":
            del data[at : at + 1 + value % 8]
        elif op == "truncate":
            del data[at:]
    return bytes(data)


def batch(seed: int, seeds: list[bytes]) -> list[bytes]:
    """BATCH inputs from one seed: random bytes or a mutated valid input."""
    rng = random.Random(seed)
    return [
        rng.randbytes(rng.randint(0, 600)) if rng.random() < 1 / 3 else mutate(rng, rng.choice(seeds))
        for _ in range(BATCH)
    ]


def _decode_all(msg: Message) -> None:
    for value in vars(msg).values():
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]
        for env in items:
            if isinstance(env, TensorEnvelope):
                decode(env, peer="fuzzer", max_elements=MAX_ELEMENTS)


def test_fuzz_unpack_and_decode_messages() -> None:
    seen = {"ok": 0, "rejected": 0}

    @FUZZ
    @given(st.integers(0, 2**32))
    def check(seed: int) -> None:
        for data in batch(seed, PACKED):
            try:
                _decode_all(unpack(data))
                seen["ok"] += 1
            except ProtocolError:
                seen["rejected"] += 1

    check()
    assert sum(seen.values()) >= FUZZ_INPUTS and seen["ok"] > 0 and seen["rejected"] > 0, seen


def test_fuzz_read_message() -> None:
    seen = {"ok": 0, "rejected": 0}
    loop = asyncio.new_event_loop()

    async def read(data: bytes) -> bytes:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_message(reader, max_frame_bytes=4096, max_message_bytes=16384)

    @FUZZ
    @given(st.integers(0, 2**32))
    def check(seed: int) -> None:
        for data in batch(seed, FRAMED):
            try:
                body = loop.run_until_complete(read(data))
                assert len(body) <= 16384
                seen["ok"] += 1
            except ProtocolError:
                seen["rejected"] += 1

    try:
        check()
    finally:
        loop.close()
    assert sum(seen.values()) >= FUZZ_INPUTS and seen["ok"] > 0 and seen["rejected"] > 0, seen


CODEC_CHOICES = sorted(CODEC_IDS) + [9, 255]
DTYPE_CHOICES = ["float32", "float16", "bfloat16", "int64", "bool", "x"]


def near_envelope(rng: random.Random) -> TensorEnvelope:
    """An envelope near a valid one: a real payload mutated or replaced, under a possibly different header."""
    base = rng.choice(ENVELOPES)
    codec = base.codec if rng.random() < 0.6 else rng.choice(CODEC_CHOICES)
    dtype = base.dtype if rng.random() < 0.7 else rng.choice(DTYPE_CHOICES)
    shape = base.shape if rng.random() < 0.6 else tuple(rng.randint(0, 400) for _ in range(rng.randint(0, 3)))
    roll = rng.random()
    if roll < 0.4:  # same length, random content: passes the length check, exercises the payload checks
        data = rng.randbytes(len(base.data))
    elif roll < 0.7:
        data = mutate(rng, base.data)
    elif roll < 0.8:
        data = rng.randbytes(rng.randint(0, 64))
    else:
        data = base.data
    return TensorEnvelope(codec=codec, dtype=dtype, shape=shape, data=data)


def test_fuzz_decode_envelopes() -> None:
    seen = {"ok": 0, "rejected": 0}

    @FUZZ
    @given(st.integers(0, 2**32))
    def check(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(BATCH):
            env = near_envelope(rng)
            try:
                t = decode(env, peer="fuzzer", max_elements=MAX_ELEMENTS)
                assert tuple(t.shape) == env.shape
                if t.is_floating_point():
                    assert bool(torch.isfinite(t).all())
                seen["ok"] += 1
            except ProtocolError:
                seen["rejected"] += 1

    check()
    assert sum(seen.values()) >= FUZZ_INPUTS and seen["ok"] > 0 and seen["rejected"] > 0, seen


MEMORY_PROBE = textwrap.dedent(
    """
    import asyncio, resource, struct
    import msgpack, torch
    from protocol.codecs.registry import decode, encode
    from protocol.envelope import TensorEnvelope
    from protocol.errors import ProtocolError
    from protocol.framing import frame_header, read_message
    from protocol.messages import PROTOCOL_VERSION, unpack

    def rss_mib():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    base = rss_mib()
    hostile = [
        b"\\x93\\x02\\x02\\xdd\\xff\\xff\\xff\\xff",                 # array announcing 2**32 - 1 items
        b"\\x93\\x02\\x02\\xc6\\xff\\xff\\xff\\xff" + bytes(16),     # bin announcing 4 GiB
        b"\\x93\\x02\\x02\\xdf\\xff\\xff\\xff\\xff",                 # map announcing 2**32 - 1 entries
        b"\\x91" * 100_000,                                       # nesting 100,000 deep
        msgpack.packb([PROTOCOL_VERSION, 2, ["r", 1, [], [5, "float32", [2**27, 4], b""], None, False, 0.0, None]]),
    ]
    for data in hostile:
        try:
            decode(unpack(data).activations, peer="probe")
        except ProtocolError:
            pass

    for env in (TensorEnvelope(5, "float32", (2**20, 2**20), b""), TensorEnvelope(5, "float32", (2**29,), b""),
                TensorEnvelope(0, "float32", (2**40 - 1,), bytes(16)), TensorEnvelope(3, "float32", (2**28,), b"")):
        try:
            decode(env, peer="probe")
        except ProtocolError:
            pass

    async def frames():
        for header in (frame_header(2**40, end=True), frame_header(2**64 - 1, end=False)):
            reader = asyncio.StreamReader()
            reader.feed_data(header)
            try:
                await read_message(reader, max_frame_bytes=2**22, max_message_bytes=2**28)
            except ProtocolError:
                pass
    asyncio.run(frames())
    print(rss_mib() - base)
    """
)


def test_hostile_sizes_do_not_allocate() -> None:
    """Sizes announced by headers (frames, msgpack, envelopes) never turn into allocations; fresh process so the
    peak RSS is ours alone."""
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    growth_mib = float(out.stdout.strip().splitlines()[-1])
    assert growth_mib < 64, f"peak RSS grew by {growth_mib:.0f} MiB"
