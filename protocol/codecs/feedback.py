"""Error feedback for lossy codecs: what a call did not send is added to the next tensor sent under the same key.

Dropping values (TopK) or rounding them (int8) would bias an average that is sent again and again; keeping the residual
means everything is sent eventually, and the sum of what was sent converges to the sum of what should have been sent
(Stich et al., 2018; Karimireddy et al., 2019).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from protocol.envelope import TensorEnvelope

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Residual memory for a lossy codec, one residual per key (e.g. per parameter tensor and partition).

    `encode(key, t)` sends t plus the residual left by earlier calls under `key` and keeps the new residual
    (what the receiver will not see). Use one object per destination stream of deltas; residuals live on the CPU in
    fp32 and cost as much memory as the tensors they shadow.

    Args:
        codec: codec name to compress with, e.g. "topk:0.01" (the usual choice) or "int8".
        encoder: encode function (tensor, codec) -> TensorEnvelope; decoder: envelope -> tensor. Both default to
            protocol.codecs.registry.encode/decode (injected to keep this module free of an import cycle).
    """

    def __init__(self, codec: str, encoder: Callable[..., Any] | None = None,
                 decoder: Callable[..., Any] | None = None) -> None:
        from protocol.codecs import registry as codecs  # imported here: codecs imports this module

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
