"""A stage's tensors as views into one flat buffer, each starting on a block boundary (the averaging's layout).

A round averages a partition of blocks of ``block`` contiguous coordinates of every tensor (trainer/averaging.py).
With the tensors laid out one after the other in one buffer, each padded to whole blocks, block b of tensor j is row
``start[j] + b`` of the buffer seen as [rows, block], so a round's partition is one LongTensor of rows and gathering
or writing back the slice of all tensors is one ``index_select`` / ``index_copy_``, whatever the number of tensors
(a loop over tensors costs a few operators per tensor, a GPU kernel launch each). The padding (fewer than ``block``
coordinates per tensor) holds zeros, which every rule maps to zero, so it never leaves the buffer.

The parameters themselves live there (``adopt`` rebinds each ``param.data`` to its view: the optimiser, the model
and in-place copies such as ``load_state_dict`` keep working on the views). Anything that rebinds ``param.data``
instead (``Module.to``, ``load_state_dict(assign=True)``) breaks the link; ``holds`` finds that, and the averaging
state adopts the parameters again before it reads them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import torch


class FlatLayout:
    """Where each tensor of a stage lives in the flat buffer: tensor j's coordinates from ``block * start[j]``.

    Args:
        shapes: the stage's tensor shapes, in order.
        block: coordinates per block; every tensor starts on a block boundary and is padded to whole blocks.
    """

    def __init__(self, shapes: Sequence[Sequence[int]], block: int) -> None:
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.block = block
        self.shapes = [torch.Size(s) for s in shapes]
        self.numels = [math.prod(s) for s in self.shapes]
        n_blocks = [-(-numel // block) for numel in self.numels]
        self.start = [0, *itertools.accumulate(n_blocks)][: len(n_blocks)]  # first row of each tensor
        self.rows = sum(n_blocks)
        self.size = self.rows * block

    def zeros(self, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        return torch.zeros(self.size, dtype=dtype, device=device)

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's view into ``buf`` (a buffer of this layout), shaped as the tensor."""
        return [buf[s * self.block: s * self.block + n].view(shape)
                for s, n, shape in zip(self.start, self.numels, self.shapes, strict=True)]

    def flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """A new buffer of this layout holding copies of ``tensors`` (zeros in the padding)."""
        self._check(tensors)
        buf = self.zeros(tensors[0].dtype, tensors[0].device)
        for view, t in zip(self.views(buf), tensors, strict=True):
            view.copy_(t.detach())
        return buf

    def adopt(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """Move ``params`` into a new flat buffer: their values are copied, then each ``param.data`` becomes its
        view (the tensor objects stay the same, so an optimiser built over them keeps working). Returns the
        buffer."""
        buf = self.flatten(params)
        with torch.no_grad():
            for p, view in zip(params, self.views(buf), strict=True):
                p.data = view
        return buf

    def holds(self, buf: torch.Tensor, params: Sequence[torch.Tensor]) -> bool:
        """Whether every one of ``params`` is still its view into ``buf`` (nothing rebound its ``.data``). Reads
        pointers only: no tensor operator runs."""
        if len(params) != len(self.numels):
            return False
        base, item = buf.data_ptr(), buf.element_size()
        return all(p.data_ptr() == base + s * self.block * item and p.shape == shape and p.is_contiguous()
                   and p.dtype == buf.dtype
                   for p, s, shape in zip(params, self.start, self.shapes, strict=True))

    def _check(self, tensors: Sequence[torch.Tensor]) -> None:
        if [t.shape for t in tensors] != self.shapes:
            raise ValueError(f"tensors of shapes {[tuple(t.shape) for t in tensors]} do not fit this layout "
                             f"({[tuple(s) for s in self.shapes]})")
        if len({(t.dtype, t.device) for t in tensors}) > 1:
            raise ValueError("a flat buffer holds tensors of one dtype on one device; got "
                             f"{sorted({f'{t.dtype} on {t.device}' for t in tensors})}")


class Slice:
    """One round's partition of a stage: per tensor the ascending ids of its blocks of ``block`` coordinates (the
    last block of a tensor may be short).

    A stage whose tensors live in one flat buffer (``FlatLayout``: each tensor from a block boundary, padded to
    whole blocks) is gathered and written back in one operator, ``gather_flat`` / ``scatter_flat``, over the
    partition's rows of that buffer (``flat_rows_on``: tensor j's block b is row start_j + b); the slice is then
    ``padded`` long, the short last blocks' padding included, and ``unpad`` / ``pad`` convert it to and from the
    per-tensor values a round publishes. ``gather`` / ``scatter`` do the same over separate tensors, a few
    operators per tensor."""

    def __init__(self, rows: list[np.ndarray], block: int, numels: list[int],
                 flat_rows: np.ndarray | None = None) -> None:
        self.block, self.numels = block, numels
        self.full = [numel // block for numel in numels]  # whole blocks of each tensor
        # a tensor's short last block (numel % block coordinates) is copied apart from the whole ones
        self.tail = [block > 1 and numel % block > 0 and len(r) > 0 and int(r[-1]) == full
                     for r, numel, full in zip(rows, numels, self.full, strict=True)]
        self.rows = [torch.from_numpy(r[:-1] if t else r) for r, t in zip(rows, self.tail, strict=True)]
        self.sizes = [len(r) * block + (numel % block if t else 0)
                      for r, numel, t in zip(self.rows, numels, self.tail, strict=True)]
        self.total = sum(self.sizes)
        self._on: dict[torch.device, list[torch.Tensor]] = {}  # the rows on an accelerator, moved once
        # the flat layout: the padding of each tensor's short last block, and the partition's rows of the buffer
        self.pads = [block - numel % block if t else 0 for numel, t in zip(numels, self.tail, strict=True)]
        self.split = [n for size_pad in zip(self.sizes, self.pads, strict=True) for n in size_pad]
        n_blocks = [-(-numel // block) for numel in numels]
        n_rows = sum(len(r) for r in rows)
        self.padded = n_rows * block
        self.whole = n_rows == sum(n_blocks)  # every block: the slice is the whole buffer, copied, not indexed
        self._flat: torch.Tensor | None = None
        if not self.whole:
            if flat_rows is None:
                start = np.concatenate([[0], np.cumsum(n_blocks)[:-1]]).astype(np.int64)
                flat_rows = np.concatenate([np.asarray(r, dtype=np.int64) + s for r, s in zip(rows, start,
                                                                                              strict=True)])
            self._flat = torch.from_numpy(np.ascontiguousarray(flat_rows, dtype=np.int64))
        self._flat_on: dict[torch.device, torch.Tensor] = {}

    def rows_on(self, device: torch.device) -> list[torch.Tensor]:
        """The block ids per tensor on ``device``: one host-to-device copy for the whole slice, made once (a copy per
        tensor per gather would cost a synchronised transfer each, several times a round)."""
        if device.type == "cpu":
            return self.rows
        got = self._on.get(device)
        if got is None:
            flat = torch.cat(self.rows).to(device) if self.rows else torch.empty(0, dtype=torch.long, device=device)
            got = self._on[device] = list(torch.split(flat, [len(r) for r in self.rows]))
        return got

    def flat_rows_on(self, device: torch.device) -> torch.Tensor | None:
        """The partition's rows of the flat buffer (ascending) on ``device``, moved once; None for a whole slice."""
        if self._flat is None or device.type == "cpu":
            return self._flat
        got = self._flat_on.get(device)
        if got is None:
            got = self._flat_on[device] = self._flat.to(device)
        return got

    def gather_flat(self, buf: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The slice of ``buf`` (a flat buffer of the stage, ``FlatLayout``) as one tensor of ``padded``
        coordinates, new or written into ``out``'s first ``padded`` elements: one operator."""
        if out is None:
            out = torch.empty(self.padded, dtype=buf.dtype, device=buf.device)
        out = out[: self.padded]
        rows = self.flat_rows_on(buf.device)
        if rows is None:
            return out.copy_(buf)
        torch.index_select(buf.view(-1, self.block), 0, rows, out=out.view(-1, self.block))
        return out

    def scatter_flat(self, buf: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` (a slice as ``gather_flat`` returns it) into ``buf`` in place: one operator."""
        rows = self.flat_rows_on(buf.device)
        if rows is None:
            buf.copy_(values[: self.padded])
        else:
            buf.view(-1, self.block).index_copy_(0, rows, values[: self.padded].view(-1, self.block))

    def unpad(self, values: torch.Tensor) -> list[torch.Tensor]:
        """The per-tensor values (views) of a slice as ``gather_flat`` returns it, without the padding."""
        return list(torch.split(values[: self.padded], self.split))[::2]

    def pad(self, parts: Sequence[torch.Tensor], zeros: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``parts`` (per-tensor values) with the padding between them, to be concatenated into a slice as
        ``gather_flat`` returns it; ``zeros[k]``: k zeros (k < block)."""
        return [x for part, pad in zip(parts, self.pads, strict=True) for x in (part, zeros[pad])]

    def indices(self) -> list[torch.Tensor]:
        """Flat coordinate indices (ascending), one LongTensor per tensor."""
        out = []
        for j, rows in enumerate(self.rows):
            idx = (rows.unsqueeze(1) * self.block + torch.arange(self.block)).reshape(-1)
            if self.tail[j]:
                idx = torch.cat([idx, torch.arange(self.full[j] * self.block, self.numels[j])])
            out.append(idx)
        return out

    def _rows_view(self, j: int, flat: torch.Tensor) -> torch.Tensor:
        return flat[: self.full[j] * self.block].view(self.full[j], self.block)

    def gather(self, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """The slice of ``tensors`` (the stage's, in order) as one flat tensor (the tensors' slices in order), new
        or written into ``out``'s first ``total`` elements."""
        if out is None:
            out = torch.empty(self.total, dtype=tensors[0].dtype, device=tensors[0].device)
        out = out[: self.total]
        rows = self.rows_on(tensors[0].device)
        at = 0
        for j, t in enumerate(tensors):
            flat, head = t.detach().reshape(-1), len(self.rows[j]) * self.block
            if head:
                torch.index_select(self._rows_view(j, flat), 0, rows[j],
                                   out=out[at: at + head].view(-1, self.block))
            if self.tail[j]:
                out[at + head: at + self.sizes[j]] = flat[self.full[j] * self.block:]
            at += self.sizes[j]
        return out

    def scatter(self, tensors: Sequence[torch.Tensor], values: torch.Tensor) -> None:
        """Write ``values`` (a flat slice as ``gather`` returns it) into ``tensors`` in place."""
        rows = self.rows_on(tensors[0].device) if len(tensors) else []
        at = 0
        for j, t in enumerate(tensors):
            flat, head = t.data.view(-1), len(self.rows[j]) * self.block
            if head:
                self._rows_view(j, flat).index_copy_(0, rows[j], values[at: at + head].view(-1, self.block))
            if self.tail[j]:
                flat[self.full[j] * self.block:] = values[at + head: at + self.sizes[j]]
            at += self.sizes[j]
