"""tools/bench_codecs.py runs end to end and writes the documented JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

TOOL = Path(__file__).resolve().parent.parent / "tools" / "bench_codecs.py"


def test_bench_codecs_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("bench_codecs", TOOL)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "codecs.json"
    assert bench.main(["--json", str(out), "--size-mib", "1", "--repeats", "1"]) == 0
    codecs = json.loads(out.read_text())["codecs"]
    assert set(codecs) == {"none", "fp16", "bf16", "int8", "int4", "int3", "ecq", "topk"}
    keys = {"ratio", "rel_error_gaussian", "rel_error_outliers", "rel_error_activation", "encode_mb_s", "decode_mb_s"}
    for row in codecs.values():
        assert set(row) == keys and all(v >= 0 for v in row.values())
        assert row["encode_mb_s"] > 0 and row["decode_mb_s"] > 0
    assert codecs["none"]["rel_error_activation"] == 0.0
    assert codecs["int8"]["ratio"] >= 3.9 and codecs["int4"]["ratio"] >= 7.5
    assert codecs["int8"]["rel_error_activation"] <= 0.02
    assert "int8 encode+decode" in capsys.readouterr().out
