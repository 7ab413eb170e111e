"""tools/bench_ttl.py (``bench_swarm.py --time-to-loss``): its figures by hand, and its plumbing on a tiny loopback
swarm for a few seconds (the real measurement is a tool run, docs/performance.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.bench_ttl import (  # noqa: E402
    at_sparser_evaluation,
    baseline_record,
    compute_only_tokens_per_s,
    emulator_record,
    final_loss,
    interpolate,
    mean_curve,
    measured_round_steps,
    merge_replicas,
    pace_record,
    pipeline_extra,
    pool,
    replica_steps,
    time_to_reach,
    ttl_speedup,
)

REPO = Path(__file__).resolve().parent.parent


def test_the_baseline_record_is_fullsync_as_the_sync_peers_build_it():
    from trainer.config import RunConfig

    run = RunConfig.default()
    rec = baseline_record(run, ["eval_batches=2"])
    assert (rec["optimizer"], rec["beta1"], rec["lr"]) == ("adamw", 0.9, run.optim.lr)
    assert rec["warmup_tokens_per_replica"] == rec["async_warmup_tokens_per_replica"]  # counted in samples
    tuned = baseline_record(run, ["sync_optimizer=nadam", "sync_lr=0.006", "sync_microbatches=8"])
    assert (tuned["optimizer"], tuned["beta1"], tuned["lr"], tuned["micro_batches"]) == ("nadam", 0.99, 0.006, 8)
    assert tuned["warmup_steps"] == run.optim.warmup_steps // 8


def test_time_to_reach_interpolates_the_first_crossing():
    curve = [(0.0, 5.0), (10.0, 4.0), (20.0, 3.0), (30.0, 3.5), (40.0, 2.0)]
    assert time_to_reach(curve, 3.5) == pytest.approx(15.0)
    assert time_to_reach(curve, 5.5) == 0.0 and time_to_reach(curve, 1.0) is None
    assert interpolate(curve, 25.0) == pytest.approx(3.25) and interpolate(curve, 41.0) is None


def test_speedup_is_sync_time_to_its_final_loss_over_async_time_to_it():
    sync = [(0.0, 5.0), (100.0, 4.0), (200.0, 3.2), (280.0, 3.0), (290.0, 3.0), (300.0, 3.0)]
    fast = [(0.0, 5.0), (20.0, 4.0), (40.0, 3.0), (300.0, 2.5)]
    fig = ttl_speedup(fast, sync)
    assert fig["target_loss"] == pytest.approx(3.0) and final_loss(sync) == pytest.approx(3.0)
    assert fig["sync_s"] == pytest.approx(280.0) and fig["async_s"] == pytest.approx(40.0)
    assert fig["speedup"] == pytest.approx(7.0)
    assert ttl_speedup([(0.0, 5.0), (300.0, 4.0)], sync)["speedup"] is None  # async never got there


def test_repeats_pool_into_the_figures_of_their_mean_curves(tmp_path):
    def doc(sync_final: float, async_shift: float) -> dict:
        def curve(losses: list[float], tok_per_s: float) -> list[dict]:
            return [{"t": 10.0 * i, "tokens": tok_per_s * 10 * i, "val_loss": y} for i, y in enumerate(losses)]
        sync = curve([5.0, 4.0, 3.5, sync_final, sync_final, sync_final], 100.0)
        fast = curve([5.0, 3.8 + async_shift, 3.0 + async_shift, 2.6, 2.5, 2.4], 200.0)
        return {"meta": {"run_id": "r"}, "cases": {
            "async/wan-50ms": {"label": "async/wan-50ms", "mode": "async", "curve": fast, "tokens_per_s": 200.0,
                               "final_val_loss": 2.5},
            "sync/wan-50ms": {"label": "sync/wan-50ms", "mode": "sync", "curve": sync, "tokens_per_s": 100.0,
                              "final_val_loss": sync_final}}}

    paths = []
    for i, (final, shift) in enumerate([(3.2, 0.0), (2.8, 0.4)]):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(doc(final, shift)))
    out = pool(paths)
    assert [e["wan-50ms"]["target_loss"] for e in out["each"]] == pytest.approx([3.2, 2.8])
    pooled = out["pooled"]["wan-50ms"]
    assert pooled["target_loss"] == pytest.approx(3.0)  # the mean curve's final loss, not one repeat's
    assert pooled["sync_s"] == pytest.approx(30.0) and pooled["async_s"] == pytest.approx(20 + 10 * 0.2 / 0.6)
    assert out["tokens_per_s"] == {"async/wan-50ms": 200.0, "sync/wan-50ms": 100.0}
    one = [{"t": 0.0, "tokens": 0.0, "val_loss": 4.0}, {"t": 10.0, "tokens": 10.0, "val_loss": 2.0}]
    two = [{"t": 5.0, "tokens": 5.0, "val_loss": 4.0}, {"t": 20.0, "tokens": 20.0, "val_loss": 1.0}]
    assert mean_curve([one, two]) == [{"t": 5.0, "tokens": 5.0, "val_loss": 3.5},  # the span both cover only
                                      {"t": 10.0, "tokens": 10.0, "val_loss": 2.5}]
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**doc(3.0, 0.0), "meta": {"run_id": "another"}}))
    with pytest.raises(Exception, match="different runs"):
        pool([paths[0], other])


def test_the_pace_record_sums_every_peers_jobs_and_names_the_worst():
    peers = [{"compute_pace": {"factor": 4.0, "jobs": 100, "overruns": 1, "overrun_share": 0.01}},
             {"compute_pace": {"factor": 4.0, "jobs": 300, "overruns": 9, "overrun_share": 0.03}}, {}]
    assert pace_record(peers) == {"factor": 4.0, "jobs": 400, "overrun_share": 0.025,
                                  "worst_peer_overrun_share": 0.03}
    assert pace_record([{}, {}]) is None  # unpaced: no record


def test_the_emulator_record_is_what_the_wan_dropped_over_the_budget():
    before = {"forwarded": 10, "dropped_queue": 1, "dropped_loss": 0,
              "per_ns": {"a": {"sent_packets": 6, "dropped_queue": 1, "dropped_loss": 0}}}
    after = {"forwarded": 110, "dropped_queue": 4, "dropped_loss": 2,
             "per_ns": {"a": {"sent_packets": 56, "dropped_queue": 3, "dropped_loss": 2},
                        "b": {"sent_packets": 9, "dropped_queue": 1, "dropped_loss": 0}}}
    assert emulator_record(before, after) == {
        "forwarded": 100, "dropped_queue": 3, "dropped_loss": 2,
        "per_ns": {"a": {"sent_packets": 50, "dropped_queue": 2, "dropped_loss": 2},
                   "b": {"sent_packets": 9, "dropped_queue": 1, "dropped_loss": 0}}}
    assert emulator_record(None, after) is None  # loopback: no emulator


def test_replicas_merge_once_each_has_evaluated_and_compute_only_takes_the_slowest_stage():
    evals = {0: [(5.0, 100, 4.0), (10.0, 200, 3.0)], 2: [(6.0, 120, 5.0), (11.0, 220, 2.0)]}
    assert merge_replicas(evals) == [(6.0, 120, 4.5), (10.0, 200, 4.0), (11.0, 220, 2.5)]
    assert compute_only_tokens_per_s({0: [2.0, 2.0], 1: [1.5, 1.0]}, 1024) == pytest.approx(2.5 * 1024)


def test_the_simulator_gets_the_daemons_measured_cadence_and_stage_0_staleness():
    summaries = [{"stage": 0, "steps": 1300, "averaging_rounds_ok": 100, "pipeline_delay_steps": 2.2},
                 {"stage": 0, "steps": 1200, "averaging_rounds_ok": 100, "pipeline_delay_steps": 1.9},
                 {"stage": 1, "steps": 2500, "averaging_rounds_ok": 200, "pipeline_delay_steps": 0.0}]
    assert measured_round_steps(summaries, 10) == 12  # 5,000 steps over 400 rounds
    assert measured_round_steps(summaries[:1], 20) == 13  # what the daemon ran, below the run's 20 too
    assert measured_round_steps([{"stage": 0, "steps": 50}], 20) == 20  # no round succeeded: the plan
    assert pipeline_extra(summaries, 2) == 1  # stage 0 saw ~2 steps of staleness where 1F1B on 2 stages gives 1
    assert pipeline_extra(summaries, 4) == 0 and pipeline_extra([{"stage": 1}], 2) == 0


def test_the_simulator_gets_each_replicas_measured_speed_from_its_stage_0():
    from trainer.sim.simulator import speeds_from_steps

    summaries = [{"stage": 1, "steps": 900}, {"stage": 0, "steps": 600}, {"stage": 0, "steps": 800}]
    assert replica_steps(summaries, 2) == [600, 800]
    assert speeds_from_steps(replica_steps(summaries, 2)) == pytest.approx((0.75, 1.0))
    assert replica_steps(summaries, 3) == []  # a replica's summary is missing: equal speeds
    assert replica_steps([{"stage": 0, "steps": 0}, {"stage": 0, "steps": 5}], 2) == []


def test_the_simulation_reaches_the_daemons_first_evaluation_whatever_the_cap():
    from tools.bench_ttl import sim_steps

    assert sim_steps(304_896, 20_000, 256, [600, 590], 2, 400) == 400  # capped, and past the first evaluation
    assert sim_steps(304_896, 20_000, 256, [600, 590], 2, 0) == 600  # uncapped: what the faster replica made
    # a first evaluation late in tokens (a loaded start): the cap gives way, so the curves share a token count
    steps = sim_steps(304_896, 250_000, 256, [600, 590], 2, 400)
    assert steps == 496 and steps * 256 * (1190 / 600) >= 250_000  # the replicas' tokens at its last step
    assert sim_steps(4_096, 0, 256, [], 2, 400) == 8


@pytest.mark.slow  # two 4-peer swarms and a simulation: 92 s of the default run's ~18 min on 2 cores
@pytest.mark.timeout(600)
def test_plumbing_on_a_tiny_loopback_swarm(tmp_path):
    from tools.bench_swarm import main

    out, png = tmp_path / "ttl.json", tmp_path / "ttl.png"
    rc = main(["--time-to-loss", "--run", str(REPO / "tests" / "runs" / "tiny.toml"), "--loopback", "--wan", "no",
               "--budget-s", "16", "--eval-every-s", "1", "--poll-s", "0.5", "--compute-s", "1",
               "--sim-max-steps", "400", "--json", str(out), "--plot", str(png), "--workdir", str(tmp_path / "w")])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert set(doc["cases"]) == {"async/loopback", "sync/loopback"}
    for case in doc["cases"].values():
        assert len(case["curve"]) >= 3 and case["tokens"] > 0
        assert case["compute_pace"] is None  # unpaced: no record
        pairs = zip(case["curve"], case["curve"][1:], strict=False)
        assert all(a["t"] <= b["t"] and a["tokens"] <= b["tokens"] for a, b in pairs)
    fig = doc["figures"]["loopback"]
    assert set(fig["final_val_loss"]) == {"async", "sync"} and fig["utilisation"]["async"] > 0
    assert doc["final_val_loss"] == fig["final_val_loss"] and "time_to_loss_speedup" in doc
    assert doc["sim_agreement"] is not None and 0.5 < doc["sim_agreement"] < 2.0
    assert doc["simulator"]["delays_drawn_from"] > 0  # the async peers measured their rounds' taus
    assert len(doc["simulator"]["speeds"]) == 2 and max(doc["simulator"]["speeds"]) == 1.0  # measured, not assumed
    assert doc["compute_only"]["tokens_per_s"] > 0 and doc["meta"]["data"]["corpus_sha256"]
    assert doc["baseline"]["optimizer"] == "adamw" and doc["baseline"]["beta1"] == 0.9
    assert png.stat().st_size > 1000


def test_a_run_cut_short_keeps_the_cases_it_finished(tmp_path, monkeypatch):
    """A lease or a timeout that stops the tool in its second swarm (SIGTERM unwinds as KeyboardInterrupt) leaves the
    first swarm's record in --json, not nothing."""
    import tools.bench_ttl as bt

    trained: list[str] = []

    def fake_case(case, args, workdir, n_stages):
        trained.append(case.label)
        if len(trained) > 1:
            raise KeyboardInterrupt("signal 15")
        return {"label": case.label, "mode": case.mode, "curve": [{"t": 1.0, "tokens": 100, "val_loss": 3.0}],
                "tokens": 100, "tokens_per_s": 100.0, "final_val_loss": 3.0}

    monkeypatch.setattr(bt, "train_case", fake_case)
    monkeypatch.setattr(bt, "unwind_on_sigterm", lambda: None)
    out = tmp_path / "ttl.json"
    with pytest.raises(KeyboardInterrupt):
        bt.main(["--loopback", "--wan", "no", "--compute-s", "0", "--no-sim", "--workdir", str(tmp_path / "w"),
                 "--json", str(out)])
    doc = json.loads(out.read_text())
    assert len(trained) == 2 and list(doc["cases"]) == trained[:1]
    assert doc["partial"] == "written after case 1 of 2"


def test_equal_tokens_at_an_evaluation_reads_the_sparse_curve_where_it_was_evaluated():
    """Two runs of one loss curve, one evaluated 6x more sparsely in tokens (6x the tokens/s on the same clock): at
    the smaller final token count the sparse one is interpolated along a chord above the convex curve and reads
    worse; at its own evaluation both read the curve itself."""
    import math

    def loss(x: float) -> float:
        return 2.0 + 2.0 * math.exp(-x / 100)

    sparse = [(x, loss(x)) for x in (50, 350, 650)]
    dense = [(x, loss(x)) for x in range(50, 301, 50)]
    at = min(sparse[-1][0], dense[-1][0])
    assert interpolate(sparse, at) / interpolate(dense, at) > 1.05  # the chord, not the curve
    x, ys, yd = at_sparser_evaluation(sparse, dense)
    assert x == 50 and ys == pytest.approx(yd)
    assert at_sparser_evaluation(dense, sparse) == (50, yd, ys)  # which curve is sparser, not which comes first
    assert at_sparser_evaluation(sparse, [(700, 2.0), (800, 1.9)]) is None  # no overlap
