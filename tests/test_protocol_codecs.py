"""Round trips, error bounds, compression ratios and validation of protocol.codecs.registry."""

from __future__ import annotations

import asyncio

import pytest
import torch

from protocol.codecs.feedback import ErrorFeedback
from protocol.codecs.registry import CODECS, decode, decode_async, encode, encode_async, roundtrip
from protocol.envelope import TensorEnvelope
from protocol.errors import ProtocolError, ValidationError
from protocol.validation import TensorSpec

pytestmark = pytest.mark.timeout(60)


def rel_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx.float() - exact.float()).norm() / exact.float().norm())


@pytest.fixture
def gaussian() -> torch.Tensor:
    return torch.randn(8, 128, 128, generator=torch.Generator().manual_seed(0))


# (codec, bound on relative L2 error for Gaussian data)
BOUNDS = [("none", 0.0), ("fp16", 1e-3), ("bf16", 5e-3), ("int8", 0.01), ("int4", 0.10), ("int8q", 0.05),
          ("int3", 0.21), ("ecq", 0.102)]
LOOSE = {"int3": 0.21, "ecq": 0.11}  # bounds on a few values (the rest: 0.1)


@pytest.mark.parametrize(("codec", "bound"), BOUNDS)
def test_roundtrip_error_bound(codec: str, bound: float, gaussian: torch.Tensor) -> None:
    out = roundtrip(gaussian, codec)
    assert out.shape == gaussian.shape and out.dtype == gaussian.dtype
    assert rel_error(out, gaussian) <= bound
    if codec == "none":
        assert torch.equal(out, gaussian)


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8", "int4", "int3", "ecq"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_roundtrip_keeps_dtype(codec: str, dtype: torch.dtype, gaussian: torch.Tensor) -> None:
    x = gaussian[:2].to(dtype)
    out = roundtrip(x, codec)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_error(out, x) <= LOOSE.get(codec, 0.1)


