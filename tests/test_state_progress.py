"""The most advanced state wins: source ranking (pure), checkpoints that never go backwards, stage choice that weighs
the checkpoints a peer holds, and ``restore_state`` over fake donors and real checkpoint files."""

from __future__ import annotations

import asyncio
import logging
import os
import random

import pytest
import torch

import peer.state.restore as restore_mod
from peer.membership.records import PeerRecord
from peer.membership.stage_choice import choose_stage
from peer.ops.metrics import PeerMetrics
from peer.state.checkpoint import (
    StaleCheckpointError,
    checkpoint_path,
    checkpoint_steps,
    load_checkpoint,
    newest_checkpoint_stage,
    previous_path,
    save_checkpoint,
)
from peer.state.progress import StateSource, most_advanced, rank
from trainer.config import RunConfig


def src(kind: str, step: int, label: str = "") -> StateSource:
    return StateSource(kind=kind, step=step, label=label)


def state(step: int) -> dict:
    return {"params": [torch.full((3,), float(step))], "local_step": step}


def rec(pid: str, stage: int, version: int = 0, thr: float = 1.0, st: str = "training") -> PeerRecord:
    return PeerRecord(peer_id=pid, stage=stage, throughput=thr, queue=0, version=version, state=st)


# ----- ranking -------------------------------------------------------------------------------------------------------
def test_the_most_trained_source_wins_whatever_the_order():
    sources = [src("donor", 0, "untrained donor"), src("checkpoint", 6261), src("init", 0), src("donor", 17)]
    for seed in range(5):
        random.Random(seed).shuffle(sources)
        assert most_advanced(sources) == src("checkpoint", 6261)


def test_ties_prefer_a_live_donor_then_a_file_then_the_init():
    assert most_advanced([src("init", 5), src("checkpoint", 5), src("donor", 5)]).kind == "donor"
    assert most_advanced([src("init", 0), src("spare", 0), src("checkpoint", 0)]).kind == "checkpoint"
    assert [s.kind for s in rank([src("init", 0), src("spare", 0)])] == ["spare", "init"]
    assert most_advanced([src("init", 0), src("checkpoint", -1)]).kind == "init"  # unknown step ranks lowest


def test_bad_sources_are_refused():
    with pytest.raises(ValueError):
        src("somewhere", 1)
    with pytest.raises(ValueError):
        src("donor", -2)
    with pytest.raises(ValueError):
        most_advanced([])


# ----- checkpoints never go backwards --------------------------------------------------------------------------------
def test_checkpoint_refuses_a_less_trained_state_and_keeps_the_previous_one(tmp_path):
    run = RunConfig.default()
    save_checkpoint(tmp_path, run, 1, state(6261))
    with pytest.raises(StaleCheckpointError, match="6261"):
        save_checkpoint(tmp_path, run, 1, state(0))
    assert load_checkpoint(tmp_path, run, 1)["local_step"] == 6261
    assert not previous_path(tmp_path, 1).exists()  # nothing was written
    save_checkpoint(tmp_path, run, 1, state(6300))
    assert torch.load(previous_path(tmp_path, 1), weights_only=True)["step"] == 6261
    assert checkpoint_steps(tmp_path, run) == {1: 6300}
    save_checkpoint(tmp_path, run, 1, state(0), allow_older=True)  # an explicit reset is still possible
    assert checkpoint_steps(tmp_path, run) == {1: 0}


def test_a_damaged_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    run = RunConfig.default()
    save_checkpoint(tmp_path, run, 0, state(10))
    save_checkpoint(tmp_path, run, 0, state(20))
    checkpoint_path(tmp_path, 0).write_bytes(b"torn")
    with caplog.at_level(logging.WARNING):
        assert load_checkpoint(tmp_path, run, 0)["local_step"] == 10
    assert "previous checkpoint" in caplog.text
    assert checkpoint_steps(tmp_path, run) == {0: 10}


