"""Data-parallel averaging math: sparse partitions and a replica's round state (the rules are trainer/rules.py).

AsyncMesh (docs/design.md, "Data-parallel axis"). Every tensor of a stage is cut into n = ceil(1/(p * round_steps))
disjoint partitions (p per local step, one round per round_steps steps), cycled one per round and redrawn after each
cycle. Partitions are drawn over blocks of contiguous coordinates (single coordinates in small stages, up to
BLOCK_MAX in large ones: ``block_size``) by a keyed pseudo-random permutation per tensor and cycle, keyed by
(run seed, stage, tensor, cycle) only and computed with explicit integer arithmetic (``keyed_permutation``), so every
replica computes the same partitions, whatever its library versions, and no mask crosses the wire. Round r uses
partition r % n of cycle r // n; its blocks are found by inverting the permutation on k, k + n, ... only
(``keyed_preimage``), so drawing a round costs O(blocks / n), never a pass over the whole stage. The stage's
parameters and the averaging buffers live in flat buffers of one layout (trainer/flat.py), so a round's gathers and
write-backs are one operator each, whatever the number of tensors.

A round on partition S: the replicas' aggregate a arrives some local steps after this replica snapshotted
W_then = W[S] (``begin``). On arrival (``finish``) the run's rule (trainer/rules.py) writes W[S] from a, the drift
W_now[S] - W_then and, for 'ema', the drift estimate e[S]; mu for 'ema' is mu_start for the first mu_warmup_steps
local steps, then cosine-annealed to mu_end at optim.total_steps:
  mu = mu_start + (mu_end - mu_start) * (1 - cos(pi * t)) / 2,  t = (k - W) / (T - W - 1) clamped to [0, 1].
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainer.config import AveragingConfig
from trainer.flat import FlatLayout, Slice
from trainer.rules import RoundInputs, rule_of
from trainer.rules import wagma_group as wagma_group  # re-exported: the WAGMA groups live with the rules
from trainer.rules import wagma_is_global as wagma_is_global
from trainer.rules import wagma_n_fields as wagma_n_fields

logger = logging.getLogger(__name__)


class AveragingError(ValueError):
    """An averaging call that cannot be applied: unknown round, wrong shapes, non-finite values."""


def _seed(*parts: object) -> int:
    digest = hashlib.sha256("/".join(map(str, ("asyncmesh-partition",) + parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wrapping integer arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    out: np.ndarray = x ^ (x >> np.uint64(31))
    return out


_CHUNK = 1 << 22  # elements per vectorised pass: bounds the temporaries to a few tens of MiB
def _round_keys(key: int) -> list[np.uint64]:
    return [np.uint64(_seed("feistel", key, i)) for i in range(4)]


def _halves(n: int) -> tuple[np.uint64, np.uint64]:
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    return np.uint64((1 << half) - 1), np.uint64(half)


def keyed_permutation(n: int, key: int) -> np.ndarray:
    """pi(0), ..., pi(n-1): a pseudo-random permutation of range(n) fixed by ``key`` (uint64 array).

    A 4-round balanced Feistel network on 2h >= log2(n) bits with cycle-walking back into [0, n). It is explicit
    integer arithmetic, so every replica computes the same permutation whatever its platform or numpy/torch version
    (``torch.randperm``'s stream is not promised to stay the same across releases, and a replica that disagreed on
    the partition would silently average the wrong coordinates). O(n) time, no sort.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    mask, shift = _halves(n)
    round_keys = _round_keys(key)

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & mask
        for k in round_keys:
            left, right = right, left ^ (_mix64(right ^ k) & mask)
        return (left << shift) | right

    out = np.empty(n, dtype=np.uint64)
    for start in range(0, n, _CHUNK):
        y = feistel(np.arange(start, min(n, start + _CHUNK), dtype=np.uint64))
        walk = np.flatnonzero(y >= n)
        while walk.size:  # the domain is < 4n, so a few steps put every element back into range
            y[walk] = feistel(y[walk])
            walk = walk[y[walk] >= n]
        out[start : start + len(y)] = y
    return out


