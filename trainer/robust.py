"""Robust aggregation of same-stage contributions: what a replica does with parts that may come from attackers.

Every function here is pure (tensors in, tensors out) and takes the contributions as a stacked tensor ``xs`` of shape
``[n, ...]``, one row per contributor, so the daemon and the simulator aggregate the very same way. All of them are
independent of the row order apart from float summation order; callers stack in a fixed order (sorted peer ids) so
two peers holding the same set compute the same bits.

**Breakdown points** (the largest fraction of arbitrary, colluding contributions that cannot move the result
arbitrarily far; n contributions, f of them Byzantine):

* ``mean``: 0. One contribution moves it anywhere (x-10 scaling, a sign flip, zeros all pass through).
* ``trimmed`` (coordinate-wise trimmed mean dropping ``b = trimmed_count(n, trim)`` values at each end of every
  coordinate): b / n, at most ``(n - 1) // 2`` of n, i.e. just under 1/2. For f <= b every coordinate of the result
  lies within the range of the honest values of that coordinate (each of the n - 2b kept values is bracketed by
  honest ones), so scaling, sign flips, zeros and noise are bounded by the honest spread. "A little is enough"
  (Baruch et al. 2019) hides inside that spread by design and biases the result by up to the honest spread.
* ``centered_clip`` (Karimireddy et al. 2021, as used by BTARD, Gorbunov et al. 2021): ``v <- v + mean_i clip(x_i -
  v, tau)`` for ``iters`` iterations, with ``clip(z, tau) = z * min(1, tau / |z|)`` (L2 over the whole tensor). Each
  iteration lets the f Byzantine rows move v by at most ``f * tau / n`` (their clipped terms), so over L iterations
  their total pull is at most ``L * f * tau / n`` (in L2) whatever they send. Started from the coordinate-wise median
  (breakdown floor((n-1)/2) of n) and with the adaptive ``tau = scale * median_i |x_i - v0|`` (a median of
  distances: set by honest rows while f < n/2), the breakdown point is just under 1/2 as for the median; below it the
  damage is the bounded pull above. Started from the peer's own values the result is never farther than ``L * tau``
  from them, whatever everybody else sends (useful when n is 2 and nothing can tell who lies).

With fewer than three contributions no aggregator can tell an honest from a dishonest one: ``trimmed`` then equals the
mean, and only the distance checks in front of it (and ``centered_clip`` from the own values) bound the damage.
"""

from __future__ import annotations

import math

import torch

AGGREGATORS = ("mean", "trimmed", "centered_clip")
CLIP_STARTS = ("median", "own")


def _check(xs: torch.Tensor) -> None:
    if xs.dim() < 1 or xs.shape[0] < 1:
        raise ValueError(f"need a stacked tensor [n, ...] with n >= 1, got shape {tuple(xs.shape)}")
    if not xs.is_floating_point():
        raise ValueError(f"contributions must be floating point, got {xs.dtype}")


def mean(xs: torch.Tensor) -> torch.Tensor:
    """The plain mean over rows (breakdown point 0)."""
    _check(xs)
    return xs.mean(0)


