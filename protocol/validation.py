"""Validation of received tensors against the spec the receiver expects.

A decoded tensor reaches the model only if it has exactly the shape and dtype its message implies, finite values,
and (optionally) bounded magnitude. The cheap structural checks (`check_header`) run on the envelope *before* any
decoding allocates memory; `check_values` runs on the decoded tensor. Every failure is a `ValidationError` that names
the field and the peer.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from protocol.envelope import FLOAT_DTYPES, MAX_NDIM, WIRE_DTYPES, TensorEnvelope, dtype_name
from protocol.errors import ValidationError

__all__ = ["TensorSpec", "check_header", "check_values", "DEFAULT_MAX_ELEMENTS"]

#: decoded tensors larger than this many elements are refused when no spec fixes their shape (2**26 fp32 = 256 MiB)
DEFAULT_MAX_ELEMENTS = 2**26


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What a received tensor must look like.

    shape: exact shape; a dimension of -1 accepts any size there (the total is still bounded by `max_elements`).
    dtype: exact torch dtype the decoded tensor must have.
    max_abs: if set, every |value| must be <= max_abs (catches exploding activations before they hit the model).
    max_norm: if set, the L2 norm of the whole tensor must be <= max_norm (bounds what one peer can add to an average).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    max_abs: float | None = None
    max_norm: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        if len(self.shape) > MAX_NDIM or not all(isinstance(d, int) and d >= -1 for d in self.shape):
            raise ValueError(f"TensorSpec.shape must be at most {MAX_NDIM} ints >= -1, got {self.shape}")
        dtype_name(self.dtype)  # raises ValueError for dtypes the wire cannot carry
        for name in ("max_abs", "max_norm"):
            bound = getattr(self, name)
            if bound is not None and not (isinstance(bound, int | float) and bound >= 0 and math.isfinite(bound)):
                raise ValueError(f"TensorSpec.{name} must be a finite number >= 0 or None, got {bound!r}")
        if (self.max_abs is not None or self.max_norm is not None) and self.dtype not in FLOAT_DTYPES:
            raise ValueError("TensorSpec.max_abs/max_norm apply to floating-point dtypes only")


def check_header(
    env: TensorEnvelope, spec: TensorSpec | None, *, peer: str, field: str, max_elements: int = DEFAULT_MAX_ELEMENTS
) -> torch.dtype:
    """Check dtype and shape of an envelope before decoding it; returns the torch dtype it decodes to."""
    if not isinstance(env, TensorEnvelope):
        raise ValidationError(field, peer, f"expected a tensor envelope, got {type(env).__name__}")
    dtype = WIRE_DTYPES.get(env.dtype) if isinstance(env.dtype, str) else None
    if dtype is None:
        raise ValidationError(f"{field}.dtype", peer, f"unknown dtype {env.dtype!r}; known: {sorted(WIRE_DTYPES)}")
    shape = env.shape
    if not isinstance(shape, tuple) or len(shape) > MAX_NDIM:
        raise ValidationError(f"{field}.shape", peer, f"expected a tuple of at most {MAX_NDIM} dims, got {shape!r}")
    if not all(type(d) is int and 0 <= d < 2**40 for d in shape):
        raise ValidationError(f"{field}.shape", peer, f"dimensions must be non-negative ints, got {shape!r}")
    numel = math.prod(shape)
    limit = max_elements
    if spec is not None:
        if dtype != spec.dtype:
            raise ValidationError(f"{field}.dtype", peer, f"expected {dtype_name(spec.dtype)}, got {env.dtype}")
        if len(shape) != len(spec.shape) or any(w not in (-1, d) for w, d in zip(spec.shape, shape, strict=True)):
            raise ValidationError(f"{field}.shape", peer, f"expected {spec.shape}, got {shape}")
        if -1 not in spec.shape:
            limit = max(limit, numel)  # an exact spec is its own bound
    if numel > limit:
        raise ValidationError(f"{field}.shape", peer, f"{numel} elements exceed the limit of {limit}")
    return dtype


def check_values(t: torch.Tensor, spec: TensorSpec | None, *, peer: str, field: str) -> torch.Tensor:
    """Check a decoded tensor's values: finite floats, and the spec's max_abs/max_norm bounds."""
    if t.dtype in FLOAT_DTYPES and t.numel() > 0:
        # two reductions instead of an isfinite() mask: NaN propagates through amax/amin, and no tensor-sized
        # temporary is allocated (this runs on every received activation)
        hi, lo = float(t.amax()), float(t.amin())
        if not (math.isfinite(hi) and math.isfinite(lo)):
            n_bad = int((~torch.isfinite(t)).sum())
            raise ValidationError(field, peer, f"{n_bad} of {t.numel()} values are NaN or infinite")
        if spec is not None and spec.max_abs is not None:
            peak = max(hi, -lo)
            if peak > spec.max_abs:
                raise ValidationError(field, peer, f"max |value| {peak:.4g} exceeds the bound {spec.max_abs:.4g}")
        if spec is not None and spec.max_norm is not None:
            norm = float(torch.linalg.vector_norm(t, dtype=torch.float64))
            if norm > spec.max_norm:
                raise ValidationError(field, peer, f"L2 norm {norm:.4g} exceeds the bound {spec.max_norm:.4g}")
    return t