def _inverse_walk(ys: np.ndarray, bounds: np.ndarray, masks: np.ndarray, shifts: np.ndarray,
                  round_keys: Sequence[np.ndarray]) -> np.ndarray:
    """Elementwise pi^-1(ys): each element with its own domain bound, half-width and round keys (so the partitions
    of all of a stage's tensors are drawn in one vectorised pass)."""

    def inverse(y: np.ndarray, m: np.ndarray, sh: np.ndarray, keys: Sequence[np.ndarray]) -> np.ndarray:
        left, right = y >> sh, y & m
        for k in reversed(keys):
            left, right = right ^ (_mix64(left ^ k) & m), left
        out: np.ndarray = (left << sh) | right
        return out

    x = inverse(ys, masks, shifts, round_keys)
    walk = np.flatnonzero(x >= bounds)
    while walk.size:  # the inverse of a cycle-walked cipher is the cycle-walked inverse
        x[walk] = inverse(x[walk], masks[walk], shifts[walk], [k[walk] for k in round_keys])
        walk = walk[x[walk] >= bounds[walk]]
    return x


def keyed_preimage(ys: np.ndarray, n: int, key: int) -> np.ndarray:
    """pi^-1(y) for every y in ``ys`` (each < n), pi = ``keyed_permutation(n, key)``. O(len(ys)): a partition's
    members are found without permuting the whole range."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    ys = np.asarray(ys, dtype=np.uint64)
    mask, shift = _halves(n)
    full = np.full(len(ys), 1, dtype=np.uint64)
    return _inverse_walk(ys, full * np.uint64(n), full * mask, full * shift, [full * k for k in _round_keys(key)])


BLOCK_MAX = 64
"""Largest run of contiguous coordinates drawn as one (a power of two): a round gathers whole blocks (row copies)
and draws one pseudo-random number per block, not per coordinate."""
PART_MIN_BLOCKS = 1024
"""Blocks get shorter until a partition holds about this many of the stage's, so partitions stay balanced and mixed."""
MAX_BLOCKS = 1 << 18
"""...and longer (past BLOCK_MAX) until the stage holds at most this many, so drawing a partition stays cheap."""
READY_MAX = 8
"""Partitions drawn ahead (``Partitioner.prepare``) kept for their round; older ones are dropped."""