# ----- stage choice weighs held checkpoints --------------------------------------------------------------------------
def test_a_restarting_peer_takes_the_stage_it_holds_a_checkpoint_for():
    costs = [1.0, 1.0]
    for seed in range(20):  # empty swarm (whole-swarm restart): its own stage, never the other at random
        assert choose_stage({}, costs, held={1: 2399}, rng=random.Random(seed)) == 1
    snap = {"a": rec("a", 0, version=500)}
    assert choose_stage(snap, costs, held={0: 400}) == 1  # capacity still decides: stage 1 is empty
    # it holds both (it moved once): the more trained one, while the swarm has neither
    assert choose_stage({}, costs, held={0: 100, 1: 2578}) == 1
    # the stage where its checkpoint is ahead of every live replica
    snap = {"a": rec("a", 0, version=3000), "b": rec("b", 1, version=10)}
    assert choose_stage(snap, costs, held={0: 2000, 1: 2000}) == 1
    # ... even against capacity: a whole-swarm restart where the peers back first (still loading: version 0) sit on
    # this peer's stage, and the other stage is empty (today's capacity rule swapped stages and lost 150-370 steps)
    snap = {"a": rec("a", 0, version=0), "b": rec("b", 0, version=0)}
    assert choose_stage(snap, costs, held={0: 2770}) == 0
    assert choose_stage({"a": rec("a", 0, version=2770)}, costs, held={0: 2617}) == 1  # behind: capacity decides
    # it holds both (it moved once) and both are ahead: the stage it served last, whatever the step counts (stages
    # step at different rates: a stale stage-1 file at 3258 must not beat the stage-0 one at 2630 it wrote last)
    assert choose_stage({}, costs, held={0: 2630, 1: 3258}, last=0) == 0
    assert choose_stage({}, costs, held={0: 2630, 1: 3258}) == 1


def test_the_stage_served_last_is_the_newest_checkpoint_file(tmp_path):
    run = RunConfig.default()
    save_checkpoint(tmp_path, run, 1, {"local_step": 3258, "model": {}})
    save_checkpoint(tmp_path, run, 0, {"local_step": 2630, "model": {}})
    os.utime(checkpoint_path(tmp_path, 1), (1e9, 1e9))
    assert newest_checkpoint_stage(tmp_path, [0, 1]) == 0
    os.utime(checkpoint_path(tmp_path, 0), (1e8, 1e8))
    assert newest_checkpoint_stage(tmp_path, [0, 1]) == 1
    assert newest_checkpoint_stage(tmp_path, []) is None


def test_without_checkpoints_ties_still_spread_at_random():
    picks = {choose_stage({}, [1.0, 1.0], held={}, rng=random.Random(i)) for i in range(40)}
    assert picks == {0, 1}


# ----- restore_state -------------------------------------------------------------------------------------------------
def _restore(tmp_path, monkeypatch, records, delivered, run=None):
    run = run or RunConfig.default()
    asked: list[list[str]] = []

    async def fake_load(*, donors, **kw):
        asked.append(list(donors))
        return delivered

    monkeypatch.setattr(restore_mod, "load_state_from_peers", fake_load)

    async def io(fn, *args):
        return fn(*args)

    async def refresh():
        return records

    out = asyncio.run(restore_mod.restore_state(
        run=run, stage=1, my_id="me", refresh=refresh, p2p=None, dht=None, metrics=PeerMetrics(),
        reference=state(0), checkpoint_dir=tmp_path, io=io, timeout_s=5.0, donor_wait_s=0.0))
    return out, asked


def test_a_restarted_peer_keeps_its_checkpoint_over_an_untrained_donor(tmp_path, monkeypatch):
    run = RunConfig.default()
    save_checkpoint(tmp_path, run, 1, state(6261))
    out, asked = _restore(tmp_path, monkeypatch, {"d": rec("d", 1, version=0)}, state(0))
    assert out.source.kind == "checkpoint" and out.state["local_step"] == 6261
    assert asked == []  # a donor behind the checkpoint is not even downloaded


