"""The aggregation step of an averaging round: outliers dropped relative to the robust centre, then the run's
aggregator over one equal-weight contribution per authenticated peer id.

``PartExchange`` has already checked every part on its own (shape, finite, distance from *our* values). That check
alone cannot refuse a zero part (its distance from our values is exactly our norm, inside the allowance) nor scale a
group of colluding parts down. Here all parts of the round are looked at together:

1. **Outliers.** A contribution with any tensor farther from the coordinate-wise median of all contributions (ours
   included) than ``outlier_factor`` times the median such distance plus ``outlier_rms * sqrt(numel)`` is dropped and
   counted (``rejected:avg_outlier``); our own part is never dropped. With three or more contributions and fewer than
   half of them lying, the median and the median distance are set by honest parts, so zeros, scaled and sign-flipped
   parts are refused. With two, the centre is their midpoint and nothing can be told apart.
2. **A lone partner is bounded.** With a robust aggregator and exactly one partner part left, the two cannot be
   told apart, and the mean would let a lying partner move our values as far as it likes within the distance check
   (a zero part moves them halfway to zero). ``PairRadius`` remembers, per tensor, the distances from our values of
   the partner parts kept in recent rounds of three or more (rounds where the robust centre is set by honest
   parts); the lone part's difference from ours is clipped to ``factor`` times their median (plus the outlier
   floor), as CenteredClip clips around its centre (counted as ``avg_pair_clipped``). A stage of two replicas has
   no such rounds and averages in plain pairs: one liar among two is past any breakdown point.
3. **Aggregate.** The remaining contributions, one per peer id (a sender-chosen weight is never read), stacked in
   sorted id order, go through ``run.averaging.aggregator`` (trainer/robust.py: 'mean', 'trimmed',
   'centered_clip'). Peers holding the same set of contributions compute the same bits (unless CenteredClip starts
   from each peer's own values).
"""

from __future__ import annotations

import math
from collections import deque

import torch

from trainer.config import AveragingConfig
from trainer.robust import aggregate, outliers


class PairRadius:
    """Per tensor, the distances from our values of the partner parts kept in recent rounds of three or more
    contributions; ``radius(j)`` is how far a lone partner's part may pull tensor ``j`` (None until ``min_samples``
    distances are known: the first rounds of a stage cannot be bounded)."""

    def __init__(self, factor: float = 2.0, floor_rms: float = 0.01, memory: int = 64, min_samples: int = 4) -> None:
        self.factor, self.floor_rms, self.min_samples = factor, floor_rms, min_samples
        self.memory = memory
        self.seen: dict[int, deque[float]] = {}

    def record(self, j: int, distance: float) -> None:
        self.seen.setdefault(j, deque(maxlen=self.memory)).append(distance)

    def radius(self, j: int, numel: int) -> float | None:
        seen = self.seen.get(j)
        if seen is None or len(seen) < self.min_samples:
            return None
        ordered = sorted(seen)
        return self.factor * ordered[len(ordered) // 2] + self.floor_rms * math.sqrt(max(1, numel))


def _bound_lone_partner(own: list[torch.Tensor], part: list[torch.Tensor], radius: PairRadius
                        ) -> tuple[list[torch.Tensor], bool]:
    """``part`` with each tensor's difference from ``own`` clipped to ``radius``; whether anything was clipped."""
    out, clipped = [], False
    for j, (o, p) in enumerate(zip(own, part, strict=True)):
        limit = radius.radius(j, o.numel())
        d = p - o
        n = float(d.norm())
        if limit is not None and n > limit:
            p, clipped = o + d * (limit / n), True
        out.append(p)
    return out, clipped


def robust_combine(me: str, own_values: list[torch.Tensor], parts: dict[str, list[torch.Tensor]],
                   cfg: AveragingConfig, *, outlier_factor: float, outlier_rms: float,
                   pair_radius: PairRadius | None = None) -> tuple[list[torch.Tensor], list[str], bool]:
    """(the aggregate of our values and ``parts``, the peer ids dropped as outliers, whether a lone partner's part
    was clipped); see the module docstring. ``pair_radius`` (with a robust aggregator) bounds a lone partner."""
    everyone = dict(parts)
    everyone[me] = own_values
    order = sorted(everyone)
    dropped: set[str] = set()
    if len(order) >= 3:
        for j in range(len(own_values)):
            xs = torch.stack([everyone[p][j] for p in order])
            dropped.update(order[i] for i in outliers(xs, outlier_factor, outlier_rms) if order[i] != me)
    kept = [p for p in order if p not in dropped]
    clipped = False
    if pair_radius is not None and cfg.aggregator != "mean":
        partners = [p for p in kept if p != me]
        if len(order) >= 3:  # a round whose centre honest parts set: remember how far they were from us
            for p in partners:
                for j, (o, x) in enumerate(zip(own_values, everyone[p], strict=True)):
                    pair_radius.record(j, float((x - o).norm()))
        if len(order) == 2 and len(partners) == 1:
            everyone[partners[0]], clipped = _bound_lone_partner(own_values, everyone[partners[0]], pair_radius)
    own = kept.index(me)
    values = [aggregate(torch.stack([everyone[p][j] for p in kept]), cfg.aggregator, trim=cfg.trim,
                        clip_scale=cfg.clip_scale, clip_iters=cfg.clip_iters, clip_start=cfg.clip_start, own=own)
              for j in range(len(own_values))]
    return values, sorted(dropped), clipped