@pytest.mark.parametrize("shape", [(), (1,), (3,), (127,), (129,), (65, 3), (0,), (2, 0, 5)])
@pytest.mark.parametrize("codec", ["none", "fp16", "int8", "int4", "topk:0.5", "int8q", "int3", "ecq"])
def test_odd_shapes(codec: str, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    out = roundtrip(x, codec)
    assert out.shape == x.shape
    if x.numel() and codec != "topk:0.5":
        assert rel_error(out, x) <= (0.3 if codec == "int3" else 0.15)


def test_quantizers_exact_on_block_max_and_zero() -> None:
    x = torch.zeros(256)
    x[5], x[100], x[200] = 3.0, -7.5, 0.25
    for codec in ("int8", "int4", "int3"):
        out = roundtrip(x, codec)
        assert out[5] == pytest.approx(3.0, rel=1e-2) and out[100] == pytest.approx(-7.5, rel=1e-2)
        assert out[x == 0].abs().max() == 0


def test_bool_tensors_roundtrip() -> None:
    mask = torch.rand(5, 7, generator=torch.Generator().manual_seed(4)) > 0.5
    assert torch.equal(roundtrip(mask, "none"), mask)


def test_integer_tensors_need_none() -> None:
    ids = torch.randint(0, 50_000, (4, 256))
    assert torch.equal(roundtrip(ids, "none"), ids)
    with pytest.raises(ValueError, match="floating-point"):
        encode(ids, "int8")


@pytest.mark.parametrize(("codec", "min_ratio"), [("fp16", 1.99), ("bf16", 1.99), ("int8", 3.9), ("int4", 7.5),
                                                    ("int3", 9.8), ("ecq", 8.2)])
def test_compression_ratio_with_headers(codec: str, min_ratio: float, gaussian: torch.Tensor) -> None:
    env = encode(gaussian, codec)
    assert gaussian.numel() * 4 / env.wire_bytes >= min_ratio


def test_unknown_codec_names() -> None:
    for bad in ("int2", "topk:0", "topk:1.5", "topk:abc", ""):
        with pytest.raises(ValueError, match="codec|fraction"):
            encode(torch.ones(3), bad)


def test_quantizing_nan_is_refused() -> None:
    with pytest.raises(ValueError, match="NaN"):
        encode(torch.tensor([1.0, float("nan")]), "int8")


def test_topk_keeps_largest() -> None:
    x = torch.tensor([0.1, -5.0, 0.2, 3.0, 0.0, -0.3, 0.05, 1.0])
    out = roundtrip(x, "topk:0.25")
    assert torch.equal(out, torch.tensor([0.0, -5.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0]))


def test_error_feedback_sum_converges() -> None:
    """Sum of what TopK+EF sent over many steps approaches the true sum; without EF it does not."""
    gen = torch.Generator().manual_seed(2)
    deltas = [torch.randn(4096, generator=gen) * (1 + torch.rand(4096, generator=gen)) for _ in range(200)]
    truth = torch.stack(deltas).sum(0)
    feedback = ErrorFeedback("topk:0.05")
    sent_ef = torch.zeros(4096)
    sent_plain = torch.zeros(4096)
    errors = []
    for step, d in enumerate(deltas):
        sent_ef += decode(feedback.encode("w", d))
        sent_plain += roundtrip(d, "topk:0.05")
        if step in (19, 199):  # error after 20 and after 200 steps
            errors.append(rel_error(sent_ef, torch.stack(deltas[: step + 1]).sum(0)))
    # what was sent plus what is still held back is exactly the truth
    assert torch.allclose(sent_ef + feedback.residual("w"), truth, atol=1e-3)
    assert errors[1] < errors[0] and errors[1] < 0.35
    assert rel_error(sent_plain, truth) > 2 * errors[1]  # without feedback the dropped mass is lost for good
    feedback.reset("w")
    assert feedback.residual("w") is None


def test_error_feedback_shape_change_is_an_error() -> None:
    feedback = ErrorFeedback("int8")
    feedback.encode(0, torch.ones(4))
    with pytest.raises(ValueError, match="changed shape"):
        feedback.encode(0, torch.ones(5))


def _env(**kw: object) -> TensorEnvelope:
    base = dict(codec=0, dtype="float32", shape=(2, 2), data=bytes(16))
    base.update(kw)
    return TensorEnvelope(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("env", "field", "spec"),
    [
        (_env(codec=99), "x.codec", None),
        (_env(dtype="complex64"), "x.dtype", None),
        (_env(shape=(2, -2)), "x.shape", None),
        (_env(shape=[2, 2]), "x.shape", None),
        (_env(data=bytes(15)), "x.data", None),
        (_env(shape=(2, 3)), "x.shape", TensorSpec((2, 2), torch.float32)),
        (_env(dtype="float16", data=bytes(8)), "x.dtype", TensorSpec((2, 2), torch.float32)),
        (_env(codec=3, dtype="int64", data=bytes(32)), "x.codec", None),
        (_env(shape=(2**20, 2**20), data=b""), "x.shape", None),
        (_env(codec=5, data=(7).to_bytes(4, "little") + bytes(4)), "x.data", None),
        (_env(codec=5, data=bytes(16)), "x.data", None),
        (_env(dtype="bool", shape=(4,), data=b"\x00\x01\x02\x00"), "x.data", None),
    ],
)
def test_decode_rejects_with_field_and_peer(env: TensorEnvelope, field: str, spec: TensorSpec | None) -> None:
    with pytest.raises(ValidationError) as info:
        decode(env, spec, peer="QmEvil", field="x")
    assert info.value.field == field and info.value.peer == "QmEvil"
    assert "QmEvil" in str(info.value) and field in str(info.value)


def test_decode_rejects_non_finite_and_bounds() -> None:
    bad = encode(torch.tensor([1.0, float("inf")]), "none")
    with pytest.raises(ValidationError, match="NaN or infinite"):
        decode(bad, peer="p")
    x = encode(torch.full((4,), 3.0), "int8")
    assert decode(x, TensorSpec((4,), torch.float32, max_abs=3.1, max_norm=6.1)).sum() == pytest.approx(12, rel=1e-2)
    with pytest.raises(ValidationError, match="max \\|value\\|"):
        decode(x, TensorSpec((4,), torch.float32, max_abs=2.0))
    with pytest.raises(ValidationError, match="L2 norm"):
        decode(x, TensorSpec((-1,), torch.float32, max_norm=5.0))


def test_wildcard_spec_dimension() -> None:
    spec = TensorSpec((-1, 4), torch.float32)
    assert decode(encode(torch.ones(3, 4), "fp16"), spec).shape == (3, 4)
    with pytest.raises(ValidationError):
        decode(encode(torch.ones(3, 5), "fp16"), spec)
    with pytest.raises(ValidationError, match="exceed"):
        decode(encode(torch.ones(300, 4), "none"), spec, max_elements=1000)


def test_spec_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        TensorSpec((2, -3), torch.float32)
    with pytest.raises(ValueError):
        TensorSpec((2,), torch.complex64)
    with pytest.raises(ValueError):
        TensorSpec((2,), torch.int64, max_abs=1.0)


def test_async_helpers_match_sync(gaussian: torch.Tensor) -> None:
    async def main() -> None:
        big = gaussian.repeat(4, 1, 1)  # 2 MiB: goes through the executor
        for t in (gaussian[0, 0], big):
            env = await encode_async(t, "int8")
            assert env == encode(t, "int8")
            assert torch.equal(await decode_async(env, peer="p"), decode(env))
        with pytest.raises(ProtocolError):
            await decode_async(_env(codec=99), peer="p")

    asyncio.run(main())


def test_registry_ids_are_unique_and_stable() -> None:
    assert {name: c.id for name, c in CODECS.items()} == {
        "none": 0, "fp16": 1, "bf16": 2, "int8": 3, "int4": 4, "topk": 5, "int8q": 6, "int3": 7, "ecq": 8,
    }  # fmt: skip


@pytest.mark.parametrize("position", [0, 1, 127, 128, 4095, 4096])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_non_finite_anywhere_is_caught(position: int, bad: float, dtype: torch.dtype) -> None:
    x = torch.ones(4097, dtype=dtype)
    x[position] = bad
    with pytest.raises(ValidationError, match="1 of 4097 values"):
        decode(encode(x, "none"), peer="p")


def test_int4_level_search_matches_bucketize() -> None:
    from protocol.codecs.quant import _INT4_BORDERS, int4_codes

    v = torch.rand(100_000, generator=torch.Generator().manual_seed(5)) * 2 - 1
    special = torch.cat([_INT4_BORDERS, _INT4_BORDERS.nextafter(torch.tensor(2.0)), torch.tensor([-1.0, 0.0, 1.0])])
    v = torch.cat([v, special, special.nextafter(torch.tensor(-2.0)), torch.tensor([1.0000001, -1.0000001])])
    assert torch.equal(int4_codes(v).long(), torch.bucketize(v, _INT4_BORDERS))


@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "int8", "int4", "topk:0.5", "int8q", "int3", "ecq"])
def test_non_contiguous_and_grad_inputs(codec: str) -> None:
    x = torch.randn(64, 130, generator=torch.Generator().manual_seed(6)).t().requires_grad_()
    out = roundtrip(x, codec)
    assert out.shape == x.shape and out.is_contiguous() and not out.requires_grad
    assert torch.equal(roundtrip(x.detach().contiguous(), codec), out)


