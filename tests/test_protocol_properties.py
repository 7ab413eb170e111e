"""Hypothesis properties: every valid message survives pack/unpack; quantizers stay within their per-block bounds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.codecs.quant import (
    ECQ_BLOCK,
    ECQ_STEP,
    FLUSH_BELOW,
    INT3_BLOCK,
    INT3_LEVELS,
    INT4_BLOCK,
    INT4_LEVELS,
    INT8_BLOCK,
)
from protocol.codecs.registry import encode, roundtrip
from protocol.envelope import TensorEnvelope
from protocol.errors import ErrorCode
from protocol.messages import (
    AveragingPart,
    Backward,
    Error,
    Forward,
    Hello,
    Infer,
    InferResult,
    StateChunk,
    pack,
    unpack,
)

pytestmark = pytest.mark.timeout(120)

PROPS = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow])  # fmt: skip

names = st.text(max_size=40)
ids = st.integers(0, 2**63 - 1)
stages = st.integers(0, 1023)
finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
shapes = st.lists(st.integers(0, 6), max_size=3).map(tuple)


def _envelope(shape: tuple[int, ...], seed: int, codec: str) -> TensorEnvelope:
    return encode(torch.randn(shape, generator=torch.Generator().manual_seed(seed)), codec)


envelopes = st.builds(_envelope, shapes, st.integers(0, 2**31),
                      st.sampled_from(["none", "fp16", "bf16", "int8", "int4", "topk:0.5", "ecq"]))  # fmt: skip


def _state_chunk(n_chunks: int) -> st.SearchStrategy[StateChunk]:
    return st.builds(StateChunk, names, stages, ids, st.integers(0, n_chunks - 1), st.just(n_chunks),
                     st.dictionaries(names, scalars, max_size=4), st.dictionaries(names, envelopes, max_size=3))


scalars = st.one_of(st.booleans(), st.integers(-(2**63), 2**63 - 1), finite, st.text(max_size=20))
messages = st.one_of(
    st.builds(Hello, st.integers(0, 2**31), names, stages, names, st.lists(st.text(max_size=64), max_size=5)),
    st.builds(Forward, names, ids, st.lists(names, max_size=5), envelopes, st.none() | envelopes, st.booleans(),
              st.floats(0, 1e12), st.none() | ids),
    st.builds(Backward, names, ids, st.lists(names, max_size=5), st.none() | envelopes,
              st.none() | st.floats(-1e30, 1e30), st.booleans()),
    st.builds(Error, st.sampled_from(list(ErrorCode)), st.text(max_size=200)),
    st.builds(AveragingPart, names, stages, ids, names, st.lists(envelopes, max_size=3),
              st.floats(0, 1e6, exclude_min=True)),
    st.integers(1, 5).flatmap(_state_chunk),
    st.builds(Infer, names, stages, envelopes, st.text(max_size=32)),
    st.builds(InferResult, stages, ids, envelopes),
)  # fmt: skip


@PROPS
@given(messages)
def test_every_valid_message_roundtrips(msg) -> None:
    assert unpack(pack(msg)) == msg


def _block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    flat = x.reshape(-1)
    pad = (-flat.numel()) % block
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, block)
    return blocks.abs().amax(dim=1).repeat_interleave(block)[: flat.numel()]


def _tensor(n: int, scale: float, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


# down to subnormal floats: a block below FLUSH_BELOW is sent as zeros (its error is then at most FLUSH_BELOW)
tensors = st.builds(_tensor, st.integers(1, 700), st.floats(1e-42, 1e30), st.integers(0, 2**31))
BF16_UP = 1 + 2**-7  # scales are block absmax rounded up to bfloat16


@PROPS
@given(tensors)
def test_int8_error_within_half_a_step_per_block(x: torch.Tensor) -> None:
    bound = _block_absmax(x, INT8_BLOCK) * BF16_UP / 127 / 2
    err = (roundtrip(x, "int8") - x).abs()
    assert bool((err <= bound * (1 + 1e-5) + FLUSH_BELOW).all())


@PROPS
@given(tensors)
def test_int4_error_within_half_the_widest_gap_per_block(x: torch.Tensor) -> None:
    half_gap = float((INT4_LEVELS[1:] - INT4_LEVELS[:-1]).max()) / 2
    bound = _block_absmax(x, INT4_BLOCK) * BF16_UP * half_gap
    err = (roundtrip(x, "int4") - x).abs()
    assert bool((err <= bound * (1 + 1e-5) + FLUSH_BELOW).all())


@PROPS
@given(tensors)
def test_int3_error_within_half_the_widest_gap_per_block(x: torch.Tensor) -> None:
    half_gap = float((INT3_LEVELS[1:] - INT3_LEVELS[:-1]).max()) / 2
    bound = _block_absmax(x, INT3_BLOCK) * BF16_UP * half_gap
    err = (roundtrip(x, "int3") - x).abs()
    assert bool((err <= bound * (1 + 1e-5) + FLUSH_BELOW).all())


@PROPS
@given(tensors)
def test_ecq_error_within_half_a_step_per_block(x: torch.Tensor) -> None:
    flat = torch.nn.functional.pad(x.reshape(-1), (0, (-x.numel()) % ECQ_BLOCK)).view(-1, ECQ_BLOCK).double()
    rms = flat.square().mean(dim=1).sqrt().repeat_interleave(ECQ_BLOCK)[: x.numel()]
    bound = rms * (1 + 2**-8) * ECQ_STEP / 2  # the scale is the block's RMS rounded to the nearest bfloat16
    err = (roundtrip(x, "ecq").double() - x.double()).abs()
    assert bool((err <= bound * (1 + 1e-5) + FLUSH_BELOW).all())
