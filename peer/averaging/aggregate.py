"""The aggregation step of an averaging round: outliers dropped relative to the robust centre, then the run's
aggregator over one equal-weight contribution per authenticated peer id.

``PartExchange`` has already checked every part on its own (shape, finite, distance from *our* values). That check
alone cannot refuse a zero part (its distance from our values is exactly our norm, inside the allowance) nor scale a
group of colluding parts down. Here all parts of the round are looked at together:

1. **Outliers.** A contribution with any tensor farther from the coordinate-wise median of all contributions (ours
   included) than ``outlier_factor`` times the median such distance plus ``outlier_rms * sqrt(numel)`` is dropped and
   counted (``rejected:avg_outlier``). Our own part is dropped too when it is the outlier of a round that reached
   its quorum (the caller passes it), with fewer than half of the parts dropped: then we are the one that is off
   (a state loaded from a lying donor, a slice a liar pulled away), and the others' aggregate replaces our slice
   instead of being mixed with it. Otherwise our own part is kept. With three or more contributions and fewer than
   half of them lying, the median and the median distance are set by honest parts, so zeros, scaled and sign-flipped
   parts are refused. With two, the centre is their midpoint and nothing can be told apart.
2. **A lone partner is bounded.** With a robust aggregator, when two or more partners were asked and exactly one
   partner's part arrived, the two cannot be told apart, and the mean would let a lying partner move our values as
   far as the distance check allows (a zero part moves them halfway to zero). ``AveragingLoop`` does not apply a
   round below its quorum while its stage reaches the quorum; otherwise (announced peers that never answer) the
   lone part's difference from ours is clipped to ``lone_bound`` x our norm per tensor (5 %: honest replicas are
   pulled together by every round and stay closer than that), counted as ``avg_pair_clipped``. A pair by design (a
   stage of two replicas, a WAGMA pair) is averaged as it is: one liar among two is past any breakdown point.
3. **Aggregate.** The remaining contributions, one per peer id (a sender-chosen weight is never read), stacked in
   sorted id order, go through ``run.averaging.aggregator`` (trainer/robust.py: 'mean', 'trimmed',
   'centered_clip'). Peers holding the same set of contributions compute the same bits (unless CenteredClip starts
   from each peer's own values).
"""

from __future__ import annotations

import math

import torch

from trainer.config import AveragingConfig
from trainer.robust import aggregate, outliers

LONE_FLOOR_RMS = 1e-3
"""Per-coordinate rms added to a lone partner's bound, so that zero-initialised tensors (biases) still average; about
the int8 rounding of weights of rms 0.1 to 0.3."""


def _bound_lone_partner(own: list[torch.Tensor], part: list[torch.Tensor], rel: float
                        ) -> tuple[list[torch.Tensor], bool]:
    """``part`` with each tensor's difference from ``own`` clipped to ``rel`` x our norm (plus ``LONE_FLOOR_RMS``
    per coordinate); whether any was clipped."""
    out, clipped = [], False
    for o, p in zip(own, part, strict=True):
        limit = rel * float(o.norm()) + LONE_FLOOR_RMS * math.sqrt(max(1, o.numel()))
        d = p - o
        n = float(d.norm())
        if n > limit:
            p, clipped = o + d * (limit / n), True
        out.append(p)
    return out, clipped


def robust_combine(me: str, own_values: list[torch.Tensor], parts: dict[str, list[torch.Tensor]],
                   cfg: AveragingConfig, *, outlier_factor: float, outlier_rms: float,
                   lone_bound: float | None = None, asked: int = 0, quorum: int | None = None,
                   ) -> tuple[list[torch.Tensor], list[str], bool]:
    """(the aggregate of our values and ``parts``, the peer ids dropped as outliers, whether a lone partner's part
    was clipped); see the module docstring. With a robust aggregator and ``lone_bound``, the part of a lone partner
    is clipped to ``lone_bound`` x our norm when ``asked`` (the partners asked) was two or more: a pair by design (a
    stage of two replicas, a WAGMA pair) is averaged as it is. With ``quorum`` (a round that reached it), our own
    part is judged like the others: if it is the outlier, the others' aggregate is returned (``me`` in dropped)."""
    everyone = dict(parts)
    everyone[me] = own_values
    order = sorted(everyone)
    dropped: set[str] = set()
    if len(order) >= 3:
        for j in range(len(own_values)):
            xs = torch.stack([everyone[p][j] for p in order])
            dropped.update(order[i] for i in outliers(xs, outlier_factor, outlier_rms))
    if me in dropped and (quorum is None or len(order) < max(3, quorum) or len(dropped) > (len(order) - 1) // 2):
        dropped.discard(me)  # we can be judged only by a round that reached its quorum, and by a majority
    kept = [p for p in order if p not in dropped]
    clipped = False
    partners = [p for p in kept if p != me]
    if lone_bound is not None and cfg.aggregator != "mean" and len(order) == 2 and len(partners) == 1 \
            and asked >= 2:
        everyone[partners[0]], clipped = _bound_lone_partner(own_values, everyone[partners[0]], lone_bound)
    own = kept.index(me) if me in kept else None
    values = [aggregate(torch.stack([everyone[p][j] for p in kept]), cfg.aggregator, trim=cfg.trim,
                        clip_scale=cfg.clip_scale, clip_iters=cfg.clip_iters,
                        clip_start=cfg.clip_start if own is not None else "median", own=own)
              for j in range(len(own_values))]
    return values, sorted(dropped), clipped
