"""Byzantine averaging contributions, for measuring robust aggregation (the simulator and red-team tests).

Each attack maps what an honest replica would send to what a Byzantine one sends instead. None of this runs in an
honest peer: it exists so the defences in trainer/robust.py are measured against the attacks of the literature.

* ``zeros``: a zero part (the sybil attack that shrank a partition towards 0 on the unprotected mean).
* ``scale``: the own values times -10.
* ``signflip``: the own values negated.
* ``noise``: the own values plus Gaussian noise of ``noise_ratio`` times their rms.
* ``alie``: "a little is enough" (Baruch et al. 2019): per coordinate, the honest mean shifted by ``-z`` honest
  standard deviations; every Byzantine replica sends the same vector. It needs the honest contributions (an
  omniscient attacker); z 1.0 is stronger than the paper's z_max for 4 or 8 replicas (0.0 and 0.32).
"""

from __future__ import annotations

import torch

ATTACKS = ("zeros", "scale", "signflip", "noise", "alie")


def byzantine_part(kind: str, own: torch.Tensor, honest: torch.Tensor | None = None, *, z: float = 1.0,
                   noise_ratio: float = 3.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """The part a Byzantine replica sends instead of ``own``; ``honest`` ([n_h, ...], the honest parts) for 'alie'."""
    if kind == "zeros":
        return torch.zeros_like(own)
    if kind == "scale":
        return own * -10.0
    if kind == "signflip":
        return -own
    if kind == "noise":
        rms = float(own.pow(2).mean().sqrt()) if own.numel() else 0.0
        noise = torch.randn(own.shape, generator=generator, dtype=own.dtype)
        return own + noise_ratio * rms * noise
    if kind == "alie":
        if honest is None or honest.shape[0] < 1 or honest.shape[1:] != own.shape:
            raise ValueError("'alie' needs the honest parts stacked as [n_h, *own.shape]")
        std = honest.std(0, unbiased=False) if honest.shape[0] > 1 else torch.zeros_like(own)
        return honest.mean(0) - z * std
    raise ValueError(f"attack must be one of {ATTACKS}, got {kind!r}")