def block_size(total: int, n: int) -> int:
    """Coordinates per block for a stage of ``total`` coordinates cut into ``n`` partitions (a power of two)."""
    block = 1
    while block < BLOCK_MAX and total // (2 * block) >= n * PART_MIN_BLOCKS:
        block *= 2
    while -(-total // block) > MAX_BLOCKS:
        block *= 2
    return block


class Partitioner:
    """Per-parameter index sets of each round, identical on every replica of a stage.

    The stage's tensors are cut into blocks of ``block_size(total, n)`` contiguous coordinates (single coordinates
    in small stages); block b of parameter j belongs to partition pi(b) mod n of a cycle, pi = keyed_permutation over
    that tensor's blocks keyed by (seed, stage, j, cycle). The n partitions are disjoint, cover every tensor and
    differ per tensor by less than two blocks (one, and a short last one). Partition k's blocks are the preimages of
    k, k + n, k + 2n, ... (``keyed_preimage``), drawn for all tensors in one vectorised pass, so a round costs
    O(blocks / n) plus a copy of the slice, never a pass over every coordinate of the stage.

    Args:
        seed: the run seed.
        stage: the pipeline stage (replicas of different stages hold different tensors).
        shapes: the stage's parameter shapes, in ``parameters()`` order.
        fraction: p; each tensor is split into n = ceil(1/p) partitions.
    """

    def __init__(self, seed: int, stage: int, shapes: Sequence[Sequence[int]], fraction: float) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        self.seed, self.stage = seed, stage
        self.numels = [math.prod(s) for s in shapes]
        self.n = max(1, math.ceil(1.0 / fraction - 1e-9))
        self.block = block_size(sum(self.numels), self.n) if self.n > 1 else 1
        self.n_blocks = [-(-numel // self.block) for numel in self.numels]
        halves = [_halves(nb) for nb in self.n_blocks]
        self._masks = np.array([m for m, _ in halves], dtype=np.uint64)
        self._shifts = np.array([h for _, h in halves], dtype=np.uint64)
        self._offsets = np.concatenate([[0], np.cumsum(self.n_blocks)]).astype(np.int64)
        self._layouts: dict[int, tuple[np.ndarray, ...]] = {}
        self._keys: tuple[int, list[np.ndarray]] | None = None  # (cycle, per-round per-tensor keys)
        # rounds drawn ahead by ``prepare`` on another thread than the compute thread; the lock guards the caches
        self._ready: dict[int, Slice] = {}
        self._whole: Slice | None = None
        self._lock = threading.Lock()

    def prepare(self, round_no: int, device: torch.device | str = "cpu") -> None:
        """Draw round ``round_no``'s partition ahead, with its rows on ``device``, so that ``slice`` finds it: the
        draw is numpy work that any thread can do, and the compute thread then only gathers (the daemon's averaging
        loop calls this from a worker thread before it asks the compute thread for the round's values)."""
        part = self._draw(round_no)
        part.flat_rows_on(torch.device(device))
        with self._lock:
            self._ready[round_no] = part
            while len(self._ready) > READY_MAX:  # rounds prepared and never begun (aborted before the begin)
                del self._ready[min(self._ready)]

    def _cycle_keys(self, cycle: int) -> list[np.ndarray]:
        if self._keys is None or self._keys[0] != cycle:
            per_tensor = [_round_keys(_seed(self.seed, self.stage, j, cycle)) for j in range(len(self.numels))]
            self._keys = (cycle, [np.array([ks[i] for ks in per_tensor], dtype=np.uint64) for i in range(4)])
        return self._keys[1]

    def slice(self, round_no: int) -> Slice:
        """Round ``round_no``'s partition: partition round_no % n of cycle round_no // n (the one ``prepare`` drew,
        if it did)."""
        with self._lock:
            got = self._ready.pop(round_no, None)
        return got if got is not None else self._draw(round_no)

    def _draw(self, round_no: int) -> Slice:
        if round_no < 0:
            raise ValueError(f"round_no must be >= 0, got {round_no}")
        if self.n == 1:  # every round is the whole stage: one slice serves them all
            if self._whole is None:
                self._whole = Slice([np.arange(nb) for nb in self.n_blocks], self.block, self.numels)
            return self._whole
        cycle, k = divmod(round_no, self.n)
        with self._lock:
            owner, ys, bounds, masks, shifts = self._layout(k)
            keys = [key[owner] for key in self._cycle_keys(cycle)]
        blocks = _inverse_walk(ys, bounds, masks, shifts, keys)
        glob = np.sort(blocks.astype(np.int64) + self._offsets[owner])
        cuts = np.searchsorted(glob, self._offsets)
        return Slice([glob[cuts[j]:cuts[j + 1]] - self._offsets[j] for j in range(len(self.numels))], self.block,
                     self.numels, glob)

    def _layout(self, k: int) -> tuple[np.ndarray, ...]:
        """Partition k's preimage inputs, the same every cycle: the tensor of each, k + n m, and its tensor's
        bound, mask and shift (cached: a stage holds at most MAX_BLOCKS blocks in all)."""
        got = self._layouts.get(k)
        if got is None:
            counts = [len(range(k, nb, self.n)) for nb in self.n_blocks]
            owner = np.repeat(np.arange(len(counts)), np.array(counts, dtype=np.int64))
            ys = np.concatenate([np.arange(k, nb, self.n, dtype=np.uint64) for nb in self.n_blocks])
            bounds = np.array(self.n_blocks, dtype=np.uint64)
            got = self._layouts[k] = (owner, ys, bounds[owner], self._masks[owner], self._shifts[owner])
        return got

    def indices(self, round_no: int) -> list[torch.Tensor]:
        """Flat LongTensor indices (ascending) of round ``round_no``'s partition, one per parameter."""
        return self.slice(round_no).indices()


def mu_at(cfg: AveragingConfig, local_step: int, total_steps: int) -> float:
    """EMA coefficient at ``local_step``: mu_start during warm-up, then cosine to mu_end at ``total_steps``."""
    if local_step < cfg.mu_warmup_steps:
        return cfg.mu_start
    span = total_steps - cfg.mu_warmup_steps - 1
    if span <= 0:
        return cfg.mu_end
    t = min(1.0, max(0.0, (local_step - cfg.mu_warmup_steps) / span))
    return cfg.mu_start + (cfg.mu_end - cfg.mu_start) * (1.0 - math.cos(math.pi * t)) / 2.0


@dataclass
class _Snapshot:
    part: Slice
    then: torch.Tensor | None  # W_then over the slice, flat; None for rules that ignore the drift
    applied: torch.Tensor | None  # own_progress rules: the corrections applied so far at the begin, taken when a
    # finish first changes them while this round is in flight (None: unchanged since the begin)


class SparseAveragingState:
    """One replica's averaging state: the partitioner, in-flight snapshots and the EMA drift buffers.

    Several rounds may be in flight at once (the network delay spans several local steps); each keeps its own
    snapshot. The run's rule (trainer/rules.py) says what a round needs: a partition or whole tensors, the values at
    begin (for the drift), the EMA buffers. The parameters, the EMA buffer and the corrections applied live in flat
    buffers of one layout (trainer/flat.py; the parameters given here are moved into theirs, as views), so a
    round's gathers and write-backs are one operator each and its rule runs once over the slice: a round issues a
    few dozen operators whatever the number of tensors.
    """

    def __init__(self, cfg: AveragingConfig, total_steps: int, seed: int, stage: int,
                 params: Sequence[torch.Tensor]) -> None:
        self.cfg, self.total_steps = cfg, total_steps
        self.rule = rule_of(cfg)
        self.partitioner = Partitioner(seed, stage, [p.shape for p in params], self.rule.round_fraction(cfg))
        self.layout = FlatLayout([p.shape for p in params], self.partitioner.block)
        self.flat = self.layout.adopt(params)  # the parameters' values; each parameter is a view into it
        dtype, device = self.flat.dtype, self.flat.device
        self.ema_flat = self.layout.zeros(dtype, device) if self.rule.ema else None
        # own_progress rules: the sum of every correction a finish applied (a - W_now), so that a round's drift can
        # leave out what the rounds finishing in between did; transient (in-flight rounds do not survive a load)
        self.applied_flat = self.layout.zeros(dtype, device) if self.rule.own_progress else None
        self.snapshots: dict[int, _Snapshot] = {}
        # slice-sized buffers reused from round to round (a fresh one costs its page faults, about as much as the
        # arithmetic): those a finish works in (trainer/rules.py: a, W_now, e; the corrections applied, and W_now
        # before the rule for own_progress rules), and the snapshots of finished rounds
        self._scratch: list[torch.Tensor] = []
        self._spare: list[torch.Tensor] = []
        self._zeros: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}  # the padding's pieces

    @property
    def ema(self) -> list[torch.Tensor]:
        """The EMA buffer per parameter (views into ``ema_flat``); empty for rules without one."""
        return [] if self.ema_flat is None else self.layout.views(self.ema_flat)

    @property
    def applied(self) -> list[torch.Tensor]:
        """The corrections applied so far per parameter (views); empty for rules that do not track them."""
        return [] if self.applied_flat is None else self.layout.views(self.applied_flat)

    def _bind(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """The flat buffer of ``params``: the one they are views into, or (something rebound their ``.data``: a
        device move, a load with ``assign``) a new one they are moved into first."""
        if not self.layout.holds(self.flat, params):
            logger.info("averaging: the stage's parameters were rebound; moving them back into one flat buffer")
            self.flat = self.layout.adopt(params)
            if self.ema_flat is not None:
                self.ema_flat = self.ema_flat.to(self.flat.device)
            if self.applied_flat is not None:
                self.applied_flat = self.applied_flat.to(self.flat.device)
        return self.flat

    def _buffers(self, size: int, like: torch.Tensor, count: int = 3) -> list[torch.Tensor]:
        """``count`` slice-sized buffers, kept from round to round (the last two only once rounds overlap)."""
        if self._scratch and (self._scratch[0].numel() < size or self._scratch[0].device != like.device):
            self._scratch = []
        while len(self._scratch) < count:
            self._scratch.append(torch.empty(max(size, self._scratch[0].numel() if self._scratch else 0),
                                             dtype=like.dtype, device=like.device))
        return self._scratch

    def _take(self, size: int, like: torch.Tensor) -> torch.Tensor:
        """A buffer of ``size`` elements like ``like``: a spare one when one is large enough, else a new one."""
        for i, buf in enumerate(self._spare):
            if buf.numel() >= size and buf.device == like.device and buf.dtype == like.dtype:
                del self._spare[i]
                return buf[:size]
        return torch.empty(size, dtype=like.dtype, device=like.device)

    def _padding(self, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
        """k zeros for every k < block on ``device`` (views of one tensor, made once)."""
        got = self._zeros.get((device, dtype))
        if got is None:
            z = torch.zeros(self.layout.block, dtype=dtype, device=device)
            got = self._zeros[(device, dtype)] = [z[:k] for k in range(self.layout.block)]
        return got

    def copy_params(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """A copy of ``params`` (the ones this state holds in its flat buffer): one copy of the buffer, viewed per
        parameter (weight stashing's copy of the live weights, one operator)."""
        return self.layout.views(self._bind(params).clone())

    def begin(self, round_no: int, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Snapshot W[S] of round ``round_no``; returns copies of the values (one flat tensor per parameter)."""
        if round_no in self.snapshots:
            raise AveragingError(f"averaging round {round_no} already begun; finish or abort it first")
        part = self.partitioner.slice(round_no)
        flat = part.gather_flat(self._bind(params))
        then = self._take(len(flat), flat).copy_(flat) if self.rule.drift else None  # the values sent are the caller's
        self.snapshots[round_no] = _Snapshot(part, then, None)  # the corrections applied: taken when they change
        return part.unpad(flat)

    def prepare(self, round_no: int, device: torch.device | str) -> None:
        """Draw round ``round_no``'s partition ahead, off the compute thread (``Partitioner.prepare``)."""
        self.partitioner.prepare(round_no, device)

    def abort(self, round_no: int) -> None:
        """Forget the snapshot of a failed round; weights untouched. Unknown rounds are ignored."""
        self.snapshots.pop(round_no, None)

    @torch.no_grad()
    def finish(self, round_no: int, mean: Sequence[torch.Tensor] | Placed, params: Sequence[torch.Tensor],
               local_step: int, *, bounded: bool = False) -> None:
        """Apply the rule with the drift since ``begin``; validates ``mean`` (the aggregate of the round's published
        values, one flat tensor per parameter; a ``Placed`` one was checked finite already) before touching any
        weight. ``bounded``: the aggregate's pull was clipped (AveragingRule.apply_round)."""
        checked = isinstance(mean, Placed)
        mean = mean.tensors if isinstance(mean, Placed) else mean
        snap = self.snapshots.get(round_no)
        if snap is None:
            raise AveragingError(f"averaging round {round_no} was never begun (or already finished/aborted)")
        if not self.rule.averages:
            raise AveragingError(f"averaging.rule {self.rule.name!r} does not average; set a rule to use averaging")
        part = snap.part
        sizes = part.sizes
        if len(mean) != len(sizes):
            raise AveragingError(f"round {round_no}: got {len(mean)} tensors, expected {len(sizes)}")
        for j, (m, size) in enumerate(zip(mean, sizes, strict=True)):
            if not isinstance(m, torch.Tensor) or not m.is_floating_point():
                raise AveragingError(f"round {round_no}: tensor {j} must be a float tensor, got {type(m).__name__}")
            if m.shape != (size,):
                raise AveragingError(f"round {round_no}: tensor {j} has shape {tuple(m.shape)}, "
                                     f"expected ({size},)")
        flat = self._bind(params)
        dtype, device = flat.dtype, flat.device
        scratch = self._buffers(part.padded, flat)
        a = scratch[2][: part.padded]
        mean = [m if m.dtype == dtype else m.to(dtype=dtype) for m in mean]
        on = mean[0].device if mean else device
        if not all(m.device == on for m in mean):
            mean, on = [m.to(device) for m in mean], device
        pieces = part.pad(mean, self._padding(on, dtype))  # the slice's layout, padding included
        if on == device:
            torch.cat(pieces, out=a)
        else:  # parts decoded on the host: one transfer for the whole slice, not one per tensor
            a.copy_(torch.cat(pieces))
        if not checked and not finite(a):
            raise AveragingError(f"round {round_no}: the mean holds NaN or Inf; round rejected")
        del self.snapshots[round_no]
        now = part.gather_flat(flat, scratch[0])
        ema = part.gather_flat(self.ema_flat, scratch[1]) if self.ema_flat is not None else None
        then, applied = snap.then, None
        if self.applied_flat is not None and (snap.applied is not None or self.snapshots):
            scratch = self._buffers(part.padded, flat, 5)
        if snap.applied is not None and then is not None and self.applied_flat is not None:
            applied = part.gather_flat(self.applied_flat, scratch[3])
            # drift less the corrections applied since the begin: W_then + (applied - applied at the begin), in the
            # snapshot's own buffers
            then = then.add_(torch.sub(applied, snap.applied, out=snap.applied))
        # our correction matters to the rounds still in flight only (it is part of their drift, not of their own
        # progress); with none, the buffer's absolute value means nothing and it is left alone
        before = (scratch[4][: part.padded].copy_(now) if self.applied_flat is not None and self.snapshots
                  else None)
        new, new_ema = self.rule.apply_round(RoundInputs(
            mean=a, now=now, then=then, ema=ema, lam=self.cfg.lam,
            mu=mu_at(self.cfg, local_step, self.total_steps), bounded=bounded))
        part.scatter_flat(flat, new)
        if before is not None and self.applied_flat is not None:
            self._track_corrections(flat)
            if applied is None:
                applied = part.gather_flat(self.applied_flat, scratch[3])
            part.scatter_flat(self.applied_flat, applied.add_(torch.sub(new, before, out=before)))
        self._spare.extend(b for b in (snap.then, snap.applied) if b is not None)
        del self._spare[: max(0, len(self._spare) - 4)]  # two rounds' snapshots
        if new_ema is not None and self.ema_flat is not None:
            part.scatter_flat(self.ema_flat, new_ema)

    def _track_corrections(self, like: torch.Tensor) -> None:
        """Before the corrections applied change: the rounds in flight that have not taken their value at the begin
        take it now (it has not changed since: every change passes here)."""
        assert self.applied_flat is not None
        for snap in self.snapshots.values():
            if snap.applied is None:
                snap.applied = snap.part.gather_flat(self.applied_flat, self._take(snap.part.padded, like))

    def state_dict(self) -> dict[str, list[torch.Tensor]]:
        return {"ema": [e.clone() for e in self.ema]}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        ema = d["ema"]
        own = self.ema
        if len(ema) != len(own) or any(a.shape != b.shape for a, b in zip(ema, own, strict=True)):
            raise ValueError("averaging state does not match this stage's parameters (different run or stage?)")
        for dst, src in zip(own, ema, strict=True):
            dst.copy_(src)
        if self.applied_flat is not None:
            self.applied_flat.zero_()
        self.snapshots.clear()


def finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in ``t``, in one pass (they propagate into the sum); on a GPU the answer waits for the device."""
    return bool(torch.isfinite(t.sum()))


@dataclass(frozen=True)
class Placed:
    """A round's aggregate checked finite and moved onto the stage's device off the compute thread (``place``): a
    ``finish`` that gets one skips its own pass over the slice for the check, which on a GPU would also wait for every
    kernel the compute thread queued before it."""

    tensors: list[torch.Tensor]


def place(mean: Sequence[torch.Tensor], device: torch.device) -> Placed:
    """``mean`` (one flat tensor per parameter, decoded on the host) checked finite where it is and then moved onto
    ``device`` (``onto_device``); raises AveragingError for NaN or Inf. Safe on any thread: it reads no weight."""
    for j, m in enumerate(mean):
        if not isinstance(m, torch.Tensor) or not m.is_floating_point():
            raise AveragingError(f"tensor {j} of the aggregate must be a float tensor, got {type(m).__name__}")
        if not finite(m):
            raise AveragingError(f"tensor {j} of the aggregate holds NaN or Inf; round rejected")
    return Placed(onto_device(list(mean), device))


_SIDE_STREAMS: dict[torch.device, Any] = {}
_SIDE_LOCK = threading.Lock()


def onto_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` on ``device``: those already there as they are; on the CPU nothing is copied. On a GPU the copies
    run on a stream of their own, so that they neither queue behind nor hold up the kernels the compute thread keeps
    issuing on the device's default stream, and the calling thread waits for them; each copy is then marked as used
    by the default stream, so that its memory is not handed out again before the kernels of the ``finish`` that reads
    it have run."""
    if device.type != "cuda" or all(t.device == device for t in tensors):
        return tensors
    with _SIDE_LOCK:
        side = _SIDE_STREAMS.get(device)
        if side is None:
            side = _SIDE_STREAMS[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    with torch.cuda.stream(side):
        out = [t if t.device == device else t.to(device, non_blocking=True) for t in tensors]
    side.synchronize()  # the host's pageable pages were staged, and the copies have landed
    consumer = torch.cuda.default_stream(device)
    for t in out:
        t.record_stream(consumer)
    return out
