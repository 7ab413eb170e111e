"""Blockwise quantization kernels (8-, 4- and 3-bit absmax, and ecq's RMS grid), pure functions that run on the
tensor's own device.

Every codec here splits the flattened tensor into fixed blocks, stores one scale per block and one small code per
value:
- int8: blocks of 128, codes -127..127 on a uniform grid, scale = block absmax rounded *up* to bfloat16 (so codes
  never clip and the scale keeps fp32's range: tiny gradients and huge activations both survive).
- int4: blocks of 64, 16 levels from `INT4_LEVELS` (Lloyd-Max levels for absmax-normalised Gaussian blocks of 64 with
  -1, 0 and +1 pinned, so a block's maximum and exact zeros are reproduced exactly), two codes per byte.
- int3: blocks of 64, 8 levels from `INT3_LEVELS` (the same construction), eight codes in three bytes: for small
  frames on slow links (subspace coefficients), where the 16-level search table is not worth it.
- ecq: blocks of 64, scale = the block's RMS in bfloat16, a uniform grid of step `ECQ_STEP` x scale, one int8 code
  per value; the registry Huffman-codes the codes (protocol.codecs.registry), so a value costs what its code's
  frequency says: about 3.6 bits on Gaussian values for a relative error of 0.10 (int3: 3 bits, 0.20; int4: 4 bits,
  0.09). No code clips: a value is at most sqrt(64) = 8 RMS of its block, 23 steps.

Everything is vectorised over blocks (no Python loop), so the functions run at memory speed and release the GIL:
callers on an event loop run them in an executor (see registry.encode_async). Quantizing runs where the tensor is
(on a GPU the codes and scales are made there and only they are copied to the host, see registry.encode); the CPU
works through cache-sized slabs, a GPU in one pass. Dequantizing runs on the CPU (received bytes). Block sizes and the
level table are part of the wire format; changing them needs a new codec id.
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "INT8_BLOCK",
    "INT4_BLOCK",
    "INT4_LEVELS",
    "quantize_int8",
    "dequantize_int8",
    "quantize_int4",
    "dequantize_int4",
    "int8_payload_bytes",
    "int4_payload_bytes",
    "INT3_BLOCK",
    "INT3_LEVELS",
    "quantize_int3",
    "dequantize_int3",
    "int3_payload_bytes",
    "ECQ_BLOCK",
    "ECQ_STEP",
    "ecq_scale_bytes",
    "quantize_ecq",
    "dequantize_ecq",
]

INT8_BLOCK = 128
INT4_BLOCK = 64
# fmt: off
INT4_LEVELS = torch.tensor([
    -1.0, -0.7643, -0.5908, -0.4489, -0.3249, -0.2116, -0.1043, 0.0,
    0.0908, 0.1835, 0.2804, 0.3838, 0.4979, 0.6288, 0.7881, 1.0,
], dtype=torch.float32)
INT3_BLOCK = 64
INT3_LEVELS = torch.tensor([-1.0, -0.5414, -0.2487, 0.0, 0.1844, 0.3854, 0.6304, 1.0], dtype=torch.float32)
# fmt: on
ECQ_BLOCK = 64
ECQ_STEP = 0.35
"""ecq's grid step in units of its block's RMS: the uniform quantiser's error is STEP / sqrt(12) = 0.10 of the RMS,
and its codes' entropy on Gaussian values log2(sqrt(2 pi e) / STEP) = 3.56 bits."""
_INT3_BORDERS = (INT3_LEVELS[1:] + INT3_LEVELS[:-1]) / 2
_INT3_ZERO = 3  # the code of 0.0: what padding codes are
_INT4_BORDERS = (INT4_LEVELS[1:] + INT4_LEVELS[:-1]) / 2
_SLAB_ROWS = 2048  # rows per slab in the int8 kernels: 1 MiB of fp32, stays in L2
# Nearest-level search without torch.bucketize (2-3x slower): a fine grid over [-1, 1] whose cells hold at most one
# border gives the code of a cell's lower edge; one comparison with the next border finishes the job. Exactly
# bucketize(v, _INT4_BORDERS) (tests/test_protocol_codecs.py checks it).
_GRID = 4096
_GRID_CODES = torch.searchsorted(_INT4_BORDERS, torch.linspace(-1, 1, _GRID + 1)[:-1]).to(torch.uint8)
_NEXT_BORDER = torch.cat([_INT4_BORDERS, torch.tensor([float("inf")])])
assert float((_INT4_BORDERS[1:] - _INT4_BORDERS[:-1]).min()) > 2 / _GRID


