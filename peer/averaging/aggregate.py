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
2. **Aggregate.** The remaining contributions, one per peer id (a sender-chosen weight is never read), stacked in
   sorted id order, go through ``run.averaging.aggregator`` (trainer/robust.py: 'mean', 'trimmed',
   'centered_clip'). Peers holding the same set of contributions compute the same bits (unless CenteredClip starts
   from each peer's own values).
"""

from __future__ import annotations

import torch

from trainer.config import AveragingConfig
from trainer.robust import aggregate, outliers


def robust_combine(me: str, own_values: list[torch.Tensor], parts: dict[str, list[torch.Tensor]],
                   cfg: AveragingConfig, *, outlier_factor: float, outlier_rms: float,
                   ) -> tuple[list[torch.Tensor], list[str]]:
    """(the aggregate of our values and ``parts``, the peer ids dropped as outliers); see the module docstring."""
    everyone = dict(parts)
    everyone[me] = own_values
    order = sorted(everyone)
    dropped: set[str] = set()
    if len(order) >= 3:
        for j in range(len(own_values)):
            xs = torch.stack([everyone[p][j] for p in order])
            dropped.update(order[i] for i in outliers(xs, outlier_factor, outlier_rms) if order[i] != me)
    kept = [p for p in order if p not in dropped]
    own = kept.index(me)
    values = [aggregate(torch.stack([everyone[p][j] for p in kept]), cfg.aggregator, trim=cfg.trim,
                        clip_scale=cfg.clip_scale, clip_iters=cfg.clip_iters, clip_start=cfg.clip_start, own=own)
              for j in range(len(own_values))]
    return values, sorted(dropped)
