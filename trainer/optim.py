"""Per-stage optimisers and the learning-rate schedule.

'nadam' is the AsyncPP look-ahead: ``torch.optim.NAdam`` with decoupled weight decay and beta1 0.99, whose
(1 - mu_t)-discounted gradient term and mu_{t+1} look-ahead are exactly the paper's Nesterov correction for stale
gradients (see docs/design.md); ``momentum_decay`` is kept as its built-in momentum warm-up. 'adamw' is the synchronous
baseline's optimiser. Weight decay applies to every parameter of the stage, as the AsyncPP/AsyncMesh code does
(``NAdamWithWeightStashing(r.master_parameters, ...)``), not nanoGPT's matrices-only grouping.

Without weight stashing the paper's No-WS variant uses a stage-dependent beta1: ``nows_beta1_first`` at stage 0 (the
largest delay), linearly down to ``nows_beta1_last`` at the last stage (no delay).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from trainer.config import OptimConfig


def stage_beta1(cfg: OptimConfig, stage: int, n_stages: int) -> float:
    """beta1 of ``stage``: ``cfg.beta1`` with stashing, else linear from nows_beta1_first to nows_beta1_last."""
    if not 0 <= stage < n_stages:
        raise ValueError(f"stage must be in [0, {n_stages}), got {stage}")
    if cfg.weight_stashing:
        return cfg.beta1
    if n_stages == 1:
        return cfg.nows_beta1_last
    frac = stage / (n_stages - 1)
    return cfg.nows_beta1_first + frac * (cfg.nows_beta1_last - cfg.nows_beta1_first)


def lr_at(cfg: OptimConfig, step: int) -> float:
    """Learning rate for local optimiser step ``step`` (0-based).

    Linear warm-up ``lr * (step + 1) / (warmup_steps + 1)`` for ``step < warmup_steps``, then cosine from ``lr`` to
    ``min_lr_ratio * lr`` at ``step == total_steps``, constant after (nanoGPT's schedule).
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    min_lr = cfg.min_lr_ratio * cfg.lr
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    if step >= cfg.total_steps:
        return min_lr
    ratio = (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.lr - min_lr)


def build_optimizer(
    params: Iterable[torch.Tensor], cfg: OptimConfig, stage: int, n_stages: int
) -> torch.optim.Optimizer:
    """The stage's optimiser over all its trainable parameters; the caller sets the scheduled lr before each step."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("build_optimizer got no trainable parameters")
    betas = (stage_beta1(cfg, stage, n_stages), cfg.beta2)
    lr, wd = lr_at(cfg, 0), cfg.weight_decay
    if cfg.optimizer == "nadam":
        return torch.optim.NAdam(params, lr=lr, betas=betas, eps=cfg.eps, weight_decay=wd,
                                 momentum_decay=cfg.momentum_decay, decoupled_weight_decay=True)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=cfg.eps, weight_decay=wd)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}; use 'nadam' or 'adamw'")


MOMENT_KEYS = frozenset({"step", "exp_avg", "exp_avg_sq", "mu_product"})
"""Per-parameter optimiser state an AdamW or NAdam step keeps; anything else in a loaded state is refused."""


def moment_bound(beta1: float, beta2: float) -> float:
    """The largest |m| / sqrt(v) exponential averages with these betas reach on any gradients (Cauchy-Schwarz):
    sqrt((1 - b1)^2 / ((1 - b2) (1 - b1^2 / b2)))."""
    return math.sqrt((1 - beta1) ** 2 / ((1 - beta2) * (1 - beta1**2 / beta2)))


def moments_refused(entry: object, beta1: float, beta2: float) -> str | None:
    """Why one parameter's optimiser state is none an AdamW / NAdam with these betas holds, or None. A state whose
    first moment exceeds what the second allows (v = 0 under m != 0, say) makes a step of any size."""
    if not isinstance(entry, dict) or not set(entry) <= MOMENT_KEYS:
        return "is not an AdamW or NAdam state"
    m, v, n, mu = (entry.get(k) for k in ("exp_avg", "exp_avg_sq", "step", "mu_product"))
    if not isinstance(m, torch.Tensor) or not isinstance(v, torch.Tensor) or not isinstance(n, torch.Tensor):
        return "lacks its moments"
    if m.shape != v.shape or n.numel() != 1 or not float(n) >= 1:
        return "is malformed (moments of two shapes, or a step count below 1)"
    bound = moment_bound(beta1, beta2) * 1.001
    if not bool((v >= 0).all()) or not bool((m.abs() <= bound * v.sqrt() + 1e-12).all()):
        return "holds moments that exponential averages of gradients never reach (|m| > c sqrt(v))"
    if mu is not None and not (isinstance(mu, torch.Tensor) and mu.numel() == 1 and 0 < float(mu) <= 1):
        return "holds a momentum product outside (0, 1]"
    return None


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> float:
    """Clip this stage's gradient norm to ``max_norm`` (0 disables); returns the norm before clipping."""
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return 0.0
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(with_grad, max_norm))
    return float(torch.nn.utils.get_total_norm([p.grad for p in with_grad if p.grad is not None]))
