"""tools/bench_transfer.py: the figures from raw timings (pure), and one small run on the emulated WAN (``-m wan``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.bench_transfer import main, summarise  # noqa: E402
from tools.wan import check_available  # noqa: E402


def test_summarise_takes_medians_and_counts_the_round_trips_the_rpc_adds():
    raw = {"1700000": {"tcp_s": [0.24, 0.25, 0.24], "rpc_s": [0.52, 0.50, 0.53], "kept_stream_s": [0.26, 0.25, 0.3],
                       "rpc_known_s": [0.34, 0.33, 0.35]}}
    row = summarise(raw, rtt_s=0.1, rate_mbit=100.0)["1700000"]
    assert (row["tcp_s"], row["rpc_s"], row["rpc_known_s"], row["kept_stream_s"]) == (0.24, 0.52, 0.34, 0.26)
    assert row["ideal_s"] == pytest.approx(0.1 + 1.7e6 * 8 / 1e8, abs=1e-4)
    assert row["extra_rtts"] == pytest.approx(2.8) and row["rpc_over_tcp"] == pytest.approx(2.167, abs=1e-3)
    loopback = summarise(raw, rtt_s=0.0001, rate_mbit=0.0)["1700000"]
    assert loopback["extra_rtts"] is None and loopback["ideal_s"] == 0.0001  # no round trip to count in


@pytest.mark.wan
@pytest.mark.timeout(240)
def test_a_small_run_on_the_emulated_wan(tmp_path):
    if (reason := check_available()) is not None:
        pytest.skip(reason)
    out = tmp_path / "t.json"
    assert main(["--delays-ms", "25", "--sizes", "1000", "600000", "--reps", "2", "--gap-s", "0.2",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = doc["networks"]["wan-25ms"]["sizes"]
    assert set(rows) == {"1000", "600000"} and doc["meta"]["cores"]
    for row in rows.values():
        assert [len(row["samples"][k]) for k in ("tcp_s", "rpc_s", "rpc_known_s", "kept_stream_s")] == [2, 2, 2, 2]
        assert min(row["tcp_s"], row["rpc_s"], row["rpc_known_s"], row["kept_stream_s"]) >= 0.045  # one RTT at least
    assert rows["600000"]["rpc_s"] > rows["1000"]["rpc_s"]