@functools.lru_cache(maxsize=8)
def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 search tables on ``device`` (copied there once)."""
    return _GRID_CODES.to(device), _NEXT_BORDER.to(device)


def _slab_rows(x: torch.Tensor, cpu_rows: int) -> int:
    """Rows per pass: cache-sized slabs on the CPU; one pass elsewhere (a GPU gains nothing from slabs)."""
    return cpu_rows if x.device.type == "cpu" else max(1, x.shape[0])


def int4_codes(normalised: torch.Tensor) -> torch.Tensor:
    """Index of the nearest INT4_LEVELS entry for values in [-1, 1] (uint8), as torch.bucketize would give."""
    grid_codes, next_border = _tables(normalised.device)
    cell = (normalised + 1).mul_(_GRID / 2).floor_().clamp_(0, _GRID - 1).long()
    codes = grid_codes[cell]
    return codes.add_(normalised > next_border[codes.long()])


def _n_blocks(n: int, block: int) -> int:
    return -(-n // block)


def int8_payload_bytes(n: int) -> int:
    """Payload size of `n` values under the int8 codec: bf16 scales, then one byte per value."""
    return 2 * _n_blocks(n, INT8_BLOCK) + n


def int4_payload_bytes(n: int) -> int:
    """Payload size of `n` values under the int4 codec: bf16 scales, then two values per byte."""
    return 2 * _n_blocks(n, INT4_BLOCK) + (n + 1) // 2


def int3_payload_bytes(n: int) -> int:
    """Payload size of `n` values under the int3 codec: bf16 scales, then eight values per three bytes."""
    return 2 * _n_blocks(n, INT3_BLOCK) + (3 * n + 7) // 8


def ecq_scale_bytes(n: int) -> int:
    """Bytes of the bf16 scales that open an ecq payload of `n` values (its Huffman-coded codes follow)."""
    return 2 * _n_blocks(n, ECQ_BLOCK)


def _blocks(flat: torch.Tensor, block: int) -> torch.Tensor:
    pad = _n_blocks(flat.numel(), block) * block - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, block)


#: a block whose largest |value| is below this is sent as zeros: the codecs divide by a block's scale (or a step
#: of it), and the reciprocal of a float32 below ~3e-39 overflows, which turned a block of such values into codes
#: of 44x their size, or into an infinite scale an honest receiver refuses
FLUSH_BELOW = 1e-30


def _scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block absmax rounded up to bfloat16 (0 below ``FLUSH_BELOW``): (bf16 scales for the wire, the same
    values as fp32)."""
    absmax = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_())
    absmax = absmax.masked_fill(absmax < FLUSH_BELOW, 0.0)
    bits = absmax.view(torch.int32)
    bits = (bits + 0xFFFF) & ~0xFFFF  # ceil to the next bfloat16 (absmax >= 0, so this rounds the magnitude up)
    scales = (bits >> 16).to(torch.int16).view(torch.bfloat16)
    as_float = scales.float()
    if not bool(torch.isfinite(as_float).all()):
        raise ValueError("cannot quantize a tensor with NaN or infinite values (or beyond 3e38); fix the source")
    return scales, as_float


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float tensor: returns (bf16 scales [n_blocks], int8 codes [numel])."""
    flat = x.detach().reshape(-1).to(torch.float32)
    n = flat.numel()
    blocks = _blocks(flat, INT8_BLOCK)
    scales, s = _scales(blocks)
    inv = torch.where(s > 0, 127.0 / s, torch.zeros_like(s))[:, None]
    codes = torch.empty(blocks.shape, dtype=torch.int8, device=flat.device)
    # slabs that fit in cache: one pass over memory instead of three (measured 2-3x faster on one core)
    slab = _slab_rows(blocks, _SLAB_ROWS)
    tmp = torch.empty(min(slab, blocks.shape[0]), INT8_BLOCK, device=flat.device)
    for start in range(0, blocks.shape[0], slab):
        rows = blocks[start : start + slab]
        scaled = tmp[: rows.shape[0]]
        torch.mul(rows, inv[start : start + slab], out=scaled)
        codes[start : start + slab].copy_(scaled.round_())
    return scales, codes.view(-1)[:n]


def dequantize_int8(scales: torch.Tensor, codes: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of quantize_int8: fp32 tensor of `n` values (flat)."""
    step = (scales.float() / 127.0)[:, None]
    blocks = _blocks(codes, INT8_BLOCK)
    out = torch.empty(blocks.shape, dtype=torch.float32)
    for start in range(0, blocks.shape[0], _SLAB_ROWS):
        rows = out[start : start + _SLAB_ROWS]
        rows.copy_(blocks[start : start + _SLAB_ROWS]).mul_(step[start : start + _SLAB_ROWS])
    return out.view(-1)[:n]


