"""tools/sync_sweep.py: the simulator's sweep of a method's learning rate, for either side of a comparison."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import sync_sweep

TINY = Path(__file__).resolve().parent / "runs" / "tiny.toml"


@pytest.mark.parametrize("method", ["fullsync", "asyncmesh"])
def test_a_sweep_trains_each_learning_rate_and_names_the_best(tmp_path, method):
    out = tmp_path / "sweep.json"
    assert sync_sweep.main(["--run", str(TINY), "--steps", "8", "--lrs", "0.001", "0.003", "--optimizers", "adamw",
                            "--eval-batches", "1", "--method", method, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["method"] == method and [r["lr"] for r in doc["results"]] == [0.001, 0.003]
    losses = [r["final_val_loss"] for r in doc["results"]]
    assert losses[0] != losses[1]  # the learning rate reached the method's optimiser
    assert doc["best"]["final_val_loss"] == min(losses)
    # fullsync runs the optimiser asked for; asyncmesh the run's own (NAdam in the tiny run), with its delays
    assert {r["optimizer"] for r in doc["results"]} == ({"adamw"} if method == "fullsync" else {"nadam"})
    assert ("tau" in doc) == (method == "asyncmesh")
