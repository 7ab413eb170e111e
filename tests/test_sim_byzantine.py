"""Byzantine replicas in the simulator: the plain mean is wrecked by one liar of four, the robust aggregators not."""

from __future__ import annotations

import dataclasses
import math

import pytest

from trainer.sim.presets import preset, with_overrides
from trainer.sim.simulator import SimConfig, run_method


def _loss(sim: SimConfig) -> float:
    return run_method(sim, "asyncmesh", "asyncmesh", sim.tau)["final_val_loss"]


def test_byzantine_settings_are_validated():
    with pytest.raises(ValueError, match="byzantine"):
        dataclasses.replace(preset("smoke"), n_replicas=4, byzantine=4)
    with pytest.raises(ValueError, match="attack"):
        dataclasses.replace(preset("smoke"), n_replicas=4, byzantine=1, attack="bribe")


@pytest.mark.timeout(900)  # ~20 s of CPU; minutes on a loaded shared machine
def test_one_scaling_replica_of_four_is_dropped_as_an_outlier_whatever_the_aggregator():
    """The simulator combines parts with the daemon's round aggregation (trainer/aggregate.py): the x-10 part is far
    from the robust centre and dropped before any aggregator runs, so even 'mean' holds."""
    base = with_overrides(preset("smoke"), replicas=4, steps=32, methods=("asyncmesh",))
    control = _loss(with_overrides(base, aggregator="trimmed"))
    attacked = dataclasses.replace(base, byzantine=1, attack="scale")
    robust = _loss(with_overrides(attacked, aggregator="trimmed"))
    plain = _loss(with_overrides(attacked, aggregator="mean"))
    assert robust / control < 1.05, (control, robust)
    assert math.isfinite(plain) and plain / control < 1.05, (control, plain)