def test_codec_names_come_from_one_table():
    """protocol/codecs/names.py is the only list: the registry, the run file and the CLI all read it."""
    from peer.averaging.config import NetAveragingConfig
    from peer.cli.simulate import CODECS as SIMULATE_CODECS
    from protocol.codecs.names import CODEC_ID, RUN_CODECS
    from protocol.codecs.registry import CODECS
    from trainer.config import CompressionConfig

    assert {c.name: c.id for c in CODECS.values()} == CODEC_ID
    assert set(RUN_CODECS) < set(CODEC_ID) and "topk" not in RUN_CODECS
    assert SIMULATE_CODECS == RUN_CODECS
    for name in RUN_CODECS:
        CompressionConfig(activations=name, gradients=name, averaging=name)
        NetAveragingConfig(sync_codec=name)
    with pytest.raises(ValueError, match="must be one of"):
        CompressionConfig(averaging="int8q")


@pytest.mark.parametrize("n", [1, 7, 8, 9, 63, 64, 65, 1000])
def test_int3_packs_eight_codes_in_three_bytes_and_refuses_other_lengths(n: int) -> None:
    """Every level survives exactly (a block's absmax is 1 level-unit), the payload is 2 bytes per block of 64 plus
    ceil(3n/8), and a payload one byte short or long is refused before decoding."""
    from protocol.codecs.quant import INT3_LEVELS

    x = (INT3_LEVELS.repeat(-(-n // 8))[:n] * 4.0).roll(1)
    x[0] = 4.0  # every block of 64 starts with its absmax, so the levels are exact
    env = encode(x, "int3")
    assert len(env.data) == 2 * (-(-n // 64)) + (3 * n + 7) // 8
    assert torch.equal(decode(env, peer="p"), x)
    for data in (env.data[:-1], env.data + b"\0"):
        with pytest.raises(ValidationError, match="int3"):
            decode(TensorEnvelope(codec=env.codec, dtype=env.dtype, shape=env.shape, data=data), peer="p")


def test_ecq_codes_cost_their_entropy_and_zeros_stay_zero() -> None:
    """ecq's payload is 2 bytes a block of 64 plus the Huffman-coded steps: about 3.6 bits a Gaussian value (int3
    spends 3 for four times the squared error), fewer where the values are mostly zero; zeros decode to exact zeros."""
    x = torch.randn(32 * 512, generator=torch.Generator().manual_seed(7))
    env = encode(x, "ecq")
    bits = (len(env.data) - 2 * len(x) // 64) * 8 / len(x)
    assert 3.4 < bits < 3.8
    assert rel_error(decode(env), x) ** 2 < 0.3 * rel_error(roundtrip(x, "int3"), x) ** 2  # int3: 4x the squared error
    sparse = torch.where(torch.arange(len(x)) % 16 == 0, x, torch.zeros_like(x))
    env = encode(sparse, "ecq")
    assert len(env.data) < len(encode(x, "ecq").data) / 2
    assert torch.equal(decode(env)[sparse == 0], torch.zeros(int((sparse == 0).sum())))


def test_ecq_refuses_streams_that_are_not_exactly_its_codes() -> None:
    """A deflate stream that is garbage, cut short, inflates to more or fewer codes than the shape says, or has bytes
    after its end is refused before any value reaches the caller; a stream can never inflate past the shape."""
    import zlib

    x = torch.randn(1000, generator=torch.Generator().manual_seed(8))
    env = encode(x, "ecq")
    scales = env.data[: 2 * 16]

    def deflated(raw: bytes) -> bytes:
        packer = zlib.compressobj(9, zlib.DEFLATED, -15)
        return packer.compress(raw) + packer.flush()

    codes = bytes(decode(env).div(1).numel() * [0])
    bad = {
        "garbage": scales + b"\xff" * 40,
        "cut short": env.data[:-3],
        "bytes after the end": env.data + b"\0",
        "too many codes": scales + deflated(codes + b"\0"),
        "too few codes": scales + deflated(codes[:-1]),
        "a bomb": scales + deflated(bytes(10**6))[: 2 * len(codes)],
        "empty": scales,
    }
    assert torch.equal(decode(TensorEnvelope(codec=env.codec, dtype=env.dtype, shape=env.shape,
                                             data=scales + deflated(codes)), peer="p"), torch.zeros(1000))
    for why, data in bad.items():
        with pytest.raises(ValidationError, match="ecq"):
            decode(TensorEnvelope(codec=env.codec, dtype=env.dtype, shape=env.shape, data=data), peer="p")
            pytest.fail(f"{why} was accepted")
    empty = encode(torch.zeros(0), "ecq")
    assert decode(empty, peer="p").shape == (0,)
    with pytest.raises(ValidationError, match="ecq"):  # zlib reads a limit of 0 as none: an empty tensor's is 1
        decode(TensorEnvelope(codec=env.codec, dtype=env.dtype, shape=(0,), data=deflated(bytes(9))), peer="p")


def test_frame_limits_hold_the_longest_ecq_payload() -> None:
    """A receiver's frame limits are computed from envelopes of zeros; an ecq payload's length depends on the values,
    so the limits take its bound (random codes, which deflate cannot shrink, still fit under it)."""
    from protocol.codecs.registry import largest

    n = 4096
    env = encode(torch.zeros(n), "ecq")
    assert largest(env).shape == env.shape and len(largest(env).data) > n
    assert largest(encode(torch.zeros(n), "int3")) == encode(torch.zeros(n), "int3")
    import zlib

    noise = torch.randint(-128, 128, (n,), dtype=torch.int8, generator=torch.Generator().manual_seed(9))
    packer = zlib.compressobj(9, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
    worst = env.data[: 2 * n // 64] + packer.compress(noise.numpy().tobytes()) + packer.flush()
    assert len(env.data) < len(worst) <= len(largest(env).data)
    decode(TensorEnvelope(codec=env.codec, dtype=env.dtype, shape=env.shape, data=worst), peer="p")


@pytest.mark.parametrize("codec", ["int8", "int4", "int3", "ecq"])
@pytest.mark.parametrize("value", [1e-40, 3e-39, 1e-38, 1e-31])
def test_blocks_of_tiny_values_are_sent_as_zeros_not_blown_up_or_refused(codec: str, value: float) -> None:
    """The block codecs divide by a block's scale: below FLUSH_BELOW the reciprocal overflowed (a block of 3e-39
    decoded to 44x its values under ecq; one of 1e-40 got an infinite scale, refused by an honest receiver)."""
    from protocol.codecs.quant import FLUSH_BELOW

    x = torch.zeros(200)
    x[:64], x[70], x[150:] = value, value, torch.randn(50)  # tiny blocks beside an ordinary one
    y = decode(encode(x, codec), TensorSpec((200,), torch.float32))
    assert bool((y[:128] - x[:128]).abs().max() <= FLUSH_BELOW) and bool((y[:128].abs() <= FLUSH_BELOW).all())
    assert float((y[150:] - x[150:]).norm() / x[150:].norm()) < 0.25
