"""Robust aggregators (trainer/robust.py) against hand-computed values and the attacks of trainer/attacks.py."""

from __future__ import annotations

import pytest
import torch

from trainer import config as run_config
from trainer.attacks import ATTACKS, byzantine_part
from trainer.robust import (
    AGGREGATORS,
    CLIP_STARTS,
    aggregate,
    centered_clip,
    clip_radius,
    coordinate_median,
    outliers,
    trimmed_count,
    trimmed_mean,
)


def test_names_match_the_run_config():
    assert AGGREGATORS == run_config.AGGREGATORS and CLIP_STARTS == run_config.CLIP_STARTS
    with pytest.raises(ValueError, match="aggregator"):
        run_config.AveragingConfig(aggregator="median")
    with pytest.raises(ValueError, match="trim"):
        run_config.AveragingConfig(trim=0.5)
    with pytest.raises(ValueError, match="clip_start"):
        run_config.AveragingConfig(clip_start="zero")
    run = run_config.RunConfig.default().replace(averaging={"aggregator": "centered_clip", "clip_iters": 5})
    assert run_config.RunConfig.from_dict(run.to_dict()) == run


def test_trimmed_count_rounds_up_and_keeps_a_value():
    assert [trimmed_count(n, 0.25) for n in range(1, 10)] == [0, 0, 1, 1, 2, 2, 2, 2, 3]
    assert [trimmed_count(n, 0.0) for n in (1, 4, 8)] == [0, 0, 0]
    with pytest.raises(ValueError):
        trimmed_count(4, 0.5)


def test_hand_computed_values():
    xs = torch.tensor([[1.0, 5.0], [2.0, -1.0], [3.0, 2.0], [100.0, 3.0]])
    assert torch.equal(trimmed_mean(xs, 0.25), torch.tensor([2.5, 2.5]))  # drop min and max per coordinate
    assert torch.equal(coordinate_median(xs), torch.tensor([2.5, 2.5]))
    assert torch.equal(coordinate_median(xs[:3]), torch.tensor([2.0, 2.0]))
    assert torch.equal(trimmed_mean(xs, 0.0), xs.mean(0))
    # CenteredClip from 0 with tau 1 on [0, 0, 10]: +1/3, then z = [-1/3, -1/3, 29/3] -> +(-2/3 + 1)/3 = 1/9
    ys = torch.tensor([[0.0], [0.0], [10.0]])
    torch.testing.assert_close(centered_clip(ys, 1.0, 1, torch.zeros(1)), torch.tensor([1 / 3]))
    torch.testing.assert_close(centered_clip(ys, 1.0, 2, torch.zeros(1)), torch.tensor([4 / 9]))
    assert torch.equal(centered_clip(ys, 0.0, 3, torch.zeros(1)), torch.zeros(1))
    # a tau larger than every distance makes one iteration the plain mean
    torch.testing.assert_close(centered_clip(ys, 100.0, 1, torch.zeros(1)), ys.mean(0))
    # distances 5, 0, 10 from 0: median 5
    assert clip_radius(torch.tensor([[3.0, 4.0], [0.0, 0.0], [6.0, 8.0]]), torch.zeros(2), 2.0) == 10.0


def test_centered_clip_from_own_values_moves_at_most_iters_tau():
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(5, 50, generator=g)
    xs[3:] = 1e6  # two liars far away
    v = centered_clip(xs, 0.5, 4, xs[0])
    assert float((v - xs[0]).norm()) <= 4 * 0.5 + 1e-5
    own = aggregate(xs, "centered_clip", clip_start="own", own=0)
    assert float((own - xs[0]).norm()) <= 3 * clip_radius(xs, xs[0], 1.0) + 1e-4
    with pytest.raises(ValueError, match="own"):
        aggregate(xs, "centered_clip", clip_start="own")


def _honest(n: int, dim: int = 2000, seed: int = 0) -> torch.Tensor:
    """Replicas of one seeded init that drifted apart a little, as honest ones do."""
    g = torch.Generator().manual_seed(seed)
    base = 0.05 * torch.randn(dim, generator=g)
    return base + 0.002 * torch.randn(n, dim, generator=g)


def _attacked(n: int, f: int, attack: str) -> tuple[torch.Tensor, torch.Tensor]:
    honest = _honest(n - f)
    g = torch.Generator().manual_seed(1)
    bad = [byzantine_part(attack, honest[i % (n - f)], honest, generator=g) for i in range(f)]
    return torch.cat([honest, torch.stack(bad)]), honest.mean(0)


def _rel_err(v: torch.Tensor, ref: torch.Tensor) -> float:
    return float((v - ref).norm() / ref.norm())


@pytest.mark.parametrize("attack", ATTACKS)
@pytest.mark.parametrize(("n", "f"), [(4, 1), (8, 2)])
def test_robust_aggregators_stay_near_the_honest_mean_below_the_breakdown_point(attack: str, n: int, f: int):
    xs, ref = _attacked(n, f, attack)
    spread = float((xs[: n - f] - ref).norm(dim=1).max() / ref.norm())  # how far honest replicas are apart
    for kind in ("trimmed", "centered_clip"):
        err = _rel_err(aggregate(xs, kind), ref)
        assert err <= 1.5 * spread, (kind, attack, err, spread)
    if attack in ("zeros", "scale", "signflip"):
        assert _rel_err(aggregate(xs, "mean"), ref) >= 0.2  # the plain mean is moved by one liar


@pytest.mark.parametrize("attack", ["scale", "signflip"])
def test_half_byzantine_breaks_the_trimmed_mean(attack: str):
    xs, ref = _attacked(4, 2, attack)  # 2 of 4: above trimmed_count(4, 0.25) = 1
    assert _rel_err(aggregate(xs, "trimmed"), ref) > 0.2


def test_outliers_are_far_from_the_robust_centre():
    xs, _ = _attacked(4, 1, "zeros")
    assert outliers(xs, 4.0, 1e-4) == [3]
    xs, _ = _attacked(8, 2, "signflip")
    assert outliers(xs, 4.0, 1e-4) == [6, 7]
    assert outliers(_honest(5), 4.0, 1e-4) == []
    assert outliers(torch.stack([torch.zeros(10), torch.ones(10)]), 4.0, 0.0) == []  # two cannot tell who lies
    xs, _ = _attacked(8, 2, "alie")
    assert outliers(xs, 4.0, 1e-4) == []  # 'a little is enough' hides inside the honest spread, by design


def test_bad_inputs_raise():
    with pytest.raises(ValueError):
        aggregate(torch.zeros(3, 4), "median")
    with pytest.raises(ValueError):
        trimmed_mean(torch.zeros(3, 4, dtype=torch.int64), 0.25)
    with pytest.raises(ValueError):
        centered_clip(torch.zeros(3, 4), -1.0, 1, torch.zeros(4))
    with pytest.raises(ValueError):
        byzantine_part("alie", torch.zeros(4))
