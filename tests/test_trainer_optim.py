"""Optimisers and schedules: lr warm-up/cosine/floor, stage-dependent beta1, optimiser types, clipping."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.config import OptimConfig
from trainer.optim import build_optimizer, clip_grad_norm, lr_at, stage_beta1


def test_lr_schedule_hand_values():
    cfg = OptimConfig(lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_at(cfg, 0) == pytest.approx(1 / 11)
    assert lr_at(cfg, 9) == pytest.approx(10 / 11)
    assert lr_at(cfg, 10) == pytest.approx(1.0)
    assert lr_at(cfg, 60) == pytest.approx(0.1 + 0.5 * (1 + math.cos(math.pi * 0.5)) * 0.9)  # 0.55
    assert lr_at(cfg, 109) == pytest.approx(0.1 + 0.5 * (1 + math.cos(math.pi * 0.99)) * 0.9)
    assert lr_at(cfg, 110) == pytest.approx(0.1)
    assert lr_at(cfg, 10_000) == pytest.approx(0.1)
    lrs = [lr_at(cfg, s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))  # monotone after warm-up
    with pytest.raises(ValueError):
        lr_at(cfg, -1)


def test_lr_no_warmup():
    cfg = OptimConfig(lr=2.0, warmup_steps=0, total_steps=4, min_lr_ratio=0.0)
    assert [lr_at(cfg, s) for s in range(5)] == pytest.approx([2.0, 1.0 + 2 ** -0.5, 1.0, 1.0 - 2 ** -0.5, 0.0])


def test_stage_beta1():
    stash = OptimConfig(beta1=0.95, weight_stashing=True)
    assert [stage_beta1(stash, s, 4) for s in range(4)] == [0.95] * 4
    nows = OptimConfig(weight_stashing=False, nows_beta1_first=0.99, nows_beta1_last=0.9)
    assert [stage_beta1(nows, s, 4) for s in range(4)] == pytest.approx([0.99, 0.96, 0.93, 0.9])
    assert stage_beta1(nows, 0, 1) == 0.9
    with pytest.raises(ValueError):
        stage_beta1(nows, 4, 4)


def test_build_optimizer_types_and_groups():
    w, b = torch.nn.Parameter(torch.ones(3, 3)), torch.nn.Parameter(torch.ones(3))
    nadam = build_optimizer([w, b], OptimConfig(weight_stashing=False), stage=0, n_stages=3)
    assert isinstance(nadam, torch.optim.NAdam)
    (group,) = nadam.param_groups  # decay on every parameter, as the AsyncPP code does
    assert group["params"] == [w, b] and group["weight_decay"] == 0.01
    assert group["betas"] == (0.99, 0.999) and group["decoupled_weight_decay"] and group["momentum_decay"] == 0.004
    last = build_optimizer([w, b], OptimConfig(weight_stashing=False), stage=2, n_stages=3)
    assert last.param_groups[0]["betas"] == (0.9, 0.999)
    adamw = build_optimizer([w, b], OptimConfig(optimizer="adamw", beta1=0.9), stage=0, n_stages=1)
    assert isinstance(adamw, torch.optim.AdamW) and adamw.param_groups[0]["betas"] == (0.9, 0.999)
    assert adamw.param_groups[0]["weight_decay"] == 0.01
    with pytest.raises(ValueError, match="no trainable"):
        build_optimizer([], OptimConfig(), 0, 1)


def test_clip_grad_norm():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    assert clip_grad_norm([p], 1.0) == pytest.approx(5.0)
    assert p.grad.norm().item() == pytest.approx(1.0, rel=1e-5)
    p.grad = torch.tensor([3.0, 4.0])
    assert clip_grad_norm([p], 0.0) == pytest.approx(5.0)
    assert torch.equal(p.grad, torch.tensor([3.0, 4.0]))
