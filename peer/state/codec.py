"""A stage's state as a JSON skeleton plus tensors, cut into fixed pieces: the wire form of state sync.

``flatten_state`` turns a worker's nested ``state_dict()`` (dicts with str or int keys, lists, tuples, numbers,
strings, None, tensors) into a JSON skeleton, in which every container is tagged (so int keys, tuples and lists survive
the round trip exactly) and every tensor is replaced by its index, plus the list of tensors. ``plan_pieces`` cuts each
tensor into pieces of ``piece_bytes`` and packs them into chunks. The receiving side (``StateAssembler``) checks
everything against the skeleton before it allocates or copies: dtypes the wire carries, sane shapes, a bounded total,
every piece at an expected offset, received exactly once, none missing. No pickle is involved: a donor is a stranger.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

from protocol.envelope import MAX_NDIM, WIRE_DTYPES, dtype_name

FORMAT = 1
MAX_SKELETON_CHARS = 16 * 2**20
#: pieces per chunk; a StateChunk holds at most 4096 tensors, one of them the skeleton
MAX_PIECES_PER_CHUNK = 1024
_PRIMITIVES = (str, int, float, bool, type(None))

Json: TypeAlias = str | int | float | bool | None | list["Json"] | dict[str, "Json"]
"""A JSON value: the skeleton as ``json`` reads and writes it."""
StateTree: TypeAlias = (torch.Tensor | str | int | float | bool | None | list["StateTree"] | tuple["StateTree", ...]
                        | dict[Any, "StateTree"])
"""A nested state as the skeleton carries it: tensors, primitives, lists, tuples, and dicts whose keys are primitives
(typed Any so that a state dict, ``dict[str, Any]``, is one)."""


class StateFormatError(ValueError):
    """A received state (skeleton, pieces or result) is malformed or does not fit this stage."""


def flatten_state(state: object) -> tuple[str, list[torch.Tensor]]:
    """(skeleton JSON, tensors in skeleton order). TypeError for values that cannot be carried."""
    tensors: list[torch.Tensor] = []

    def enc(x: object) -> Json:
        if isinstance(x, torch.Tensor):
            tensors.append(x.detach().cpu())
            return {"T": len(tensors) - 1}
        if isinstance(x, dict):
            for k in x:
                if not isinstance(k, _PRIMITIVES):
                    raise TypeError(f"state dict key {k!r} of type {type(k).__name__} cannot be sent")
            return {"d": [[k, enc(v)] for k, v in x.items()]}
        if isinstance(x, list):
            return {"l": [enc(v) for v in x]}
        if isinstance(x, tuple):
            return {"t": [enc(v) for v in x]}
        if isinstance(x, _PRIMITIVES):
            return x
        raise TypeError(f"state holds a {type(x).__name__}, which state sync cannot carry")

    tree = enc(state)
    specs = [[dtype_name(t.dtype), list(t.shape)] for t in tensors]
    return json.dumps({"format": FORMAT, "specs": specs, "tree": tree}, separators=(",", ":")), tensors


def _piece_elems(dtype: torch.dtype, piece_bytes: int) -> int:
    return max(1, piece_bytes // torch.empty((), dtype=dtype).element_size())


@dataclass(frozen=True)
class Plan:
    """chunks[c] = [(tensor index, offset, length), ...] in elements of the flattened tensor."""

    piece_bytes: int
    chunks: list[list[tuple[int, int, int]]]

    @property
    def n_chunks(self) -> int:
        return len(self.chunks)


def plan_pieces(tensors: list[torch.Tensor], chunk_bytes: int, max_pieces: int = MAX_PIECES_PER_CHUNK) -> Plan:
    """Cut tensors into pieces of at most ``chunk_bytes`` and pack consecutive pieces into chunks of that size
    (and at most ``max_pieces`` pieces: a message carries a bounded number of tensors)."""
    chunks: list[list[tuple[int, int, int]]] = [[]]
    used = 0
    for idx, t in enumerate(tensors):
        step, numel, size = _piece_elems(t.dtype, chunk_bytes), t.numel(), t.element_size()
        for offset in range(0, numel, step):
            length = min(step, numel - offset)
            if chunks[-1] and (used + length * size > chunk_bytes or len(chunks[-1]) >= max_pieces):
                chunks.append([])
                used = 0
            chunks[-1].append((idx, offset, length))
            used += length * size
    return Plan(piece_bytes=chunk_bytes, chunks=chunks)


class StateAssembler:
    """Receiving side: validates a skeleton, then accepts pieces; ``finish()`` returns the nested state."""

    def __init__(self, skeleton: str, piece_bytes: int, limit_bytes: int) -> None:
        if len(skeleton) > MAX_SKELETON_CHARS:
            raise StateFormatError(f"skeleton of {len(skeleton)} chars exceeds {MAX_SKELETON_CHARS}")
        if not 0 < piece_bytes <= 2**30:
            raise StateFormatError(f"piece size {piece_bytes} out of range")
        try:
            doc = json.loads(skeleton)
        except (ValueError, RecursionError) as e:
            raise StateFormatError(f"skeleton is not valid JSON: {e}") from e
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("specs"), list):
            raise StateFormatError(f"skeleton is not of format {FORMAT}")
        self.dtypes: list[torch.dtype] = []
        self.shapes: list[tuple[int, ...]] = []
        total = 0
        for spec in doc["specs"]:
            if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], str)
                    and spec[0] in WIRE_DTYPES and isinstance(spec[1], list) and len(spec[1]) <= MAX_NDIM
                    and all(type(d) is int and 0 <= d < 2**40 for d in spec[1])):
                raise StateFormatError(f"bad tensor spec {str(spec)[:80]}")
            dtype, shape = WIRE_DTYPES[spec[0]], tuple(spec[1])
            total += math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            self.dtypes.append(dtype)
            self.shapes.append(shape)
        if total > limit_bytes:
            raise StateFormatError(f"state of {total} bytes exceeds the limit of {limit_bytes}")
        self.tree: Json = doc.get("tree")
        used: set[int] = set()
        try:
            self._check_tree(self.tree, used)
        except RecursionError as e:
            raise StateFormatError("skeleton nests too deeply") from e
        if used != set(range(len(self.shapes))):
            raise StateFormatError("skeleton does not reference every tensor exactly once")
        self.piece_bytes = piece_bytes
        self.buffers: dict[int, torch.Tensor] = {}
        self.received: set[tuple[int, int]] = set()

    def _check_tree(self, x: Json, used: set[int]) -> None:
        if isinstance(x, _PRIMITIVES):
            return
        if not isinstance(x, dict) or len(x) != 1:
            raise StateFormatError("skeleton holds an untagged container")
        (tag, value), = x.items()
        if tag == "T":
            if type(value) is not int or not 0 <= value < len(self.shapes) or value in used:
                raise StateFormatError(f"skeleton references tensor {value!r} badly")
            used.add(value)
        elif tag == "d" and isinstance(value, list):
            for item in value:
                if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], _PRIMITIVES)):
                    raise StateFormatError("skeleton holds a malformed dict entry")
                self._check_tree(item[1], used)
        elif tag in ("l", "t") and isinstance(value, list):
            for item in value:
                self._check_tree(item, used)
        else:
            raise StateFormatError(f"skeleton holds an unknown tag {tag!r}")

    def parse_key(self, key: str) -> tuple[int, int]:
        try:
            idx_s, off_s = key.split(":")
            return int(idx_s), int(off_s)
        except ValueError as e:
            raise StateFormatError(f"bad piece key {key[:40]!r}") from e

    def expect(self, idx: int, offset: int) -> tuple[torch.dtype, int]:
        """dtype and length the piece (idx, offset) must have; StateFormatError if it is not one we expect."""
        if not 0 <= idx < len(self.shapes):
            raise StateFormatError(f"piece for unknown tensor {idx}")
        numel, step = math.prod(self.shapes[idx]), _piece_elems(self.dtypes[idx], self.piece_bytes)
        if offset < 0 or offset >= numel or offset % step or (idx, offset) in self.received:
            raise StateFormatError(f"unexpected or repeated piece {idx}:{offset}")
        return self.dtypes[idx], min(step, numel - offset)

    def put(self, idx: int, offset: int, piece: torch.Tensor) -> None:
        dtype, length = self.expect(idx, offset)
        if piece.dtype != dtype or piece.shape != (length,):
            raise StateFormatError(f"piece {idx}:{offset} has dtype {piece.dtype} shape {tuple(piece.shape)}")
        buf = self.buffers.get(idx)
        if buf is None:
            buf = self.buffers[idx] = torch.empty(math.prod(self.shapes[idx]), dtype=dtype)
        buf[offset:offset + length] = piece
        self.received.add((idx, offset))

    def finish(self) -> StateTree:
        """The nested state; StateFormatError when pieces are missing."""
        tensors: list[torch.Tensor] = []
        for idx, shape in enumerate(self.shapes):
            numel = math.prod(shape)
            expected = math.ceil(numel / _piece_elems(self.dtypes[idx], self.piece_bytes))
            got = sum(1 for i, _ in self.received if i == idx) if expected else 0
            if got != expected:
                raise StateFormatError(f"tensor {idx}: {got} of {expected} pieces arrived")
            buf = self.buffers.get(idx, torch.empty(0, dtype=self.dtypes[idx]))
            tensors.append(buf.reshape(shape))
        return _decode_tree(self.tree, tensors)


def _decode_tree(x: Json, tensors: list[torch.Tensor]) -> StateTree:
    # the asserts restate what the skeleton's check established: primitives and tagged containers only
    if not isinstance(x, dict):
        assert not isinstance(x, list)
        return x
    (tag, value), = x.items()
    if tag == "T":
        assert isinstance(value, int)
        return tensors[value]
    assert isinstance(value, list)
    if tag == "d":
        entries: dict[Any, StateTree] = {}
        for entry in value:
            assert isinstance(entry, list)
            k, v = entry
            entries[k] = _decode_tree(v, tensors)
        return entries
    items = [_decode_tree(v, tensors) for v in value]
    return items if tag == "l" else tuple(items)


def check_against_reference(state: object, reference: Mapping[str, Any]) -> None:
    """The received state must be a dict of the same run and stage with the reference's parameter names/shapes."""
    if not isinstance(state, dict):
        raise StateFormatError(f"state is a {type(state).__name__}, not a dict")
    for key in ("format", "run_id", "stage"):
        if key in reference and state.get(key) != reference[key]:
            raise StateFormatError(f"state has {key}={state.get(key)!r}, expected {reference[key]!r}")
    ref_model, model = reference.get("model"), state.get("model")
    if isinstance(ref_model, dict):
        if not isinstance(model, dict) or model.keys() != ref_model.keys():
            raise StateFormatError("state's parameter names differ from this stage's")
        for name, ref in ref_model.items():
            t = model[name]
            if not isinstance(t, torch.Tensor) or t.shape != ref.shape or t.dtype != ref.dtype:
                raise StateFormatError(f"parameter {name}: expected {ref.dtype} {tuple(ref.shape)}")