def test_a_donor_ahead_of_the_checkpoint_wins_and_a_stale_announcement_is_rechecked(tmp_path, monkeypatch):
    run = RunConfig.default()
    save_checkpoint(tmp_path, run, 1, state(100))
    out, asked = _restore(tmp_path, monkeypatch, {"d": rec("d", 1, version=900), "e": rec("e", 1, version=50)},
                          state(905))
    assert out.source.kind == "donor" and out.state["local_step"] == 905 and asked == [["d"]]
    # the donor announced 900 but delivered a state of step 40: the checkpoint still wins
    out, _ = _restore(tmp_path, monkeypatch, {"d": rec("d", 1, version=900)}, state(40))
    assert out.source.kind == "checkpoint" and out.state["local_step"] == 100


def test_no_checkpoint_and_no_donor_is_the_seeded_init(tmp_path, monkeypatch):
    out, asked = _restore(tmp_path, monkeypatch, {}, None)
    assert out.source.kind == "init" and out.state is None and asked == []
    out, asked = _restore(tmp_path, monkeypatch, {"d": rec("d", 1, version=0)}, None)  # the donor failed
    assert out.source.kind == "init" and asked == [["d"]]


def test_a_joiner_looks_again_for_a_donor_before_throwing_a_trained_stage_away(tmp_path, monkeypatch):
    views = [{"d": rec("d", 1, version=40, st="loading_state"), "s0": rec("s0", 0, version=40)},
             {"d": rec("d", 1, version=40), "s0": rec("s0", 0, version=40)}]
    out, _, reads = _restore_through_views(tmp_path, monkeypatch, views, [state(41)], donor_wait_s=1.0)
    assert out.source.kind == "donor" and out.state["local_step"] == 41 and reads == 2


def _restore_through_views(tmp_path, monkeypatch, views, answers, witness_wait_s=0.0, donor_wait_s=0.0):
    """restore_state where the k-th read of the swarm returns ``views[k]`` (the last one from then on) and the k-th
    donor attempt delivers ``answers[k]``; returns (restored, donors asked per attempt, reads)."""
    asked: list[list[str]] = []
    reads: list[int] = []

    async def fake_load(*, donors, **kw):
        asked.append(list(donors))
        return answers[min(len(asked), len(answers)) - 1]

    async def refresh():
        reads.append(1)
        return views[min(len(reads), len(views)) - 1]

    async def io(fn, *args):
        return fn(*args)

    monkeypatch.setattr(restore_mod, "load_state_from_peers", fake_load)
    monkeypatch.setattr(restore_mod, "DONOR_RETRY_S", 0.01)
    out = asyncio.run(restore_mod.restore_state(
        run=RunConfig.default(), stage=1, my_id="me", refresh=refresh, p2p=None, dht=None, metrics=PeerMetrics(),
        reference=state(0), checkpoint_dir=tmp_path, io=io, timeout_s=5.0, donor_wait_s=donor_wait_s,
        witness_wait_s=witness_wait_s))
    return out, asked, len(reads)


def test_a_joiner_asks_again_when_a_dead_witness_record_lapses(tmp_path, monkeypatch):
    """A stage of two, one replica dead: its record, still announced, is the live donor's only witness and ties the
    vote (nothing loads). Once the record lapses the joiner asks again and loads the live replica's state instead of
    starting over from the init; a view that does not change is not asked again."""
    both = {"a": rec("a", 1, version=500), "dead": rec("dead", 1, version=480), "s0": rec("s0", 0, version=500)}
    lapsed = {"a": rec("a", 1, version=501), "s0": rec("s0", 0, version=501)}
    out, asked, _ = _restore_through_views(tmp_path, monkeypatch, [both, both, both, lapsed], [None, state(501)],
                                           witness_wait_s=5.0)
    assert asked == [["a", "dead"], ["a"]]
    assert out.source.kind == "donor" and out.state["local_step"] == 501
    # the view never changes: asked once, then the init once the wait is over
    out, asked, reads = _restore_through_views(tmp_path, monkeypatch, [both], [None], witness_wait_s=0.2)
    assert asked == [["a", "dead"]] and reads > 2 and out.source.kind == "init"
    # without a wait (the default) nothing is read again
    out, asked, reads = _restore_through_views(tmp_path, monkeypatch, [both, lapsed], [None, state(501)],
                                               witness_wait_s=0.0)
    assert asked == [["a", "dead"]] and reads == 1 and out.source.kind == "init"
