"""Tensor codecs: a registry keyed by the codec id that every `TensorEnvelope` carries.

Names and ids come from the one table, protocol.codecs.names; this module attaches each row's kernels.

| name  | id | payload                                              | for                                   |
|-------|----|------------------------------------------------------|---------------------------------------|
| none  | 0  | raw little-endian bytes of the tensor's own dtype    | token ids, exact transfers            |
| fp16  | 1  | float16, clamped to +-65504 (as hivemind's Float16)  | reference                             |
| bf16  | 2  | bfloat16                                             | reference                             |
| int8  | 3  | blockwise absmax, 128 values/block (protocol.codecs.quant)  | activations, gradients, averaging     |
| int4  | 4  | blockwise absmax, 64 values/block, 16 Lloyd levels   | activations on slow links             |
| topk  | 5  | k sorted int32 indices + k fp32 values (protocol.codecs.topk)| averaging deltas, with feedback.py  |
| int8q | 6  | hivemind Quantile8BitQuantization: 256 levels + u8 | per-tensor quantile 8-bit (reference) |
| int3  | 7  | blockwise absmax, 64 values/block, 8 Lloyd levels    | subspace coefficients on slow links   |
| ecq   | 8  | bf16 RMS per 64 values, then Huffman-coded int8 steps| subspace coefficients on slow links   |

Quantizing codecs accept floating-point tensors only and decode back to the sender's dtype. The float codecs (fp16,
bf16, int8, int4, int3) have a *kernel* that runs on the tensor's own device: a GPU tensor is encoded on the GPU and
only the encoded tensors (codes and scales) are copied to the host, through pinned buffers (``to_host``). A CPU
tensor takes the same path without the copy, so its payload is the same bytes. ecq's codes are made on
the tensor's device too, and Huffman-coded on the CPU (raw deflate, Huffman only: zlib). `decode` validates
everything before and after decoding (see protocol.validation) and raises `ValidationError` naming field and peer.
(De)quantization of large tensors is CPU work that releases the GIL: on an event loop use `encode_async` /
`decode_async`, which run it in an executor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import re
import warnings
import zlib
from collections.abc import Callable
from concurrent.futures import Executor

import torch

from protocol.codecs import quant, topk
from protocol.codecs.names import CODEC_NAMES, CODEC_TABLE
from protocol.envelope import FLOAT_DTYPES, PayloadError, TensorEnvelope, dtype_name
from protocol.errors import ValidationError
from protocol.validation import DEFAULT_MAX_ELEMENTS, TensorSpec, check_header, check_values

__all__ = [
    "to_host",
    "Codec",
    "CODECS",
    "CODEC_IDS",
    "TensorEnvelope",
    "encode",
    "decode",
    "largest",
    "roundtrip",
    "encode_async",
    "decode_async",
    "parse_codec",
]

#: tensors smaller than this are (de)coded inline by the async helpers: a thread hop costs more than the work
INLINE_BYTES = 256 * 1024
# We only ever read from tensors made over received bytes (decoders allocate fresh outputs), so torch's warning
# about non-writable buffers is noise here.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


@dataclasses.dataclass(frozen=True)
class Codec:
    """One wire codec: how to turn a tensor into a payload and back, and how long a valid payload is."""

    name: str
    id: int
    floats_only: bool
    encode: Callable[[torch.Tensor], bytes]
    #: (payload bytes, numel, dtype) -> reason the length is wrong, or None
    check_length: Callable[[int, int, torch.dtype], str | None]
    #: (payload, numel, dtype) -> flat tensor (any float dtype for lossy codecs, exactly `dtype` for none)
    decode: Callable[[bytes, int, torch.dtype], torch.Tensor]
    #: tensor -> the encoded tensors whose bytes, in order, are the payload (ecq's: what it Huffman-codes); run on the
    #: tensor's device (None: the codec runs on the CPU only, ``encode`` after a copy of the whole tensor)
    kernel: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] | None = None
    #: numel -> the most payload bytes a valid payload of that many values has, for codecs whose length depends on
    #: the values (ecq); None: every payload of a shape has one length
    max_length: Callable[[int], int] | None = None


def _raw(*tensors: torch.Tensor) -> bytes:
    """The tensors' bytes, concatenated with a single copy."""
    return b"".join(t.contiguous().reshape(-1).view(torch.uint8).numpy().data for t in tensors)


def _exact_length(bytes_per_value: Callable[[int, torch.dtype], int]) -> Callable[[int, int, torch.dtype], str | None]:
    def check(n_bytes: int, numel: int, dtype: torch.dtype) -> str | None:
        expected = bytes_per_value(numel, dtype)
        return None if n_bytes == expected else f"payload is {n_bytes} bytes, expected {expected}"

    return check


