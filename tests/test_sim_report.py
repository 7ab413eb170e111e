"""Output writers and re-rendering: results.json round-trips, runs merge only when their configs agree."""

from __future__ import annotations

import json

import pytest

from peer.cli import main
from peer.errors import UserError
from trainer.sim.presets import preset, with_overrides
from trainer.sim.report import load_results, write_outputs


def record(name: str, loss: float) -> dict:
    curve = [{"samples": 64, "train_loss": loss + 1.0, "val_loss": loss + 0.5},
             {"samples": 128, "train_loss": loss + 0.2, "val_loss": loss}]
    return {"name": name, "method": name, "tau": None, "summary": name, "final_val_loss": loss,
            "first_val_loss": loss + 0.5, "final_train_loss": loss + 0.2, "samples": 128, "updates": 16,
            "averaging_rounds_applied": 0, "steps_skipped": 0, "compute_s": 1.0, "data_digests": ["a", "b"],
            "curve": curve}


def test_outputs_round_trip_and_ratios(tmp_path):
    sim = with_overrides(preset("smoke"), methods=("fullsync", "asyncmesh"))
    write_outputs(tmp_path, sim.to_dict(), [record("fullsync", 2.0), record("asyncmesh", 1.9)])
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["methods"]["asyncmesh"]["ratio_to_fullsync"] == pytest.approx(0.95)
    assert "| asyncmesh | 1.9000 | 0.950 |" in (tmp_path / "table.md").read_text()
    assert (tmp_path / "curves.csv").read_text().splitlines()[0] == "method,samples,train_loss,val_loss"
    config, records = load_results(tmp_path / "results.json")
    assert [r["name"] for r in records] == ["fullsync", "asyncmesh"] and records[1]["curve"][1]["val_loss"] == 1.9


def test_merge_adds_methods_of_a_run_with_the_same_config(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    base = preset("smoke")
    write_outputs(a, with_overrides(base, methods=("fullsync",)).to_dict(), [record("fullsync", 2.0)])
    write_outputs(b, with_overrides(base, methods=("wagma",)).to_dict(), [record("wagma", 2.2)])
    assert main(["simulate", "--report-only", "--no-wallclock", "--out", str(a), "--merge", str(b)]) == 0
    doc = json.loads((a / "results.json").read_text())
    assert list(doc["methods"]) == ["fullsync", "wagma"] and doc["config"]["methods"] == ["fullsync", "wagma"]
    write_outputs(c, with_overrides(base, methods=("wagma",), tau=7).to_dict(), [record("wagma", 2.2)])
    with pytest.raises(UserError, match="differs in \\['tau'\\]"):
        from peer.cli.simulate import _report_only

        _report_only(a, [c], wallclock=False)


def test_without_matplotlib_every_output_but_the_plot_is_written(tmp_path, monkeypatch, caplog):
    import builtins
    import sys

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kw):
        if name.split(".")[0] == "matplotlib":
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kw)

    for mod in [m for m in sys.modules if m.split(".")[0] == "matplotlib"]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    sim = with_overrides(preset("smoke"), methods=("fullsync",))
    write_outputs(tmp_path, sim.to_dict(), [record("fullsync", 2.0)])
    assert not (tmp_path / "curves.png").exists()
    assert all((tmp_path / f).exists() for f in ("results.json", "curves.csv", "table.md"))
    assert "pip install 'asyncmesh[sim]'" in caplog.text