def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float tensor: returns (bf16 scales [n_blocks], uint8 packed codes [ceil(numel / 2)])."""
    flat = x.detach().reshape(-1).to(torch.float32)
    n = flat.numel()
    blocks = _blocks(flat, INT4_BLOCK)
    scales, s = _scales(blocks)
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))[:, None]
    packed = torch.empty(blocks.numel() // 2, dtype=torch.uint8, device=flat.device)
    rows_per_slab = _slab_rows(blocks, _SLAB_ROWS * INT8_BLOCK // INT4_BLOCK)
    tmp = torch.empty(min(rows_per_slab, blocks.shape[0]), INT4_BLOCK, device=flat.device)
    for start in range(0, blocks.shape[0], rows_per_slab):
        rows = blocks[start : start + rows_per_slab]
        normalised = torch.mul(rows, inv[start : start + rows_per_slab], out=tmp[: rows.shape[0]])
        pairs = int4_codes(normalised).view(-1, 2)
        half = start * INT4_BLOCK // 2
        torch.bitwise_or(pairs[:, 0], pairs[:, 1] << 4, out=packed[half : half + pairs.shape[0]])
    if n % 2:  # the padding value after the last real code decodes to 0.0 but is not part of the payload
        packed[n // 2] = (packed[n // 2] & 15) | (7 << 4)
    return scales, packed[: (n + 1) // 2]


def dequantize_int4(scales: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of quantize_int4: fp32 tensor of `n` values (flat)."""
    codes = torch.stack((packed & 15, packed >> 4), dim=1).view(-1)[:n]
    values = INT4_LEVELS[codes.long()]
    blocks = _blocks(values, INT4_BLOCK)
    out = blocks.mul_(scales.float()[:, None])
    return out.view(-1)[:n]


def quantize_int3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float tensor: returns (bf16 scales [n_blocks], uint8 packed codes [ceil(3 numel / 8)]).

    Codes are packed little-endian, eight to a 24-bit group (code i of a group in bits 3i..3i+2); the codes past
    the last value are those of 0.0, and the bytes that hold only such codes are not sent."""
    flat = x.detach().reshape(-1).to(torch.float32)
    n = flat.numel()
    blocks = _blocks(flat, INT3_BLOCK)
    scales, s = _scales(blocks)
    normalised = blocks * torch.where(s > 0, 1.0 / s, torch.zeros_like(s))[:, None]
    codes = torch.bucketize(normalised.view(-1)[:n], _INT3_BORDERS.to(flat.device)).to(torch.int32)
    groups = torch.nn.functional.pad(codes, (0, -n % 8), value=_INT3_ZERO).view(-1, 8)
    words = (groups << torch.arange(0, 24, 3, dtype=torch.int32, device=flat.device)).sum(dim=1, dtype=torch.int32)
    packed = torch.stack([(words >> shift) & 255 for shift in (0, 8, 16)], dim=1).to(torch.uint8)
    return scales, packed.view(-1)[: (3 * n + 7) // 8]


def dequantize_int3(scales: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of quantize_int3: fp32 tensor of `n` values (flat)."""
    raw = torch.nn.functional.pad(packed.to(torch.int32), (0, -packed.numel() % 3)).view(-1, 3)
    words = raw[:, 0] | (raw[:, 1] << 8) | (raw[:, 2] << 16)
    codes = (words[:, None] >> torch.arange(0, 24, 3, dtype=torch.int32)) & 7
    values = INT3_LEVELS[codes.view(-1)[:n].long()]
    return _blocks(values, INT3_BLOCK).mul_(scales.float()[:, None]).view(-1)[:n]


def quantize_ecq(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float tensor on its device: returns (bf16 scales [n_blocks], int8 codes [numel]); the registry
    entropy-codes the codes."""
    flat = x.detach().reshape(-1).to(torch.float32)
    n = flat.numel()
    blocks = _blocks(flat, ECQ_BLOCK)
    _, absmax = _scales(blocks)  # refuses non-finite values; the RMS is taken of values scaled by it (no overflow)
    unit = torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))[:, None]
    rms = (blocks * unit).square_().mean(dim=1).sqrt_().mul_(absmax)
    scales = rms.to(torch.bfloat16)
    step = scales.float() * ECQ_STEP
    inv = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))[:, None]
    codes = (blocks * inv).round_().clamp_(-127, 127).to(torch.int8)
    return scales, codes.view(-1)[:n]


def dequantize_ecq(scales: torch.Tensor, codes: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of quantize_ecq: fp32 tensor of `n` values (flat)."""
    step = (scales.float() * ECQ_STEP)[:, None]
    return _blocks(codes.to(torch.float32), ECQ_BLOCK).mul_(step).view(-1)[:n]