def trimmed_count(n: int, trim: float) -> int:
    """Values dropped at *each* end of every coordinate for n contributions: ``ceil(trim * n)``, capped so at least
    one value stays (``(n - 1) // 2``). trim 0.25 drops 0 of 2, 1 of 3 or 4, 2 of 5 to 8, 3 of 9 to 12."""
    if not 0.0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim}")
    if n < 1:
        raise ValueError(f"need at least one contribution, got {n}")
    return min(math.ceil(trim * n - 1e-9), (n - 1) // 2)


def trimmed_mean(xs: torch.Tensor, trim: float) -> torch.Tensor:
    """Coordinate-wise trimmed mean: per coordinate, drop the ``trimmed_count(n, trim)`` smallest and largest values
    and average the rest. Breakdown point ``trimmed_count(n, trim) / n``."""
    _check(xs)
    n = xs.shape[0]
    b = trimmed_count(n, trim)
    if b == 0:
        return xs.mean(0)
    kept = xs.sort(dim=0).values[b:n - b]
    return kept.mean(0)


def coordinate_median(xs: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise median; for an even count the mean of the two middle values (breakdown floor((n-1)/2) of n)."""
    _check(xs)
    n = xs.shape[0]
    s = xs.sort(dim=0).values
    if n % 2:
        return s[n // 2].clone()
    return (s[n // 2 - 1] + s[n // 2]) / 2


def _row_norms(z: torch.Tensor) -> torch.Tensor:
    norms: torch.Tensor = z.reshape(z.shape[0], -1).norm(dim=1)
    return norms


def clip_radius(xs: torch.Tensor, start: torch.Tensor, scale: float) -> float:
    """Adaptive tau: ``scale`` times the median L2 distance of the rows from ``start`` (set by honest rows while
    fewer than half are Byzantine)."""
    _check(xs)
    if scale <= 0:
        raise ValueError(f"scale must be positive, got {scale}")
    d = _row_norms(xs - start.unsqueeze(0)).sort().values
    n = d.shape[0]
    med = d[n // 2] if n % 2 else (d[n // 2 - 1] + d[n // 2]) / 2
    return scale * float(med)


def centered_clip(xs: torch.Tensor, tau: float, iters: int, start: torch.Tensor) -> torch.Tensor:
    """CenteredClip: from ``start``, ``iters`` times ``v <- v + mean_i clip(x_i - v, tau)`` with ``clip(z, tau) = z *
    min(1, tau / |z|_2)`` per row. tau 0 returns ``start``. See the module docstring for the breakdown point."""
    _check(xs)
    if tau < 0 or not math.isfinite(tau):
        raise ValueError(f"tau must be finite and >= 0, got {tau}")
    if iters < 0:
        raise ValueError(f"iters must be >= 0, got {iters}")
    if start.shape != xs.shape[1:]:
        raise ValueError(f"start has shape {tuple(start.shape)}, rows have {tuple(xs.shape[1:])}")
    v = start.to(xs.dtype).clone()
    if tau == 0:
        return v
    extra = (1,) * (xs.dim() - 1)
    for _ in range(iters):
        z = xs - v.unsqueeze(0)
        norms = _row_norms(z)
        factor = torch.clamp(tau / norms.clamp_min(1e-30), max=1.0).reshape(-1, *extra)
        v = v + (z * factor).mean(0)
    return v


def aggregate(xs: torch.Tensor, kind: str, *, trim: float = 0.25, clip_scale: float = 1.0, clip_iters: int = 3,
              clip_start: str = "median", own: int | None = None) -> torch.Tensor:
    """One tensor's aggregate under the run's ``kind`` (see AGGREGATORS); ``own`` is our row (for clip_start 'own')."""
    if kind == "mean":
        return mean(xs)
    if kind == "trimmed":
        return trimmed_mean(xs, trim)
    if kind == "centered_clip":
        if clip_start == "median":
            start = coordinate_median(xs)
        elif clip_start == "own":
            if own is None or not 0 <= own < xs.shape[0]:
                raise ValueError(f"clip_start 'own' needs the own row index, got {own}")
            start = xs[own]
        else:
            raise ValueError(f"clip_start must be one of {CLIP_STARTS}, got {clip_start!r}")
        return centered_clip(xs, clip_radius(xs, start, clip_scale), clip_iters, start)
    raise ValueError(f"aggregator must be one of {AGGREGATORS}, got {kind!r}")


def outliers(xs: torch.Tensor, factor: float, floor_rms: float) -> list[int]:
    """Rows implausibly far from the robust centre (the coordinate-wise median): L2 distance above ``factor`` times
    the median row distance plus ``floor_rms * sqrt(numel)`` (the floor lets honest rows that differ only by
    quantisation noise through when the others agree exactly). With two rows the centre is their midpoint and
    nothing is flagged: two contributions cannot tell who lies."""
    _check(xs)
    if factor < 1 or floor_rms < 0:
        raise ValueError(f"factor must be >= 1 and floor_rms >= 0, got {factor}, {floor_rms}")
    centre = coordinate_median(xs)
    d = _row_norms(xs - centre.unsqueeze(0))
    s = d.sort().values
    n = s.shape[0]
    med = float(s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2)
    bound = factor * med + floor_rms * math.sqrt(max(1, xs[0].numel()))
    return [i for i in range(n) if float(d[i]) > bound]
