"""Unit tests of the discrete-event wall-clock model against hand-computed schedules."""

from __future__ import annotations

import math

import pytest

from trainer.sim.wallclock import MeshTiming, simulate_async, simulate_sync


def mesh(k: int, f: float = 1.0, b: float = 1.0, **kw) -> MeshTiming:
    kw.setdefault("stage_params", (0,) * k)
    kw.setdefault("activation_bytes", 0.0)
    kw.setdefault("n_replicas", 1)
    return MeshTiming(fwd_s=(f,) * k, bwd_s=(b,) * k, **kw)


def test_gpipe_k2_m2_no_latency_matches_bubble_formula():
    # (M + K - 1) (f + b) = 3 * 2 = 6 per step of 2 micro-batches
    r = simulate_sync(mesh(2), micro_batches=2, steps=3)
    assert r.detail["step_s"] == pytest.approx(6.0)
    assert r.seconds_per_microbatch == pytest.approx(3.0)
    assert r.total_s == pytest.approx(18.0)


def test_gpipe_latency_adds_two_hops_per_stage_boundary():
    # by hand: s0 F0[0,1] F1[1,2]; s1 F0[1.5,2.5] F1[2.5,3.5] B0[3.5,4.5] B1[4.5,5.5]; s0 B0[5,6] B1[6,7]
    r = simulate_sync(mesh(2, link_latency_s=0.5), micro_batches=2, steps=2)
    assert r.detail["step_s"] == pytest.approx(6.0 + 2 * 1 * 0.5)
    r4 = simulate_sync(mesh(4, link_latency_s=0.25), micro_batches=4, steps=2)
    assert r4.detail["step_s"] == pytest.approx((4 + 4 - 1) * 2 + 2 * 3 * 0.25)


def test_gpipe_bandwidth_serialises_transfers():
    # 1 s of transfer per hop: forward hops of mb0/mb1 leave s0 at 1 and 2 and arrive at 2 and 3 (serialised)
    r = simulate_sync(mesh(2, activation_bytes=100.0, link_bandwidth=100.0), micro_batches=2, steps=2)
    # s1 F0[2,3] F1[3,4] B0[4,5] B1[5,6]; grads arrive s0 at 6 and 7; s0 B0[6,7] B1[7,8]
    assert r.detail["step_s"] == pytest.approx(8.0)


def test_gpipe_gradient_allreduce_is_a_ring_over_replicas():
    # one stage, f+b = 2; ring over 2 replicas: 2 transfers of 400/2 bytes at 400 B/s plus 0.1 s each = 1.2 s
    m = mesh(1, stage_params=(100,), n_replicas=2, dp_bandwidth=400.0, dp_latency_s=0.1)
    r = simulate_sync(m, micro_batches=1, steps=3)
    assert r.detail["step_s"] == pytest.approx(2.0 + 2 * (200 / 400 + 0.1))
    one = simulate_sync(mesh(1, stage_params=(100,), n_replicas=1), micro_batches=1, steps=3)
    assert one.detail["step_s"] == pytest.approx(2.0)  # no replicas, no all-reduce


def test_async_full_window_runs_at_the_slowest_stage():
    r = simulate_async(mesh(2), inflight=2, microbatches=200)
    assert r.seconds_per_microbatch == pytest.approx(2.0)
    slow = MeshTiming(fwd_s=(1.0, 2.0, 1.0), bwd_s=(1.0, 3.0, 1.0), stage_params=(0, 0, 0), activation_bytes=0.0,
                      n_replicas=1)
    # completions come in bursts (3, 3, 9 s); the steady-state slope averages them
    assert simulate_async(slow, inflight=8, microbatches=200).seconds_per_microbatch == pytest.approx(5.0, rel=1e-3)


def test_async_pure_latency_limits_a_small_window():
    # negligible compute, 1 s one way: a micro-batch's round trip is 2 s, so W in flight give W per 2 s
    tiny = mesh(2, f=1e-6, b=1e-6, link_latency_s=1.0)
    assert simulate_async(tiny, inflight=1, microbatches=100).seconds_per_microbatch == pytest.approx(2.0, rel=1e-4)
    # four completions arrive together every 2 s: the slope over a non-whole number of bursts is off by < 0.2 %
    assert simulate_async(tiny, inflight=4, microbatches=100).seconds_per_microbatch == pytest.approx(0.5, rel=2e-3)
    # with compute: RTT = 0.1 + 1 + 0.1 + 0.1 + 1 + 0.1 = 2.4 s; 4 in flight -> 0.6 s; the stage limit is 0.2 s
    m = mesh(2, f=0.1, b=0.1, link_latency_s=1.0)
    assert simulate_async(m, inflight=4, microbatches=200).seconds_per_microbatch == pytest.approx(0.6, rel=2e-3)
    assert simulate_async(m, inflight=64, microbatches=400).seconds_per_microbatch == pytest.approx(0.2, rel=2e-3)


def test_async_averaging_overlaps_compute_unless_bandwidth_bound():
    # one stage, 1 s per step; a round of p=1 over 1000 int8 params, ring of 2: 2 transfers of 500 B
    fast = mesh(1, f=0.5, b=0.5, stage_params=(1000,), n_replicas=2, dp_bandwidth=2000.0)  # 0.5 s per round
    r = simulate_async(fast, inflight=1, microbatches=100, avg_fraction=1.0, avg_bytes_per_param=1.0)
    assert r.seconds_per_microbatch == pytest.approx(1.0)
    assert r.stall_s == 0.0
    slow = mesh(1, f=0.5, b=0.5, stage_params=(1000,), n_replicas=2, dp_bandwidth=500.0)  # 2 s per round
    r = simulate_async(slow, inflight=1, microbatches=100, avg_fraction=1.0, avg_bytes_per_param=1.0,
                       max_pending_rounds=3)
    assert r.seconds_per_microbatch == pytest.approx(2.0)
    assert r.stall_s > 0
    # 5 % of the weights is 20x less traffic: back to compute-bound
    r = simulate_async(slow, inflight=1, microbatches=100, avg_fraction=0.05, avg_bytes_per_param=1.0)
    assert r.seconds_per_microbatch == pytest.approx(1.0)


def test_invalid_meshes_are_rejected_with_a_reason():
    with pytest.raises(ValueError, match="one entry per stage"):
        MeshTiming(fwd_s=(1.0,), bwd_s=(1.0, 1.0), stage_params=(0,), activation_bytes=0.0)
    with pytest.raises(ValueError, match="bandwidth"):
        mesh(1, link_bandwidth=0.0)
    with pytest.raises(ValueError, match="inflight"):
        simulate_async(mesh(1), inflight=0)
    assert math.isinf(mesh(1).dp_bw)


def test_wallclock_only_cli_writes_the_speedup_tables(tmp_path, capsys):
    import json

    from peer.cli import main

    assert main(["simulate", "--preset", "smoke", "--wallclock-only", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "wallclock.json").read_text())
    assert all(f > 0 for f in doc["fwd_s"]) and all(b > 0 for b in doc["bwd_s"])
    assert {r["latency_ms"] for r in doc["rows"]} == {10, 50, 100}
    for r in doc["rows"]:  # latency hurts the flushed schedule more than the asynchronous one
        assert r["speedup"] > 1.0
    assert "| latency (ms) |" in (tmp_path / "wallclock.md").read_text()
