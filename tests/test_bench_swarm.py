"""The pure parts of tools/bench_swarm.py: swarm tokens/s over a window, speedup, latency hiding, bytes per token."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.bench_swarm import (  # noqa: E402
    Case,
    active_rate,
    bytes_per_token,
    format_table,
    main,
    parse_args,
    plan,
    ratios,
    stalled_seconds,
    window_tokens_per_s,
)


def sample(stage: int, tokens: int, t: float) -> dict:
    return {"stage": stage, "tokens_total": tokens, "t": t}


def test_window_rate_counts_stage0_only_each_on_its_own_clock():
    before = [sample(0, 1000, 10.0), sample(1, 5000, 10.0), sample(0, 0, 10.5)]
    after = [sample(0, 3000, 20.0), sample(1, 99999, 20.0), sample(0, 2000, 20.5)]
    # stage 0 peers: 2000 / 10 s + 2000 / 10 s; the stage-1 peer's tokens are the same tokens again
    assert window_tokens_per_s(before, after) == pytest.approx(400.0)


def test_window_rate_rejects_mismatched_or_backward_samples():
    with pytest.raises(ValueError, match="same peers"):
        window_tokens_per_s([sample(0, 0, 0.0)], [])
    with pytest.raises(ValueError, match="later"):
        window_tokens_per_s([sample(0, 0, 5.0)], [sample(0, 10, 5.0)])


def result(mode: str, net: str, delay: float, tps: float, active: float | None = None) -> dict:
    return {"mode": mode, "net": net, "delay_ms": delay, "tokens_per_s": tps, "active_tokens_per_s": active}


def test_speedup_and_latency_hiding_pair_the_right_cases():
    results = [result("async", "loopback", 0.0, 900.0), result("sync", "loopback", 0.0, 600.0),
               result("async", "wan", 0.0, 800.0), result("sync", "wan", 0.0, 400.0),
               result("async", "wan", 50.0, 720.0), result("sync", "wan", 50.0, 160.0, active=240.0)]
    fig = ratios(results)
    assert fig["speedup"] == pytest.approx({"loopback": 1.5, "wan-0ms": 2.0, "wan-50ms": 4.5})
    assert fig["speedup_vs_active_sync"] == {"loopback": None, "wan-0ms": None, "wan-50ms": pytest.approx(3.0)}
    assert fig["latency_hiding"] == pytest.approx({"async/wan-0ms": 1.0, "sync/wan-0ms": 1.0,
                                                   "async/wan-50ms": 0.9, "sync/wan-50ms": 0.4})


def test_ratios_are_none_when_the_reference_is_missing_or_stalled():
    fig = ratios([result("async", "wan", 25.0, 500.0), result("sync", "wan", 25.0, 0.0)])
    assert fig["speedup"] == {"wan-25ms": None}
    assert fig["latency_hiding"] == {"async/wan-25ms": None, "sync/wan-25ms": None}


def test_bytes_per_token_by_sender_stage():
    before = [{"tx": 100, "rx": 0}, {"tx": 0, "rx": 0}, {"tx": 50, "rx": 0}]
    after = [{"tx": 1100, "rx": 0}, {"tx": 400, "rx": 0}, {"tx": 1050, "rx": 0}]
    out = bytes_per_token(before, after, [0, 1, 0], tokens=100.0)
    assert out == pytest.approx({"total": 24.0, "stage0_tx": 20.0, "stage1_tx": 4.0})
    assert bytes_per_token([None], [None], [0], tokens=100.0) is None
    assert bytes_per_token(before, after, [0, 1, 0], tokens=0.0) is None


def test_table_lists_every_case_and_ratio():
    r = {"label": "async/wan-50ms", "tokens_per_s": 1234.4, "rtt_ms": 101.2, "bytes_per_token": {"total": 300.0},
         "dropped": 2, "stalled_s": 6.0, "cpu_util": 0.9, "stage0_steps": 40}
    text = format_table([r], {"speedup": {"wan-50ms": 3.2}, "latency_hiding": {"async/wan-50ms": None}})
    assert "async/wan-50ms" in text and "1234" in text and "101.2" in text and "300" in text
    assert "3.20" in text and "latency_hiding" in text


def test_plan_interleaves_modes_and_adds_the_zero_delay_reference(tmp_path):
    args = parse_args(["--delays-ms", "50", "--wan", "no"])
    assert [c.label for c in plan(args)] == ["async/loopback", "sync/loopback"]
    args = argparse.Namespace(loopback=False, wan="auto", emulator=tmp_path / "missing.py", delays_ms=[50.0],
                              rate_mbit=100.0, modes=["async", "sync"])
    assert plan(args) == []  # the emulator is missing: the WAN is skipped with a warning
    args.emulator = tmp_path / "netem.py"
    args.emulator.write_text("")
    cases = plan(args)
    if cases:  # root with ip and /dev/net/tun: 0 ms is always measured as latency hiding's reference
        assert cases == [Case("async", "wan", 0.0, 100.0), Case("sync", "wan", 0.0, 100.0),
                         Case("async", "wan", 50.0, 100.0), Case("sync", "wan", 50.0, 100.0)]


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        parse_args(["--measure-s", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--run", "/nonexistent/run.toml"])


def test_stalled_seconds_sums_intervals_without_progress():
    assert stalled_seconds([(0.0, 10), (2.0, 20), (4.0, 20), (6.5, 20), (8.0, 30)]) == pytest.approx(4.5)
    assert stalled_seconds([(0.0, 10)]) == 0.0


def test_active_rate_leaves_out_the_stalls():
    assert active_rate([(0.0, 0), (2.0, 200), (4.0, 200), (6.0, 400)]) == pytest.approx(100.0)
    assert active_rate([(0.0, 5), (2.0, 5)]) is None


def test_report_renders_a_saved_json_as_markdown(tmp_path, capsys):
    case = {"label": "sync/wan-25ms", "tokens_per_s": 2069.3, "rtt_ms": 58.1, "active_tokens_per_s": 5120.0,
            "stalled_s": 18.0, "bytes_per_token": {"total": 268.4}, "cpu_util": 0.09, "stage0_steps": 30}
    path = tmp_path / "swarm.json"
    path.write_text(json.dumps({"cases": [case], "figures": {"latency_hiding": {"sync/wan-25ms": 0.83}}}))
    assert main(["--report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| sync/wan-25ms | 58.1 | 2069 | 5120 | 18 | 268 | 9 % | 30 |" in out
    assert "| latency_hiding | sync/wan-25ms | 0.83 |" in out
    path.write_text("{}")
    assert main(["--report", str(path)]) == 2
