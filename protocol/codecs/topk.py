"""TopK sparsification kernels, for averaging deltas.

`topk_encode` keeps the k largest-magnitude values of a tensor (k = ceil(fraction * numel)) as sorted int32 indices
plus fp32 values. Dropping the rest would bias an average;
``protocol.codecs.feedback.ErrorFeedback`` keeps what was not sent.
"""

from __future__ import annotations

import math

import torch

from protocol.envelope import PayloadError

__all__ = ["topk_encode", "topk_decode", "topk_check_length", "TOPK_MAX_ELEMENTS"]

#: topk indices are int32 on the wire
TOPK_MAX_ELEMENTS = 2**31 - 1


def topk_encode(x: torch.Tensor, fraction: float) -> bytes:
    """Payload: k int32 indices in ascending order, then their k fp32 values."""
    flat = x.detach().reshape(-1).to(torch.float32)
    n = flat.numel()
    if n > TOPK_MAX_ELEMENTS:
        raise ValueError(f"topk carries at most {TOPK_MAX_ELEMENTS} elements, got {n}; split the tensor")
    k = min(n, math.ceil(fraction * n))
    if k == 0:
        return b""
    idx = torch.topk(flat.abs(), k, sorted=False).indices.sort().values
    return idx.to(torch.int32).numpy().tobytes() + flat[idx].numpy().tobytes()


def topk_check_length(n_bytes: int, numel: int) -> str | None:
    """Why a topk payload of `n_bytes` cannot describe `numel` values, or None if it can."""
    if n_bytes % 8:
        return f"topk payload of {n_bytes} bytes is not a whole number of (int32 index, fp32 value) pairs"
    if n_bytes // 8 > numel:
        return f"topk payload holds {n_bytes // 8} values for a tensor of {numel} elements"
    return None


def topk_decode(data: bytes, numel: int) -> torch.Tensor:
    """Dense fp32 tensor of `numel` values, zero except at the sent indices."""
    out = torch.zeros(numel, dtype=torch.float32)
    k = len(data) // 8
    if k == 0:
        return out
    idx = torch.frombuffer(data, dtype=torch.int32, count=k).long()
    if int(idx[0]) < 0 or int(idx[-1]) >= numel:
        raise PayloadError(f"topk index out of range [0, {numel})")
    if k > 1 and not bool((idx[1:] > idx[:-1]).all()):
        raise PayloadError("topk indices must be strictly increasing (sorted, no duplicates)")
    out[idx] = torch.frombuffer(data, dtype=torch.float32, count=k, offset=4 * k)
    return out
