"""Robust averaging on a real swarm (tools/byzantine_swarm.py): the tool's plumbing, and one measured cell.

The fast tests check what the tool computes from its swarms' records (plan, run file, ratios, control spread, table,
JSON) without starting a peer. The slow one runs the tool's own swarm function for real: 4 replicas of the 1-stage
tiny run, a control with all four honest, then the fourth peer sending zeros (tools/byzantine_peer.py); it passes the
membership filter, so only the distance checks and the robust aggregate stand between it and the honest weights.
"""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools import byzantine_swarm as tool  # noqa: E402
from tools.byzantine_swarm import Swarm, format_table, one_stage_run, parse_grid, plan, summarise  # noqa: E402


def test_plan_runs_each_n_s_controls_right_before_its_attacks():
    swarms = plan(parse_grid("4:1,8:2,4:2"), ["zeros", "alie"], 2)
    assert [s.label for s in swarms] == [
        "4:0 control 1", "4:0 control 2", "4:1 zeros", "4:1 alie", "4:2 zeros", "4:2 alie",
        "8:0 control 1", "8:0 control 2", "8:2 zeros", "8:2 alie"]
    for bad in ("4:-1", "4:4", "1:1", "4"):
        with pytest.raises(ValueError):
            parse_grid(bad)
    # N:0 asks for the N's honest controls only (averaging measured at N replicas, no attack)
    assert [s.label for s in plan(parse_grid("2:0,4:0,4:1"), ["zeros"], 1)] == [
        "2:0 control 1", "4:0 control 1", "4:1 zeros"]


def test_one_stage_run_sets_the_stage_count_aggregator_and_its_own_name(tmp_path):
    run = tomllib.loads(one_stage_run(tool.TINY, "centered_clip", tmp_path).read_text())
    base = tomllib.loads(tool.TINY.read_text())
    assert run["n_stages"] == 1 and run["averaging"]["aggregator"] == "centered_clip"
    assert run["name"] != base["name"] and run["model"] == base["model"]
    assert {k: v for k, v in run["averaging"].items() if k != "aggregator"} == base["averaging"]
    faster = tomllib.loads(one_stage_run(tool.TINY, "trimmed", tmp_path, ("rounds_per_tick = 4", "period_s=1.0"))
                           .read_text())["averaging"]
    assert faster == base["averaging"] | {"aggregator": "trimmed", "rounds_per_tick": 4, "period_s": 1.0}


def _rec(label: str, n: int, b: int, attack: str | None, loss: float | None, **kw) -> dict:
    return {"label": label, "n": n, "byzantine": b, "attack": attack, "honest_val_loss": loss,
            "honest_window_steps_mean": 100.0, "honest_rounds_ok": 30 * (n - b), "honest_rounds_failed": n - b,
            "honest_avg_fraction_per_step": 0.01, "honest_rejected": {"rejected:avg_outlier": 7} if attack else {},
            "loadavg_1min": {"min": 1, "max": 2},
            **kw}


def test_ratios_are_to_the_mean_of_the_same_n_s_controls_with_their_spread():
    alie = [{"byzantine_parts": 10, "byzantine_parts_read": 25, "averaging_rounds_ok": 9,
             "averaging_rounds_failed": 1}]
    rows = summarise([_rec("c1", 4, 0, None, 2.0), _rec("c2", 4, 0, None, 2.2),
                      _rec("z", 4, 1, "zeros", 2.31), _rec("a", 4, 1, "alie", 2.1, attackers=alie),
                      _rec("e", 4, 1, "alie", None, error="peer2 gave no training state"),
                      _rec("c1", 8, 0, None, 1.9), _rec("z8", 8, 2, "zeros", 1.9)])
    assert rows[0]["control_spread"] == pytest.approx(0.2 / 2.1)
    assert rows[2]["ratio"] == pytest.approx(1.1) and rows[2]["ratio_range"] == pytest.approx([1.05, 1.155])
    assert "ratio" not in rows[4] and rows[5]["control_spread"] is None  # one control: no spread
    assert rows[6]["ratio"] == pytest.approx(1.0)
    table = format_table(rows)
    assert "| 4:1 | zeros | 2.310 | 1.100 (1.050-1.155) | 100 | 30 / 1 | 0.0100 | outlier 7 |" in table
    assert "spread 0.095" in table and "failed: 'peer2 gave no training state'" in table
    assert "| outlier 7 | 9 / 1 (read 2.5 parts per part) |" in table


def test_main_writes_every_record_and_the_table(tmp_path, monkeypatch, capsys):
    seen: list[Swarm] = []

    def fake(sw: Swarm, run: Path, workdir: Path, **kw) -> dict:
        assert tomllib.loads(run.read_text())["n_stages"] == 1 and kw["train_s"] == 5
        seen.append(sw)
        return _rec(sw.label, sw.n, sw.byzantine, sw.attack, 2.0 + 0.1 * sw.byzantine)

    monkeypatch.setattr(tool, "run_swarm", fake)
    out = tmp_path / "out.json"
    assert tool.main(["--grid", "4:1", "--attacks", "zeros,noise", "--train-s", "5", "--json", str(out),
                      "--workdir", str(tmp_path / "w")]) == 0
    data = json.loads(out.read_text())
    assert [r["label"] for r in data["records"]] == ["4:0 control 1", "4:0 control 2", "4:1 zeros", "4:1 noise"]
    assert data["cells"][2]["ratio"] == pytest.approx(1.05) and data["machine"]["nproc"] >= 1
    assert "| 4:1 | noise | 2.100 | 1.050" in capsys.readouterr().out


@pytest.mark.slow  # two swarms of 4 peers: about 3 minutes on 2 busy cores
@pytest.mark.timeout(900)
def test_one_byzantine_replica_of_four_keeps_the_honest_loss_near_the_control(tmp_path):
    run = one_stage_run(tool.TINY, "trimmed", tmp_path)
    recs = [tool.run_swarm(sw, run, tmp_path / f"swarm{i}", train_s=45.0, start_timeout_s=300.0)
            for i, sw in enumerate([Swarm(4, control_no=1), Swarm(4, 1, "zeros")])]
    for r in recs:
        assert "error" not in r, r["error"]
        assert all(p["exit_code"] == 0 for p in r["peers"]), r["peers"]
        assert r["honest_rounds_ok"] >= 3 * 3, r
    control, attacked = recs
    print(json.dumps(summarise(recs)))
    rejected = attacked["honest_rejected"]
    assert rejected.get("rejected:avg_outlier", 0) + rejected.get("rejected:avg_too_far", 0) >= 1, rejected
    ratio = attacked["honest_val_loss"] / control["honest_val_loss"]
    assert ratio < 1.10, (control["honest_val_loss"], attacked["honest_val_loss"])  # the target is 5 %; the margin
    # is the swarm's run-to-run noise
