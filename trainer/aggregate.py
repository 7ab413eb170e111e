"""The aggregation step of an averaging round: outliers dropped relative to the robust centre, then the run's
aggregator over one equal-weight contribution per replica. Pure math, shared by the daemon (peer/averaging/, one
contribution per authenticated peer id) and the simulator (trainer/sim/, one per replica).

The daemon's ``PartExchange`` has already checked every part on its own (shape, finite, distance from *our* values).
That check alone cannot refuse a zero part (its distance from our values is exactly our norm, inside the allowance)
nor scale a group of colluding parts down. Here all parts of the round are looked at together:

1. **Outliers.** A contribution with any tensor farther from the coordinate-wise median of all contributions (ours
   included) than ``outlier_factor`` times the median such distance plus ``outlier_rms * sqrt(numel)`` is dropped and
   counted (``rejected:avg_outlier``). Our own part is dropped too when it is the outlier of a round that reached
   its quorum (the caller passes it), with fewer than half of the parts dropped: then we are the one that is off
   (a state loaded from a lying donor, a slice a liar pulled away), and the others' aggregate replaces our slice
   instead of being mixed with it. Otherwise our own part is kept. With three or more contributions and fewer than
   half of them lying, the median and the median distance are set by honest parts, so zeros, scaled and sign-flipped
   parts are refused. With two, the centre is their midpoint and nothing can be told apart.
2. **A minority round is bounded.** With a robust aggregator, a round whose contributions (ours included) are fewer
   than the stage's full quorum, 2b + 1 with b = ``trimmed_count`` of the partners asked plus us (3 of 3-4, 5 of
   5-8), has the aggregate's pull on our values clipped per tensor to half ``lone_bound`` x our norm (a lone
   partner's difference from ours to ``lone_bound``). Liars that always answer make a larger share of a round the
   honest replicas did not all reach: in a real 8-replica stage with 2 sending zeros, rounds of 3 (us and both
   liars) zeroed half of an honest replica's weights at a time and its loss went back to the init's. ``AveragingLoop``
   refuses rounds below the quorum of the partners it *heard from* recently; this bound covers the rounds that pass
   that quorum but not the stage's, and the announced peers that never answer (which may not stop the others'
   averaging). Honest replicas are pulled together by every round and stay closer than the bound (5 %: a pull of
   2.5 %), counted as ``avg_pull_clipped`` when it binds. A pair by design (a stage of two replicas, a WAGMA pair)
   is averaged as it is: one liar among two is past any breakdown point.
3. **Aggregate.** The remaining contributions, one per peer id (a sender-chosen weight is never read), stacked in
   sorted id order. When every one of them lies within ``HONEST_FACTOR`` times the median distance from the
   coordinate-wise median (plus the same floor as the outlier check), nothing tells a liar apart and the round is
   honest as far as it can be told: the plain mean. Otherwise they go through ``run.averaging.aggregator``
   (trainer/robust.py: 'mean', 'trimmed', 'centered_clip'). A robust aggregator on honest parts is not free: with
   3 parts the trimmed mean is the coordinate-wise median, which does not keep the replicas' mean (the quantity
   averaging must preserve), and CenteredClip moves every part past the median distance. A liar that stays within
   the radius moves the mean by at most HONEST_FACTOR x the median distance / n in L2. Peers holding the same set of
   contributions compute the same bits (unless CenteredClip starts from each peer's own values).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from trainer.config import AveragingConfig
from trainer.robust import aggregate, coordinate_median, outliers, trimmed_count

OUTLIER_FACTOR = 4.0
"""The daemon's default outlier factor (peer/averaging/config.py), which the simulator uses too."""
OUTLIER_RMS = 0.01
"""The daemon's default per-coordinate allowance of the outlier check."""
HONEST_FACTOR = 2.0
"""Parts within this many median distances of the coordinate-wise median are averaged as they are (see above)."""
LONE_FLOOR_RMS = 1e-3
"""Per-coordinate rms added to a lone partner's bound, so that zero-initialised tensors (biases) still average; about
the int8 rounding of weights of rms 0.1 to 0.3."""


def _bound_pull(own: list[torch.Tensor], values: list[torch.Tensor], rel: float
                ) -> tuple[list[torch.Tensor], bool]:
    """``values`` with each tensor's difference from ``own`` clipped to ``rel`` x our norm (plus half
    ``LONE_FLOOR_RMS`` per coordinate); whether any was clipped."""
    out, clipped = [], False
    for o, v in zip(own, values, strict=True):
        limit = rel * float(o.norm()) + LONE_FLOOR_RMS / 2 * math.sqrt(max(1, o.numel()))
        d = v - o
        n = float(d.norm())
        if n > limit:
            v, clipped = o + d * (limit / n), True
        out.append(v)
    return out, clipped


