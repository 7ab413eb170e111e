"""The round aggregation shared by the daemon and the simulator (trainer/aggregate.py) and what a clipped round
applies (trainer/rules.py)."""

from __future__ import annotations

import pytest
import torch

from trainer.aggregate import barrier_mean, robust_combine
from trainer.averaging import SparseAveragingState
from trainer.config import AveragingConfig


def _parts(n: int, seed: int = 0) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(500, generator=g), torch.randn(40, generator=g)]
    return {f"r{i}": [b + 0.05 * torch.randn(b.shape, generator=g) for b in base] for i in range(n)}


def test_honest_round_keeps_the_replicas_mean():
    """Three honest parts: the trimmed mean would be the coordinate median; the round keeps their mean."""
    for aggregator in ("trimmed", "centered_clip"):
        parts = _parts(3)
        own = parts.pop("r0")
        values, dropped, clipped = robust_combine("r0", own, parts, AveragingConfig(aggregator=aggregator),
                                                  outlier_factor=4.0, outlier_rms=0.01)
        assert dropped == [] and not clipped
        for j, v in enumerate(values):
            mean = torch.stack([own[j], parts["r1"][j], parts["r2"][j]]).mean(0)
            assert torch.allclose(v, mean, atol=1e-6)
            median = torch.stack([own[j], parts["r1"][j], parts["r2"][j]]).median(0).values
            assert not torch.allclose(v, median, atol=1e-3)


def test_the_barrier_drops_the_same_parts_at_every_replica_and_never_a_majority():
    parts = _parts(4)
    parts["r2"] = [20 * t for t in parts["r2"]]  # r2's flush went wrong: every replica drops it, r2 too
    means = {}
    for me in parts:
        others = {p: v for p, v in parts.items() if p != me}
        means[me], dropped = barrier_mean(me, parts[me], others, AveragingConfig())
        assert dropped == ["r2"]
    for j in range(2):
        expected = torch.stack([parts[p][j] for p in ("r0", "r1", "r3")]).mean(0)
        assert all(torch.equal(means[me][j], means["r0"][j]) for me in parts)  # the same bits everywhere
        torch.testing.assert_close(means["r2"][j], expected)
    # a liar copying a different honest part per tensor flags both honest replicas (each is far from the median
    # on one tensor): no majority to judge by, so nothing is dropped rather than everything but the liar
    honest = _parts(2, seed=1)
    liar = [honest["r0"][0].clone(), honest["r1"][1].clone()]
    three = {**honest, "z": liar}
    for me in three:
        mean, dropped = barrier_mean(me, three[me], {p: v for p, v in three.items() if p != me}, AveragingConfig())
        assert dropped == []
        for j in range(2):
            torch.testing.assert_close(mean[j], torch.stack([three[p][j] for p in sorted(three)]).mean(0))


def test_a_liar_still_meets_the_robust_aggregator():
    parts = _parts(4, seed=1)
    own = parts.pop("r0")
    parts["r3"] = [p * 1.6 for p in parts["r3"]]  # past the honest radius, short of the outlier bound
    values, dropped, _ = robust_combine("r0", own, parts, AveragingConfig(aggregator="trimmed"),
                                        outlier_factor=1000.0, outlier_rms=0.01)
    assert dropped == []
    stacked = torch.stack([own[0], parts["r1"][0], parts["r2"][0], parts["r3"][0]])
    assert torch.allclose(values[0], stacked.sort(dim=0).values[1:3].mean(0))  # trimmed, not the mean
    assert not torch.allclose(values[0], stacked.mean(0), atol=1e-3)


def test_a_clipped_round_moves_the_weights_by_the_pull_only():
    """EMA rule: an ordinary round writes a + lam e; a bounded one writes a + this round's drift and leaves e."""
    cfg = AveragingConfig(rule="ema", fraction=1.0, mu_start=0.5)
    w = [torch.zeros(4)]
    state = SparseAveragingState(cfg, 100, 0, 0, w)
    state.ema[0].fill_(3.0)  # a drift estimate from earlier rounds
    state.begin(0, w)
    w[0] += 1.0
    pull = torch.full((4,), 0.01)
    state.finish(0, [pull.clone()], w, 0, bounded=True)
    assert w[0].tolist() == pytest.approx([1.01] * 4)  # W_now + the pull, not pull + e
    assert state.ema[0].tolist() == [3.0] * 4
    state.begin(1, w)
    w[0] += 1.0
    state.finish(1, [torch.full((4,), 1.01)], w, 0)
    assert w[0].tolist() == pytest.approx([1.01 + 2.0] * 4)  # e <- 0.5 * 3 + 0.5 * 1 = 2; W <- a + e
