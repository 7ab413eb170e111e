"""tools/witness_drift.py: honest replicas' distances as the witnesses read them, under the fixed floor and the
floors of the tensors that start at zero, from a short simulated run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from peer.state.digest import FLOOR_LR_STEPS, RMS_FLOOR
from tools.witness_drift import distance, floor_of

REPO = Path(__file__).resolve().parent.parent


def test_the_floor_of_a_bias_follows_the_learning_rate_and_a_weights_stays_fixed():
    assert floor_of("blocks.0.attn.c_attn.bias", FLOOR_LR_STEPS, 1e-3) == pytest.approx(FLOOR_LR_STEPS * 1e-3)
    assert floor_of("blocks.0.attn.c_attn.weight", FLOOR_LR_STEPS, 1e-3) == RMS_FLOOR
    assert floor_of("ln_f.bias", None, 1e-3) == RMS_FLOOR
    a = torch.zeros(100)
    assert distance(a, a + 0.01, 0.02) == pytest.approx(0.5) and distance(a, a + 0.01, RMS_FLOOR) == pytest.approx(1.0)


@pytest.mark.timeout(120)
def test_a_short_run_writes_every_floors_distances_and_what_a_liar_could_do(tmp_path):
    out = tmp_path / "drift.json"
    subprocess.run([sys.executable, str(REPO / "tools" / "witness_drift.py"), "--run", "tests/runs/tiny.toml",
                    "--steps", "40", "--eval-every", "20", "--json", str(out)], cwd=REPO, check=True,
                   capture_output=True, timeout=110)
    doc = json.loads(out.read_text())
    assert set(doc["zero_init_floors"]) == {"fixed", "10x_lr", f"{FLOOR_LR_STEPS:g}x_lr", "30x_lr"}
    assert len(doc["points"]) == 2 and all(p["floors"]["fixed"]["max"] > 0 for p in doc["points"])
    # a larger floor never reads a pair of replicas as further apart
    for p in doc["points"]:
        assert p["floors"]["30x_lr"]["max"] <= p["floors"]["fixed"]["max"] + 1e-9
    pushed = doc["val_loss_pushed_to_tolerance"]["fixed"]
    assert pushed["every_tensor"] > 0 and pushed["zero_init_only"] > 0
