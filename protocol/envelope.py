"""The self-describing tensor envelope that carries every tensor on the wire.

An envelope holds the id of the codec that produced its payload, the dtype and shape of the tensor it decodes to,
and the payload bytes. Codec ids and dtype names are part of the wire format (see docs/protocol.md): ids are never
reused, only appended.
"""

from __future__ import annotations

import dataclasses
import math

import torch

__all__ = ["TensorEnvelope", "WIRE_DTYPES", "FLOAT_DTYPES", "dtype_name", "MAX_NDIM", "PayloadError"]

#: dtype names accepted on the wire and the torch dtype each decodes to
WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in WIRE_DTYPES.items()}
FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})
#: tensors with more dimensions than this are refused (no model tensor comes close)
MAX_NDIM = 8


class PayloadError(ValueError):
    """A payload that contradicts its envelope (bad indices, codebook size...); codecs.registry.decode turns it into
    a ValidationError naming the field and the peer."""


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype; ValueError for dtypes the protocol does not carry."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be sent; use one of {sorted(WIRE_DTYPES)}") from None


@dataclasses.dataclass(frozen=True, slots=True)
class TensorEnvelope:
    """One encoded tensor: `codec` id (codecs.registry.CODEC_IDS), `dtype` wire name, `shape`, `data` payload."""

    codec: int
    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def wire_bytes(self) -> int:
        """Bytes this envelope costs inside a message (payload plus a conservative bound on its header)."""
        return len(self.data) + 16 + len(self.dtype) + 9 * len(self.shape)
