"""Data-parallel averaging math: sparse partitions, the avg/delta/EMA update rules, and WAGMA groups.

AsyncMesh (docs/design.md, "Data-parallel axis"). Per parameter tensor, coordinates are randomly
permuted into n = ceil(1/(p * round_steps)) disjoint partitions (p per local step, one round per round_steps
steps), cycled one per round and redrawn after each cycle. The permutation
of cycle c for parameter j of stage s is keyed by (run seed, s, j, c) only and computed with explicit integer
arithmetic (``keyed_permutation``), so every replica computes the same partitions, whatever its library versions, and
no mask crosses the wire. Round r uses partition r % n of cycle r // n.

A round on partition S: the replicas' mean a = mean_j W_j[S] arrives some local steps after this replica snapshotted
W_then = W[S] (``begin``). On arrival (``finish``), with drift delta = W_now[S] - W_then:
  'avg'   W[S] <- a                                   (stale overwrite, "AsyncSPARTA")
  'delta' W[S] <- a + lam * delta
  'ema'   e[S] <- mu * e[S] + (1 - mu) * delta;  W[S] <- a + lam * e[S]     (AsyncMesh)
          the first update of a coordinate sets e to delta itself, as the reference code does (not (1 - mu) * delta);
          "first" is read from e == 0, so no extra state travels with the weights (a coordinate whose first
          drift was exactly 0 starts again at its next, which is the same)
mu is mu_start for the first mu_warmup_steps local steps, then cosine-annealed to mu_end at optim.total_steps:
  mu = mu_start + (mu_end - mu_start) * (1 - cos(pi * t)) / 2,  t = (k - W) / (T - W - 1) clamped to [0, 1].

WAGMA (docs/design.md, "WAGMA group averaging") as pure functions the simulator and the worker share: groups rotate
over the base-G digit fields of the replica index; a replica's new model is the mean of its *current* model and its
group partners' published ones, w_i <- (w_i + sum_{j != i} w_j^pub) / |group| (Li et al.: a replica's own
contribution is never a stale copy). Given the group's mean of the published models a (own published copy W_then
included, as the exchange computes it), that is a + (W_now - W_then) / |group|. Every ``wagma_global_every``-th round
is a global average over all replicas; arriving late, it is applied as a correction, W <- a + (W_now - W_then), never
as a stale overwrite.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from trainer.config import AveragingConfig

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
    return x ^ (x >> np.uint64(31))


_CHUNK = 1 << 22  # elements per vectorised pass: bounds the temporaries to a few tens of MiB


def keyed_permutation(n: int, key: int) -> np.ndarray:
    """pi(0), ..., pi(n-1): a pseudo-random permutation of range(n) fixed by ``key`` (uint64 array).

    A 4-round balanced Feistel network on 2h >= log2(n) bits with cycle-walking back into [0, n). It is explicit
    integer arithmetic, so every replica computes the same permutation whatever its platform or numpy/torch version
    (``torch.randperm``'s stream is not promised to stay the same across releases, and a replica that disagreed on
    the partition would silently average the wrong coordinates). O(n) time, no sort.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask, shift = np.uint64((1 << half) - 1), np.uint64(half)
    round_keys = [np.uint64(_seed("feistel", key, i)) for i in range(4)]

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


class Partitioner:
    """Per-parameter index sets of each round, identical on every replica of a stage.

    Coordinate i of parameter j belongs to partition pi(i) mod n of a cycle, pi = keyed_permutation keyed by
    (seed, stage, j, cycle): the n partitions are disjoint, cover the tensor and differ in size by at most one.

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
        self._dtype = np.uint16 if self.n <= np.iinfo(np.uint16).max else np.uint32
        self._cache: dict[int, list[np.ndarray]] = {}  # cycle -> partition id of every coordinate (2 bytes each)

    def _parts(self, cycle: int) -> list[np.ndarray]:
        parts = self._cache.get(cycle)
        if parts is None:
            parts = [(keyed_permutation(numel, _seed(self.seed, self.stage, j, cycle)) % np.uint64(self.n))
                     .astype(self._dtype) for j, numel in enumerate(self.numels)]
            # rounds in flight may straddle a cycle boundary: keep the two most recent cycles
            self._cache = {c: p for c, p in self._cache.items() if c == cycle - 1}
            self._cache[cycle] = parts
        return parts

    def indices(self, round_no: int) -> list[torch.Tensor]:
        """Flat LongTensor indices (ascending) of round ``round_no``'s partition, one per parameter."""
        if round_no < 0:
            raise ValueError(f"round_no must be >= 0, got {round_no}")
        if self.n == 1:
            return [torch.arange(numel) for numel in self.numels]
        cycle, k = divmod(round_no, self.n)
        return [torch.from_numpy(np.flatnonzero(part == k)).long() for part in self._parts(cycle)]


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
    indices: list[torch.Tensor]
    values: list[torch.Tensor] | None  # W_then[S]; None for rules that ignore the drift ('avg', 'wagma')


