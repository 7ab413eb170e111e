"""The smoke preset end to end through the CLI: every method runs, writes its outputs, and learns."""

from __future__ import annotations

import csv
import json

import pytest

from peer.cli import main


@pytest.mark.timeout(300)  # ~20 s on an idle 2-core machine; generous for a loaded CI runner
def test_smoke_preset_writes_outputs_and_every_method_learns(tmp_path, capsys):
    out = tmp_path / "sim"
    assert main(["simulate", "--preset", "smoke", "--out", str(out)]) == 0
    for name in ("results.json", "curves.csv", "curves.png", "table.md"):
        assert (out / name).stat().st_size > 0, name
    doc = json.loads((out / "results.json").read_text())
    methods = doc["methods"]
    assert set(methods) == {"fullsync", "naive-async", "asyncpp", "asyncpp-nows", "asyncmesh", "async-sparta",
                            "delta", "full-avg", "wagma", "accum"}
    assert doc["config"]["preset"] == "smoke"
    for name, m in methods.items():
        assert m["final_val_loss"] < m["first_val_loss"] - 0.05, f"{name} did not learn: {m}"
        assert m["final_val_loss"] < 5.0, name  # log(256) = 5.55 is a uniform guess
    assert len({m["samples"] for m in methods.values()}) == 1  # equal samples
    assert len({tuple(m["data_digests"]) for m in methods.values()}) == 1  # ... and the very same token batches
    assert methods["fullsync"]["ratio_to_fullsync"] == pytest.approx(1.0)
    assert methods["fullsync"]["updates"] * 4 == methods["asyncpp"]["updates"]  # M = 4 micro-batches per step
    assert methods["accum"]["updates"] * 2 == methods["asyncpp"]["updates"]  # A = 2
    assert all(m["wallclock_s"] > 0 for m in methods.values())
    with open(out / "curves.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["method"] for r in rows} == set(methods)
    assert "| asyncmesh |" in (out / "table.md").read_text()
    printed = capsys.readouterr().out
    assert "speedup" in printed and "asyncmesh" in printed
    # the outputs can be re-rendered from results.json alone (curves included)
    (out / "curves.png").unlink()
    assert main(["simulate", "--report-only", "--no-wallclock", "--out", str(out)]) == 0
    assert (out / "curves.png").exists()
    again = json.loads((out / "results.json").read_text())["methods"]
    assert {n: m["final_val_loss"] for n, m in again.items()} == {n: m["final_val_loss"] for n, m in methods.items()}


def test_report_only_needs_a_results_file(tmp_path, capsys):
    assert main(["simulate", "--report-only", "--out", str(tmp_path)]) == 2
    assert "run simulate first" in capsys.readouterr().err


def test_cli_rejects_bad_tau_with_a_message(tmp_path, capsys):
    assert main(["simulate", "--preset", "smoke", "--out", str(tmp_path), "--tau", "x"]) == 2
    assert "--tau takes integers" in capsys.readouterr().err


def test_cli_rejects_unknown_methods(tmp_path, capsys):
    assert main(["simulate", "--out", str(tmp_path), "--methods", "fullsync,nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_compression_flags_set_each_codec():
    from peer.cli import build_parser
    from peer.cli.simulate import build_config

    def codecs(*flags: str) -> tuple[str, str, str]:
        args = build_parser().parse_args(["simulate", "--out", "/tmp/x", *flags])
        c = build_config(args).run.compression
        return c.activations, c.gradients, c.averaging

    assert codecs("--compression", "int8") == ("int8", "int8", "none")
    assert codecs("--compression", "int8", "--grad-compression", "none") == ("int8", "none", "none")
    assert codecs("--grad-compression", "int8") == ("none", "int8", "none")
    assert codecs("--avg-compression", "int8") == ("none", "none", "int8")


def test_sim_variant_tool_trains_an_ad_hoc_variant(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tools" / "sim_variant.py"
    spec = importlib.util.spec_from_file_location("sim_variant", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    try:
        assert tool.main(["--preset", "smoke", "--steps", "16", "--eval-every", "8", "--rule", "avg",
                          "--fraction", "1", "--tau", "0", "--optimizer", "adamw", "--beta1", "0.9"]) == 0
    finally:
        from trainer.sim.methods import METHODS

        METHODS.pop(tool.NAME, None)
    losses = [float(v) for v in capsys.readouterr().out.split()]
    assert len(losses) == 2 and losses[1] < losses[0] < 5.2  # two evaluations, learning from the uniform 5.55
