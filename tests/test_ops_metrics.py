"""PeerMetrics: counters, windowed rates, health, and a JSON-able snapshot, driven with a fake clock."""

from __future__ import annotations

import json

import pytest

from peer.lifecycle import Lifecycle, PeerState
from peer.ops.metrics import PeerMetrics


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_rates_are_averaged_over_the_window_and_forget_old_bursts() -> None:
    clock = FakeClock()
    m = PeerMetrics("p", 0, window_s=10.0, clock=clock)
    for _ in range(20):  # 20 s of 128 tokens every 0.5 s -> 256 tokens/s
        clock.t += 0.5
        m.inc("tokens", 128)
        m.inc("bytes_out", 1000)
    snap = m.snapshot()
    assert snap["tokens_total"] == 20 * 128
    assert 230 <= snap["tokens_per_s"] <= 282  # bucket edges cost at most one second of the window
    assert snap["bytes_per_token"] == pytest.approx(1000 / 128, rel=0.01)
    clock.t += 30  # idle: the window empties
    assert m.snapshot()["tokens_per_s"] == 0.0
    assert m.snapshot()["bytes_per_token"] is None


def test_rate_during_the_first_seconds_uses_the_uptime() -> None:
    clock = FakeClock()
    m = PeerMetrics(clock=clock)
    clock.t += 2.0
    m.inc("tokens", 100)
    assert m.rate("tokens") == pytest.approx(50.0)
    assert m.rate("never_seen") == 0.0


def test_tokens_total_attribute_and_alias_share_one_counter() -> None:
    m = PeerMetrics(clock=FakeClock())
    m.tokens_total += 10
    m.inc("tokens_total", 5)
    m.inc("tokens", 1)
    assert m.tokens_total == 16
    assert m.snapshot()["counters"] == {"tokens": 16}
    with pytest.raises(ValueError, match="only grow"):
        m.inc("tokens", -1)


def test_rejected_reasons_losses_rounds_warnings_and_json() -> None:
    clock = FakeClock()
    m = PeerMetrics("12D3", 1, clock=clock)
    m.inc("rejected:bad_tensor", 2)
    m.inc("rejected:wrong_run")
    m.observe_loss(5.0)
    m.observe_loss(float("nan"))
    m.observe_loss(4.0)
    m.observe_val(4.5)
    m.observe_round(ok=True, group_size=3, tau=4.0)
    m.observe_round(ok=False)
    m.set_swarm({0: 2, 1: 1})
    m.warn("stage 2 has no peers")
    m.warn("stage 2 has no peers")
    clock.t += 3
    m.warn("slow link")
    snap = json.loads(json.dumps(m.snapshot()))
    assert snap["rejected"] == {"bad_tensor": 2, "wrong_run": 1}
    assert snap["train_loss"] == 4.0 and snap["train_loss_history"] == [5.0, 4.0]
    assert snap["train_loss_avg"] == pytest.approx(4.5)
    assert snap["val_loss"] == 4.5
    assert snap["counters"]["nonfinite_loss"] == 1
    assert snap["counters"]["averaging_rounds_ok"] == 1 and snap["counters"]["averaging_rounds_failed"] == 1
    assert snap["avg_group_size"] == 3 and snap["avg_tau"] == 4.0
    assert snap["peers_per_stage"] == {"0": 2, "1": 1}
    assert [(w["text"], w["count"]) for w in snap["warnings"]] == [("stage 2 has no peers", 2), ("slow link", 1)]
    assert snap["warnings"][0]["age_s"] == pytest.approx(3.0)


def test_averaging_cadence_counts_fraction_per_local_step_and_measured_delays() -> None:
    m = PeerMetrics("p", 0)
    assert m.snapshot()["avg_fraction_per_step"] is None and m.snapshot()["avg_delay_steps"] is None
    m.local_step = 100  # a joiner that loaded a donor's state at step 100
    m.start_averaging(100)
    for tau in (2, 2, 5):
        m.observe_round(ok=True, group_size=2, tau=tau, fraction=0.5)
    m.observe_round(ok=False)
    m.local_step = 130
    snap = m.snapshot()
    assert snap["avg_fraction_per_step"] == pytest.approx(1.5 / 30)
    m.averaging_alone(10)  # ten of those steps had no partner: they are left out
    assert m.snapshot()["avg_fraction_per_step"] == pytest.approx(1.5 / 20)
    assert snap["avg_delay_steps"] == pytest.approx(3.0) and snap["avg_delay_hist"] == {"2": 2, "5": 1}


def test_state_validation_drain_countdown_and_health() -> None:
    clock = FakeClock()
    m = PeerMetrics(stall_s=60, clock=clock)
    life = Lifecycle(m.observe_state)
    with pytest.raises(ValueError, match="not a valid PeerState"):
        life.enter("sleeping")  # type: ignore[arg-type]
    clock.t += 59
    assert m.snapshot()["healthy"] is True
    clock.t += 2  # joining for 61 s
    assert "still joining after 61 s" in m.snapshot()["health_reasons"][0]
    life.enter(PeerState.LOADING_STATE, stage=0)
    life.enter(PeerState.TRAINING)
    clock.t += 30
    m.local_step = 1
    clock.t += 50
    assert m.snapshot()["healthy"] is True
    clock.t += 20  # 70 s since the last step
    snap = m.snapshot()
    assert snap["healthy"] is False and "no training progress" in snap["health_reasons"][0]
    m.inc("tokens", 64)
    assert m.snapshot()["healthy"] is True
    life.drain(20.0)
    clock.t += 5
    snap = m.snapshot()
    assert snap["state"] == "draining" and snap["drain_remaining_s"] == pytest.approx(15.0)
    life.enter(PeerState.STOPPED)
    assert m.snapshot()["healthy"] is False and m.snapshot()["drain_remaining_s"] is None


def test_bad_construction_is_refused() -> None:
    with pytest.raises(ValueError):
        PeerMetrics(window_s=0)


def test_the_summary_reports_every_refusal_the_peer_counted():
    from peer.ops.metrics import PeerMetrics
    from peer.ops.summary import peer_summary
    from peer.pipeline.ledger import SampleLedger

    metrics = PeerMetrics("QmMe", 2)
    metrics.inc("rejected:replayed_microbatch", 3)
    metrics.inc("rejected:avg_outlier")
    metrics.inc("flagged:loss_ceiling_held", 2)
    out = peer_summary(metrics, head={"peer_id": "QmMe", "stage": 2}, elapsed_s=1.0, steps=0, driver=None,
                       ledger=SampleLedger(), final_val_loss=None)
    assert out["rejected"] == {"rejected:replayed_microbatch": 3, "flagged:loss_ceiling_held": 2}
    assert out["rejected_avg"] == {"rejected:avg_outlier": 1}