class SparseAveragingState:
    """One replica's averaging state: the partitioner, in-flight snapshots and the EMA drift buffers.

    Several rounds may be in flight at once (the network delay spans several local steps); each keeps its own
    snapshot. ``rule`` is 'avg', 'delta', 'ema' or 'wagma' (whose rounds average whole tensors, see wagma_apply).
    """

    def __init__(self, cfg: AveragingConfig, total_steps: int, seed: int, stage: int,
                 params: Sequence[torch.Tensor]) -> None:
        self.cfg, self.total_steps = cfg, total_steps
        fraction = 1.0 if cfg.rule == "wagma" else cfg.round_fraction
        self.partitioner = Partitioner(seed, stage, [p.shape for p in params], fraction)
        self.ema: list[torch.Tensor] = [torch.zeros_like(p) for p in params] if cfg.rule == "ema" else []
        self.snapshots: dict[int, _Snapshot] = {}

    def begin(self, round_no: int, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Snapshot W[S] of round ``round_no``; returns copies of the values (one flat tensor per parameter)."""
        if round_no in self.snapshots:
            raise AveragingError(f"averaging round {round_no} already begun; finish or abort it first")
        idx = [i.to(p.device) for i, p in zip(self.partitioner.indices(round_no), params, strict=True)]
        values = [p.detach().reshape(-1)[i].clone() for p, i in zip(params, idx, strict=True)]
        needs_drift = self.cfg.rule in ("delta", "ema", "wagma")
        self.snapshots[round_no] = _Snapshot(idx, values if needs_drift else None)
        return [v.clone() for v in values] if needs_drift else values

    def abort(self, round_no: int) -> None:
        """Forget the snapshot of a failed round; weights untouched. Unknown rounds are ignored."""
        self.snapshots.pop(round_no, None)

    @torch.no_grad()
    def finish(self, round_no: int, mean: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
               local_step: int, group_size: int | None = None) -> None:
        """Apply the rule with the drift since ``begin``; validates ``mean`` before touching any weight.

        For 'wagma', ``mean`` is the mean of the group's published models (ours included) and ``group_size`` how
        many there were (default ``wagma_group_size``): ours is replaced by our current values (wagma_apply); on a
        global round (``wagma_is_global(round_no)``) W <- mean + drift since begin.
        """
        snap = self.snapshots.get(round_no)
        if snap is None:
            raise AveragingError(f"averaging round {round_no} was never begun (or already finished/aborted)")
        if len(mean) != len(snap.indices):
            raise AveragingError(f"round {round_no}: got {len(mean)} tensors, expected {len(snap.indices)}")
        if group_size is not None and group_size < 1:
            raise AveragingError(f"round {round_no}: group_size must be >= 1, got {group_size}")
        for j, (m, i) in enumerate(zip(mean, snap.indices, strict=True)):
            if not isinstance(m, torch.Tensor) or not m.is_floating_point():
                raise AveragingError(f"round {round_no}: tensor {j} must be a float tensor, got {type(m).__name__}")
            if m.shape != i.shape:
                raise AveragingError(f"round {round_no}: tensor {j} has shape {tuple(m.shape)}, "
                                     f"expected {tuple(i.shape)}")
            if not torch.isfinite(m).all():
                raise AveragingError(f"round {round_no}: tensor {j} holds NaN or Inf; round rejected")
        del self.snapshots[round_no]
        rule, lam = self.cfg.rule, self.cfg.lam
        mu = mu_at(self.cfg, local_step, self.total_steps)
        then = snap.values
        for j, (p, i) in enumerate(zip(params, snap.indices, strict=True)):
            flat = p.data.view(-1)
            a = mean[j].to(device=p.device, dtype=p.dtype)
            if rule == "avg":
                new = a
            elif rule == "delta" and then is not None:
                new = a + lam * (flat[i] - then[j])
            elif rule == "ema" and then is not None:
                e = self.ema[j].view(-1)
                drift, prev = flat[i] - then[j], e[i]
                e[i] = torch.where(prev == 0, drift, mu * prev + (1.0 - mu) * drift)
                new = a + lam * e[i]
            elif rule == "wagma" and then is not None and wagma_is_global(round_no, self.cfg.wagma_global_every):
                new = a + (flat[i] - then[j])
            elif rule == "wagma" and then is not None:
                new = wagma_apply(flat[i], then[j], a, group_size or self.cfg.wagma_group_size)
            else:
                raise AveragingError(f"averaging.rule {rule!r} does not average; set a rule to use averaging")
            flat[i] = new

    def state_dict(self) -> dict:
        return {"ema": [e.clone() for e in self.ema]}

    def load_state_dict(self, d: dict) -> None:
        ema = d["ema"]
        if len(ema) != len(self.ema) or any(a.shape != b.shape for a, b in zip(ema, self.ema, strict=True)):
            raise ValueError("averaging state does not match this stage's parameters (different run or stage?)")
        for dst, src in zip(self.ema, ema, strict=True):
            dst.copy_(src)
        self.snapshots.clear()


# --- WAGMA ------------------------------------------------------------------------------------------------------

def wagma_n_fields(n_replicas: int, group_size: int) -> int:
    """Digit fields L = ceil(log_G R): groups rotate through them, one per phase."""
    if n_replicas < 1 or group_size < 2:
        raise ValueError(f"need n_replicas >= 1 and group_size >= 2, got {n_replicas}, {group_size}")
    fields, span = 0, 1
    while span < n_replicas:
        span *= group_size
        fields += 1
    return max(1, fields)


def wagma_group(replica: int, phase: int, n_replicas: int, group_size: int) -> list[int]:
    """Replicas averaging together with ``replica`` at ``phase`` (sorted, including ``replica`` itself).

    Phase t uses base-G digit field f = t mod L of the replica index: the group is every index that differs from
    ``replica`` only in digit f. For G a power of two this is the released code's XOR butterfly (partners
    ``replica ^ (m << f*log2 G)``). Groups are disjoint and symmetric, and after L phases every replica has mixed
    with every other. When R is not a power of G the index space is padded to G^L and indices >= R are left out, so
    some groups are smaller than G (possibly just the replica itself); any 2L consecutive phases still mix every
    replica into every other (move down the digits that decrease in the first L phases, then up the rest; all
    intermediate indices stay below max(i, j) < R), and the averaging divisor uses the actual group size.
    """
    if not 0 <= replica < n_replicas:
        raise ValueError(f"replica must be in [0, {n_replicas}), got {replica}")
    L = wagma_n_fields(n_replicas, group_size)
    unit = group_size ** (phase % L)
    digit = (replica // unit) % group_size
    base = replica - digit * unit
    return [m for m in (base + d * unit for d in range(group_size)) if m < n_replicas]


def wagma_is_global(step: int, every: int) -> bool:
    """True when ``step`` is a global-average step: t mod (tau + 1) == tau with every = tau + 1."""
    return step % every == every - 1


def wagma_average(own: torch.Tensor, partners: Sequence[torch.Tensor]) -> torch.Tensor:
    """(own current model + the group partners' published models) / (len(partners) + 1)."""
    total = own.clone()
    for w in partners:
        total += w
    return total / (len(partners) + 1)


def wagma_apply(own_now: torch.Tensor, own_then: torch.Tensor, group_mean: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """wagma_average given the mean of the ``group_size`` published models, ours (``own_then``) among them: our
    published copy is swapped for our current model, group_mean + (own_now - own_then) / group_size."""
    return group_mean + (own_now - own_then) / group_size


def global_average(models: Sequence[torch.Tensor]) -> torch.Tensor:
    """Plain mean of all replicas' tensors (the periodic global synchronisation)."""
    return torch.stack(list(models)).mean(dim=0)