def _frombuffer(data: bytes, dtype: torch.dtype, count: int, offset: int = 0) -> torch.Tensor:
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype, count=count, offset=offset)


def _none_decode(data: bytes, n: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        raw = _frombuffer(data, torch.uint8, n)
        if n and int(raw.max()) > 1:
            raise PayloadError("bool tensor bytes must be 0 or 1")
        return raw.to(torch.bool)
    return _frombuffer(data, dtype, n).clone()


def _int8_decode(data: bytes, n: int, dtype: torch.dtype) -> torch.Tensor:
    n_scales = (len(data) - n) // 2
    scales = _frombuffer(data, torch.bfloat16, n_scales)
    return quant.dequantize_int8(scales, _frombuffer(data, torch.int8, n, 2 * n_scales), n)


def _int4_decode(data: bytes, n: int, dtype: torch.dtype) -> torch.Tensor:
    n_scales = len(data) - (n + 1) // 2
    n_scales //= 2
    scales = _frombuffer(data, torch.bfloat16, n_scales)
    return quant.dequantize_int4(scales, _frombuffer(data, torch.uint8, (n + 1) // 2, 2 * n_scales), n)


def _int3_decode(data: bytes, n: int, dtype: torch.dtype) -> torch.Tensor:
    n_scales = (len(data) - (3 * n + 7) // 8) // 2
    scales = _frombuffer(data, torch.bfloat16, n_scales)
    return quant.dequantize_int3(scales, _frombuffer(data, torch.uint8, (3 * n + 7) // 8, 2 * n_scales), n)


def _ecq_encode(t: torch.Tensor) -> bytes:
    scales, codes = to_host(quant.quantize_ecq(t))
    packer = zlib.compressobj(9, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
    return _raw(scales) + packer.compress(_raw(codes)) + packer.flush()


def _deflate_bound(n: int) -> int:
    """The most bytes raw deflate makes of `n` bytes (zlib's compressBound less its 6-byte wrapper, plus slack)."""
    return n + (n >> 12) + (n >> 14) + (n >> 25) + 13


def _ecq_max_length(n: int) -> int:
    return quant.ecq_scale_bytes(n) + _deflate_bound(n)


def _ecq_check_length(n_bytes: int, n: int, dtype: torch.dtype) -> str | None:
    if quant.ecq_scale_bytes(n) + 2 <= n_bytes <= _ecq_max_length(n):
        return None
    return (f"payload is {n_bytes} bytes; {n} values need {quant.ecq_scale_bytes(n)} bytes of scales and 2 to "
            f"{_deflate_bound(n)} of coded steps")


def _ecq_decode(data: bytes, n: int, dtype: torch.dtype) -> torch.Tensor:
    n_scales = quant.ecq_scale_bytes(n) // 2
    unpacker = zlib.decompressobj(-15)
    try:  # at most n bytes come out (one for n = 0, where zlib reads 0 as "no limit"), whatever the stream says
        codes = unpacker.decompress(memoryview(data)[2 * n_scales :], max(n, 1))
        extra = unpacker.decompress(unpacker.unconsumed_tail, 1) if not unpacker.eof else b""
    except zlib.error as e:
        raise PayloadError(f"the coded steps are not a deflate stream ({e})") from None
    if len(codes) != n or extra or not unpacker.eof or unpacker.unused_data:
        raise PayloadError(f"the coded steps must inflate to exactly {n} bytes and end there")
    scales = _frombuffer(data, torch.bfloat16, n_scales)
    return quant.dequantize_ecq(scales, _frombuffer(codes, torch.int8, n), n)


def _fp16_kernel(t: torch.Tensor) -> tuple[torch.Tensor]:
    fmax = torch.finfo(torch.float16).max
    return (t.to(torch.float32).clamp_(-fmax, fmax).to(torch.float16),)


def _bf16_kernel(t: torch.Tensor) -> tuple[torch.Tensor]:
    return (t.to(torch.bfloat16),)


def to_host(parts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The encoded tensors on the host: as they are on the CPU; from a CUDA device through pinned buffers (page-locked
    memory the copy engine writes directly, recycled by torch's caching host allocator)."""
    if all(p.device.type == "cpu" for p in parts):
        return parts
    if all(p.device.type == "cuda" for p in parts):
        host = tuple(torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in parts)
        for h, p in zip(host, parts, strict=True):
            h.copy_(p, non_blocking=True)
        torch.cuda.current_stream(parts[0].device).synchronize()  # the bytes are read right after
        return host
    return tuple(p.cpu() for p in parts)


def _kernel_encode(kernel: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]) -> Callable[[torch.Tensor], bytes]:
    def encode_on_device(t: torch.Tensor) -> bytes:
        return _raw(*to_host(kernel(t)))

    return encode_on_device


_Q8_CODEBOOK = 256  # hivemind's Quantile8BitQuantization: int64 codebook size, 256 fp32 levels, uint8 codes


def _q8_encode(t: torch.Tensor) -> bytes:
    from hivemind.compression import CompressionInfo, Quantile8BitQuantization

    t32 = t.to(torch.float32).contiguous()
    if t32.numel() == 0:  # hivemind's quantile estimate fails on empty arrays
        return _Q8_CODEBOOK.to_bytes(8, "little") + bytes(4 * _Q8_CODEBOOK)
    return bytes(Quantile8BitQuantization().compress(t32, CompressionInfo.from_tensor(t32)).buffer)


def _q8_decode(data: bytes, n: int, dtype: torch.dtype) -> torch.Tensor:
    # hivemind 1.1.12's Quantile8BitQuantization.extract fails under numpy 2 (int() of a 1-element array), and it
    # trusts the codebook size in the buffer; this is the same lookup with the layout checked first.
    if int.from_bytes(data[:8], "little", signed=True) != _Q8_CODEBOOK:
        raise PayloadError(f"quantile codebook must have {_Q8_CODEBOOK} entries")
    codebook = _frombuffer(data, torch.float32, _Q8_CODEBOOK, 8)
    return codebook[_frombuffer(data, torch.uint8, n, 8 + 4 * _Q8_CODEBOOK).long()]


_Device = Callable[[torch.Tensor], tuple[torch.Tensor, ...]] | None
_Kernels = tuple[bool, Callable[[torch.Tensor], bytes], Callable[[int, int, torch.dtype], str | None],
                 Callable[[bytes, int, torch.dtype], torch.Tensor], _Device]
_KERNELS: dict[str, _Kernels] = {  # name -> (floats only, encode, length check, decode, device kernel); names.py
    "none": (False, _raw, _exact_length(lambda n, d: n * d.itemsize), _none_decode, None),
    "fp16": (True, _kernel_encode(_fp16_kernel), _exact_length(lambda n, d: 2 * n),
             lambda data, n, d: _frombuffer(data, torch.float16, n), _fp16_kernel),
    "bf16": (True, _kernel_encode(_bf16_kernel), _exact_length(lambda n, d: 2 * n),
             lambda data, n, d: _frombuffer(data, torch.bfloat16, n), _bf16_kernel),
    "int8": (True, _kernel_encode(quant.quantize_int8), _exact_length(lambda n, d: quant.int8_payload_bytes(n)),
             _int8_decode, quant.quantize_int8),
    "int4": (True, _kernel_encode(quant.quantize_int4), _exact_length(lambda n, d: quant.int4_payload_bytes(n)),
             _int4_decode, quant.quantize_int4),
    "int3": (True, _kernel_encode(quant.quantize_int3), _exact_length(lambda n, d: quant.int3_payload_bytes(n)),
             _int3_decode, quant.quantize_int3),
    "ecq": (True, _ecq_encode, _ecq_check_length, _ecq_decode, quant.quantize_ecq),
    "topk": (True, functools.partial(topk.topk_encode, fraction=0.01),
             lambda nb, n, d: topk.topk_check_length(nb, n), lambda data, n, d: topk.topk_decode(data, n), None),
    "int8q": (True, _q8_encode, _exact_length(lambda n, d: 8 + 4 * _Q8_CODEBOOK + n), _q8_decode, None),
}  # fmt: skip
if set(_KERNELS) != set(CODEC_NAMES):
    raise ImportError(f"codec table and kernels differ: {sorted(set(_KERNELS) ^ set(CODEC_NAMES))}")
_MAX_LENGTH: dict[str, Callable[[int], int]] = {"ecq": _ecq_max_length}  # the variable-length codecs' bounds
_REGISTRY = tuple(Codec(row.name, row.id, *_KERNELS[row.name], max_length=_MAX_LENGTH.get(row.name))
                  for row in CODEC_TABLE)
CODECS: dict[str, Codec] = {c.name: c for c in _REGISTRY}
CODEC_IDS: dict[int, Codec] = {c.id: c for c in _REGISTRY}
_TOPK_NAME = re.compile(r"^topk(?::|\()([0-9.eE+-]+)\)?$")


@functools.lru_cache(maxsize=64)
def parse_codec(name: str) -> Codec:
    """Codec for a name: one of CODECS, or "topk:F" / "topk(F)" with the kept fraction F in (0, 1]."""
    if not isinstance(name, str):
        raise TypeError(f"codec name must be a string, got {type(name).__name__}")
    if name in CODECS:
        return CODECS[name]
    match = _TOPK_NAME.match(name)
    if match:
        try:
            fraction = float(match.group(1))
        except ValueError:
            fraction = math.nan
        if not 0 < fraction <= 1:
            raise ValueError(f"topk fraction must be in (0, 1], got {match.group(1)!r} in codec {name!r}")
        return dataclasses.replace(CODECS["topk"], encode=functools.partial(topk.topk_encode, fraction=fraction))
    raise ValueError(f"unknown codec {name!r}; use one of {sorted(CODECS)} or 'topk:FRACTION'")


def encode(t: torch.Tensor, codec: str) -> TensorEnvelope:
    """Encode a tensor of any device with the named codec: on its device when the codec has a kernel (only the
    encoded tensors cross to the host), else after a copy to the CPU."""
    spec = parse_codec(codec)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"encode expects a torch.Tensor, got {type(t).__name__}")
    t = t.detach()
    name = dtype_name(t.dtype)
    if spec.floats_only and t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"codec {codec!r} quantizes floating-point tensors only, got {t.dtype}; use 'none'")
    data = spec.encode(t) if spec.kernel is not None else spec.encode(t.cpu())
    return TensorEnvelope(codec=spec.id, dtype=name, shape=tuple(t.shape), data=data)


def decode(
    env: TensorEnvelope,
    spec: TensorSpec | None = None,
    *,
    peer: str = "?",
    field: str = "tensor",
    max_elements: int = DEFAULT_MAX_ELEMENTS,
) -> torch.Tensor:
    """Decode and validate an envelope received from `peer`; raises ValidationError naming `field` and `peer`.

    Checks run before any allocation proportional to the tensor: dtype and shape against `spec`, element count
    against `max_elements` (unless the spec fixes every dimension), codec id, payload length. After decoding:
    finite values and the spec's max_abs / max_norm bounds.
    """
    dtype = check_header(env, spec, peer=peer, field=field, max_elements=max_elements)
    codec = CODEC_IDS.get(env.codec) if type(env.codec) is int else None
    if codec is None:
        raise ValidationError(f"{field}.codec", peer, f"unknown codec id {env.codec!r}; known: {sorted(CODEC_IDS)}")
    if codec.floats_only and dtype not in FLOAT_DTYPES:
        raise ValidationError(f"{field}.codec", peer, f"codec {codec.name} cannot carry {env.dtype} tensors")
    if not isinstance(env.data, bytes):
        raise ValidationError(f"{field}.data", peer, f"payload must be bytes, got {type(env.data).__name__}")
    numel = math.prod(env.shape)
    reason = codec.check_length(len(env.data), numel, dtype)
    if reason is not None:
        raise ValidationError(f"{field}.data", peer, f"{codec.name}: {reason}")
    try:
        flat = codec.decode(env.data, numel, dtype)
    except PayloadError as e:
        raise ValidationError(f"{field}.data", peer, f"{codec.name}: {e}") from None
    return check_values(flat.to(dtype).reshape(env.shape), spec, peer=peer, field=field)


def largest(env: TensorEnvelope) -> TensorEnvelope:
    """The envelope of ``env``'s codec, dtype and shape with the longest payload it may have (sizes of frames that a
    receiver must accept: the same envelope for fixed-length codecs, zero bytes up to the bound for ecq)."""
    max_length = CODEC_IDS[env.codec].max_length
    if max_length is None:
        return env
    return dataclasses.replace(env, data=bytes(max_length(math.prod(env.shape))))


def roundtrip(t: torch.Tensor, codec: str) -> torch.Tensor:
    """What the receiver gets when `t` is sent with `codec`: same shape, dtype and device, with the codec's error."""
    return decode(encode(t, codec), peer="local").to(t.device)


async def encode_async(t: torch.Tensor, codec: str, *, executor: Executor | None = None) -> TensorEnvelope:
    """encode() off the event loop (inline for tensors under INLINE_BYTES)."""
    if t.numel() * t.element_size() < INLINE_BYTES:
        return encode(t, codec)
    return await asyncio.get_running_loop().run_in_executor(executor, encode, t, codec)


async def decode_async(
    env: TensorEnvelope,
    spec: TensorSpec | None = None,
    *,
    peer: str = "?",
    field: str = "tensor",
    executor: Executor | None = None,
) -> torch.Tensor:
    """decode() off the event loop (inline for payloads under INLINE_BYTES)."""
    call = functools.partial(decode, env, spec, peer=peer, field=field)
    if isinstance(env, TensorEnvelope) and isinstance(env.data, bytes) and len(env.data) < INLINE_BYTES:
        return call()
    return await asyncio.get_running_loop().run_in_executor(executor, call)