def _all_near(xs: torch.Tensor, floor_rms: float) -> bool:
    """Whether every row lies within HONEST_FACTOR x the median row distance (plus ``floor_rms`` per coordinate) of
    the coordinate-wise median: an honest-looking set, whose plain mean is kept."""
    if xs.shape[0] < 3:
        return True  # two parts: nothing can be told apart, every aggregator is their mean
    d = (xs - coordinate_median(xs).unsqueeze(0)).reshape(xs.shape[0], -1).norm(dim=1)
    s = d.sort().values
    n = s.shape[0]
    med = float(s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2)
    return bool((d <= HONEST_FACTOR * med + floor_rms * math.sqrt(max(1, xs[0].numel()))).all())


def quorum_of(partners: int, trim: float) -> int:
    """Contributions (ours included) a round needs so that liars among ``partners`` and us stay within what the
    trimmed aggregate tolerates: 2b + 1, b = ``trimmed_count(partners + 1, trim)`` (3 of 3-4, 5 of 5-8)."""
    return 2 * trimmed_count(partners + 1, trim) + 1


def full_quorum(asked: int, trim: float) -> int:
    """The quorum of a round that all ``asked`` partners reached; 0 for a pair by design (one partner asked)."""
    return quorum_of(asked, trim) if asked >= 2 else 0


def robust_combine(me: str, own_values: list[torch.Tensor], parts: dict[str, list[torch.Tensor]],
                   cfg: AveragingConfig, *, outlier_factor: float, outlier_rms: float,
                   lone_bound: float | None = None, asked: int = 0, quorum: int | None = None,
                   alike: bool = False) -> tuple[list[torch.Tensor], list[str], bool]:
    """(the aggregate of our values and ``parts``, the peer ids dropped as outliers, whether the aggregate's pull was
    clipped); see the module docstring. With a robust aggregator and ``lone_bound``, a round with fewer
    contributions than ``full_quorum(asked)`` (``asked``: the partners asked) moves our values by at most half
    ``lone_bound`` x our norm per tensor: a pair by design (one partner asked) is averaged as it is. With ``quorum``
    (a round that reached it), our own part is judged like the others: if it is the outlier, the others' aggregate
    is returned (``me`` in dropped). ``alike``: our own part is judged exactly as the others are, whatever the
    quorum, so that every peer holding the same contributions drops the same ones (a barrier, whose replicas must
    all take the same step); at most a minority is dropped (more flagged, across tensors: none is)."""
    everyone = dict(parts)
    everyone[me] = own_values
    order = sorted(everyone)
    dropped: set[str] = set()
    if len(order) >= 3:
        for j in range(len(own_values)):
            xs = torch.stack([everyone[p][j] for p in order])
            dropped.update(order[i] for i in outliers(xs, outlier_factor, outlier_rms))
    minority = len(dropped) <= (len(order) - 1) // 2
    if alike and not minority:
        dropped = set()  # no majority to judge by (a liar copying a different part per tensor): everyone is kept
    judged = alike or (quorum is not None and len(order) >= max(3, quorum) and minority)
    if me in dropped and not judged:
        dropped.discard(me)  # we can be judged only by a round that reached its quorum, and by a majority
    kept = [p for p in order if p not in dropped]
    own = kept.index(me) if me in kept else None
    values = []
    for j in range(len(own_values)):
        xs = torch.stack([everyone[p][j] for p in kept])
        if cfg.aggregator == "mean" or _all_near(xs, outlier_rms):
            values.append(xs.mean(0))
        else:
            values.append(aggregate(xs, cfg.aggregator, trim=cfg.trim, clip_scale=cfg.clip_scale,
                                    clip_iters=cfg.clip_iters,
                                    clip_start=cfg.clip_start if own is not None else "median", own=own))
    clipped = False
    if lone_bound is not None and cfg.aggregator != "mean" and len(order) < full_quorum(asked, cfg.trim):
        values, clipped = _bound_pull(own_values, values, lone_bound / 2)
    return values, sorted(dropped), clipped


def barrier_mean(me: str, own_values: list[torch.Tensor], parts: dict[str, list[torch.Tensor]],
                 cfg: AveragingConfig, *, outlier_factor: float = OUTLIER_FACTOR, outlier_rms: float = OUTLIER_RMS,
                 ) -> tuple[list[torch.Tensor], list[str]]:
    """The synchronous barrier's aggregate of the replicas' gradients (the daemon's ``--mode sync`` and the
    simulator's ``fullsync``): a part far from the others is dropped as in a round (step 1 above), the rest is
    averaged with the plain mean, as the textbook baseline does (the run's aggregator is for weights, whose replicas
    lie close together; a trimmed mean of a few gradients would be a different, noisier estimator). Our own part is
    judged like every other, so the replicas that hold the same parts take the same step even when ours is the
    outlier (keeping it made that replica's weights fork from the others', found and repaired only at the next
    barrier by loading a replica's state). Returns the mean and the ids dropped (``me`` among them when ours was)."""
    values, dropped, _ = robust_combine(me, own_values, parts, dataclasses.replace(cfg, aggregator="mean"),
                                        outlier_factor=outlier_factor, outlier_rms=outlier_rms, alike=True)
    return values, dropped
