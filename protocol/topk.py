"""TopK sparsification with error feedback, for averaging deltas.

`topk_encode` keeps the k largest-magnitude values of a tensor (k = ceil(fraction * numel)) as sorted int32 indices
plus fp32 values. Dropping the rest would bias an average, so `ErrorFeedback` keeps what each call did not send (the
residual) and adds it to the next tensor sent under the same key: everything is sent eventually, and the sum of what
was sent converges to the sum of what should have been sent (Stich et al., 2018; Karimireddy et al., 2019).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable

import torch

from protocol.envelope import PayloadError, TensorEnvelope

__all__ = ["topk_encode", "topk_decode", "topk_check_length", "ErrorFeedback", "TOPK_MAX_ELEMENTS"]

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


class ErrorFeedback:
    """Residual memory for a lossy codec, one residual per key (e.g. per parameter tensor and partition).

    `encode(key, t)` sends t plus the residual left by earlier calls under `key` and keeps the new residual
    (what the receiver will not see). Use one object per destination stream of deltas; residuals live on the CPU in
    fp32 and cost as much memory as the tensors they shadow.

    Args:
        codec: codec name to compress with, e.g. "topk:0.01" (the usual choice) or "int8".
        encoder: encode function (tensor, codec) -> TensorEnvelope; decoder: envelope -> tensor. Both default to
            protocol.codecs.encode/decode (injected to keep this module free of an import cycle).
    """

    def __init__(self, codec: str, encoder: Callable | None = None, decoder: Callable | None = None) -> None:
        from protocol import codecs  # imported here: codecs imports this module

        codecs.parse_codec(codec)  # ValueError early for unknown names
        self.codec = codec
        self._encode = encoder or codecs.encode
        self._decode = decoder or (lambda env: codecs.decode(env, peer="local"))
        self._residuals: dict[Hashable, torch.Tensor] = {}

    def encode(self, key: Hashable, t: torch.Tensor) -> TensorEnvelope:
        target = t.detach().to(torch.float32)
        residual = self._residuals.get(key)
        if residual is not None:
            if residual.shape != target.shape:
                raise ValueError(f"tensor for key {key!r} changed shape {tuple(residual.shape)} -> {tuple(t.shape)}")
            target = target + residual
        env = self._encode(target, self.codec)
        self._residuals[key] = target - self._decode(env).to(torch.float32)
        return env

    def residual(self, key: Hashable) -> torch.Tensor | None:
        return self._residuals.get(key)

    def reset(self, key: Hashable | None = None) -> None:
        """Forget the residual of `key` (or all of them), e.g. after the partitions were redrawn."""
        if key is None:
            self._residuals.clear()
        else:
            self._residuals.pop(key, None)
