"""A peer's life: its states keep their wire strings, transitions are validated, observers see every one."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from peer.lifecycle import TRANSITIONS, IllegalTransition, Lifecycle, PeerState
from peer.membership.records import PeerRecord, RecordError
from peer.ops.startup import SHORT_PHASE, Phase, phase


def test_wire_values_are_the_ones_other_peers_read() -> None:
    assert [s.value for s in PeerState] == ["joining", "loading_state", "training", "draining", "stopped"]
    assert json.dumps({"state": PeerState.LOADING_STATE}) == '{"state": "loading_state"}'
    assert PeerState.parse("training") is PeerState.TRAINING and PeerState.parse("sleeping") is None
    assert PeerState.parse(3) is None


def test_a_life_from_join_to_stop_through_a_move() -> None:
    seen: list[tuple[PeerState, float | None]] = []
    life = Lifecycle(lambda s, d: seen.append((s, d)))
    assert life.state is PeerState.JOINING and not life.serving
    life.enter(PeerState.LOADING_STATE, stage=1)
    life.enter(PeerState.TRAINING)
    assert life.serving
    life.enter(PeerState.TRAINING)  # the state it is in: nothing happens, nobody is told
    life.enter(PeerState.DRAINING)  # a move claimed
    life.enter(PeerState.LOADING_STATE, stage=0)  # ... and made
    life.enter(PeerState.TRAINING)
    life.drain(5.0)
    life.drain(-1.0)  # a second signal: the countdown restarts, the state stays
    life.enter(PeerState.STOPPED)
    assert seen == [(PeerState.LOADING_STATE, None), (PeerState.TRAINING, None), (PeerState.DRAINING, None),
                    (PeerState.LOADING_STATE, None), (PeerState.TRAINING, None), (PeerState.DRAINING, 5.0),
                    (PeerState.DRAINING, 0.0), (PeerState.STOPPED, None)]
    assert life.stage == 0


def test_transitions_a_peer_does_not_have_are_refused() -> None:
    life = Lifecycle()
    with pytest.raises(IllegalTransition, match="joining to training"):
        life.enter(PeerState.TRAINING)  # no stage loaded yet
    life.enter(PeerState.STOPPED)  # a shutdown during start-up
    for state in PeerState:
        if state is not PeerState.STOPPED:
            with pytest.raises(IllegalTransition):
                life.enter(state)
    assert TRANSITIONS[PeerState.STOPPED] == frozenset()
    assert all(PeerState.STOPPED in TRANSITIONS[s] for s in PeerState if s is not PeerState.STOPPED)


def test_records_carry_the_state_as_a_plain_string() -> None:
    rec = PeerRecord(peer_id="p", stage=0, throughput=1.0, queue=0, version=0, state="training")
    assert rec.state is PeerState.TRAINING
    value = rec.to_value()
    assert type(value["state"]) is str and value["state"] == "training"
    assert PeerRecord.from_value("p", value) == rec
    with pytest.raises(RecordError, match="state"):
        PeerRecord.from_value("p", {**value, "state": "sleeping"})


def test_the_start_up_view_names_the_peer_states_in_words() -> None:
    assert phase({"state": "joining"}) == Phase.JOINING_DHT == "joining DHT"
    assert phase({"state": "joining", "peer_id": "Qm"}) == "choosing stage"
    assert phase({"state": "loading_state"}) == "loading state"
    assert phase({"state": "mystery"}) == "mystery"
    assert {p: SHORT_PHASE[p] for p in ("loading state", "training", "draining", "stopped")} == {
        "loading state": "load", "training": "train", "draining": "drain", "stopped": "stop"}
    assert [s.short for s in PeerState] == ["join", "load", "train", "drain", "stop"]


def test_the_daemon_owns_the_life_and_a_second_signal_skips_the_stage_drain(tmp_path: Path) -> None:
    from peer.config import PeerConfig
    from peer.daemon import Daemon
    from trainer.config import RunConfig

    run = RunConfig.from_toml(Path(__file__).parent / "runs" / "tiny.toml")
    d = Daemon(run, PeerConfig(device="cpu", identity_path=tmp_path / "id.key", drain_timeout_s=30.0))
    try:
        assert d.life.state is PeerState.JOINING and d.metrics.state is PeerState.JOINING
        d.life.enter(PeerState.LOADING_STATE, stage=0)
        assert d.metrics.snapshot()["state"] == "loading_state"  # the metrics show what the lifecycle says
        d._on_signal(signal.SIGINT)
        assert d.stop.is_set() and d.context.cfg.drain_timeout_s == 30.0
        d._on_signal(signal.SIGINT)  # a second Ctrl-C: no drain, in the daemon and in the stage it serves
        assert d.cfg.drain_timeout_s == d.context.cfg.drain_timeout_s == 0.01
    finally:
        d.executor.shutdown(wait=True)


def test_a_signal_during_the_final_evaluation_stops_the_peer_at_once(tmp_path: Path) -> None:
    """Regression: a stage-0 peer that reached max_steps while the next stage's peers were leaving tried its final
    evaluation 3 x microbatch_timeout_s (3 min by default) and ignored SIGTERM meanwhile; its launcher killed it."""
    import asyncio
    from types import SimpleNamespace

    from peer.config import PeerConfig
    from peer.daemon import Daemon
    from trainer.config import RunConfig

    run = RunConfig.from_toml(Path(__file__).parent / "runs" / "tiny.toml")
    d = Daemon(run, PeerConfig(device="cpu", identity_path=tmp_path / "id.key"))
    cancelled = []

    async def never_returns() -> float:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return 0.0

    async def scenario() -> float:
        finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        finished.set_result(None)  # the stage-0 driver reached max_steps
        d.service = SimpleNamespace(driver_task=finished)  # type: ignore[assignment]
        d.driver = SimpleNamespace(final_evaluate=never_returns)  # type: ignore[assignment]
        asyncio.get_running_loop().call_later(0.2, d._on_signal, signal.SIGTERM)
        t0 = time.monotonic()
        await asyncio.wait_for(d._serve(), timeout=10)
        return time.monotonic() - t0

    try:
        assert asyncio.run(scenario()) < 2.0
        assert cancelled == [True] and d.final_val_loss is None and d.exit_reason == "SIGTERM"
    finally:
        d.executor.shutdown(wait=True)
