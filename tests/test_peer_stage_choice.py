"""Stage choice and rebalancing on hand-built DHT snapshots (pure functions, no network)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from peer.membership.records import PeerRecord
from peer.membership.stage_choice import (
    NoStageFits,
    capacities,
    choose_stage,
    estimate_throughput,
    leaves_for_an_empty_stage,
    should_move,
    stage_costs,
)


def rec(pid: str, stage: int, thr: float = 1.0, state: str = "training") -> PeerRecord:
    return PeerRecord(peer_id=pid, stage=stage, throughput=thr, queue=0, version=0, state=state)


def swarm(*recs: PeerRecord) -> dict[str, PeerRecord]:
    return {r.peer_id: r for r in recs}


def test_stage_costs_weigh_the_head_and_never_zero():
    costs = stage_costs([2, 2], n_embd=32, vocab_size=256)
    assert costs[0] == pytest.approx(2.05 * 4 / 3)  # stage 0 recomputes its forward for the backward
    assert costs[1] == pytest.approx(2 + 256 / (12 * 32))
    assert min(stage_costs([0, 3, 0], n_embd=64, vocab_size=256)) > 0


def test_joiners_of_equal_speed_balance_the_replicas_by_cost():
    """Eight equal peers joining one by one on the tiny run (2 stages of one block): 4 and 4, not 6 and 2 (capacity is
    announced throughput / cost, throughput is cost / time: the cost model cancels for measured peers)."""
    costs = stage_costs([1, 1], n_embd=32, vocab_size=256)
    snap: dict[str, PeerRecord] = {}
    for i in range(8):
        stage = choose_stage(snap, costs, rng=random.Random(i))
        snap[f"p{i}"] = rec(f"p{i}", stage, thr=costs[stage] * 100.0)  # same machine: same blocks per second
    counts = [sum(r.stage == s for r in snap.values()) for s in (0, 1)]
    assert counts == [4, 4], counts


def test_empty_swarm_picks_any_stage_and_empty_stage_first():
    costs = [1.0, 1.0, 1.0]
    assert choose_stage({}, costs, rng=random.Random(0)) in (0, 1, 2)
    snap = swarm(rec("a", 0), rec("b", 2))
    assert all(choose_stage(snap, costs, rng=random.Random(i)) == 1 for i in range(20))


def test_choice_is_relative_to_cost():
    # equal throughput, but stage 1 costs 3x as much: it has the least capacity
    snap = swarm(rec("a", 0, 2.0), rec("b", 1, 2.0), rec("c", 1, 2.0))
    assert choose_stage(snap, [1.0, 3.0]) == 1
    assert capacities(snap, [1.0, 3.0]) == pytest.approx([2.0, 4.0 / 3.0])


def test_ties_are_broken_at_random_to_spread_joiners():
    snap = swarm(rec("a", 0), rec("b", 1))
    picks = {choose_stage(snap, [1.0, 1.0], rng=random.Random(i)) for i in range(40)}
    assert picks == {0, 1}


def test_stopped_peers_are_ignored():
    snap = swarm(rec("a", 0), rec("b", 1), rec("c", 1, state="stopped"), rec("d", 0))
    assert choose_stage(snap, [1.0, 1.0]) == 1


def test_newcomer_estimate_is_the_median():
    assert estimate_throughput({}) == 1.0
    assert estimate_throughput(swarm(rec("a", 0, 1.0), rec("b", 1, 5.0), rec("c", 1, 3.0))) == 3.0


def test_overserved_stage_moves_one_peer_to_the_starved_one():
    snap = swarm(rec("a", 0), rec("b", 0), rec("c", 0), rec("d", 1))
    assert should_move(snap, [1.0, 1.0], "a") == 1
    assert should_move(snap, [1.0, 1.0], "d") is None  # alone on its stage: never empties it


def test_hysteresis_blocks_small_gains():
    # moving "a" would leave stage 0 at 2.2 < 2.9: the minimum would fall
    snap = swarm(rec("a", 0, 1.0), rec("b", 0, 2.2), rec("c", 1, 2.9))
    assert should_move(snap, [1.0, 1.0], "a") is None
    # moving "a" raises the minimum from 2.3 to 2.5 (+9 %): below the 1/0.75 threshold, above 1/0.95
    snap = swarm(rec("a", 0, 0.4), rec("b", 0, 2.5), rec("c", 1, 2.3))
    assert should_move(snap, [1.0, 1.0], "a", quality=0.75) is None
    assert should_move(snap, [1.0, 1.0], "a", quality=0.95) == 1


def test_no_flapping_after_a_move():
    costs = [1.0, 1.0, 1.0]
    rng = random.Random(1)
    for trial in range(50):
        recs = [rec(f"p{i}", rng.randrange(3), rng.uniform(0.2, 3.0)) for i in range(rng.randint(2, 8))]
        snap = swarm(*recs)
        for _ in range(40):  # let every peer move greedily until nobody wants to
            moved = False
            for pid in sorted(snap):
                target = should_move(snap, costs, pid)
                if target is not None:
                    before = min(capacities(snap, costs))
                    r = snap[pid]
                    snap[pid] = PeerRecord(peer_id=pid, stage=target, throughput=r.throughput, queue=0, version=0,
                                           state="training")
                    assert min(capacities(snap, costs)) > before  # the objective strictly improves
                    moved = True
            if not moved:
                break
        else:
            pytest.fail(f"trial {trial}: peers kept moving (flapping)")


def test_invalid_quality_is_rejected():
    with pytest.raises(ValueError, match="quality"):
        should_move(swarm(rec("a", 0)), [1.0], "a", quality=0.0)


def test_a_restarting_peer_waits_before_leaving_its_stage_for_one_nobody_announces_yet():
    """Whole-swarm restart: only a stage-0 peer is back, so stage 1 looks empty and the capacity rule sends a
    stage-0 peer there, onto an old stage-1 checkpoint of its own while stage 1's own peers are seconds from
    announcing (a churn run: a replica resumed stage 1 at step 3,392 next to peers at 5,201). The daemon reads the
    swarm again for a few announce periods while this holds."""
    back = {"a": dataclasses.replace(rec("a", 0), version=5123)}
    assert choose_stage(back, [1.0, 1.0], held={0: 5039, 1: 3392}, last=0) == 1
    assert leaves_for_an_empty_stage(back, 2, chosen=1, last=0)
    assert not leaves_for_an_empty_stage(back, 2, chosen=0, last=0)  # staying
    assert not leaves_for_an_empty_stage(back, 2, chosen=1, last=None)  # no checkpoint: a joiner fills it at once
    assert not leaves_for_an_empty_stage({**back, "b": rec("b", 1, state="loading_state")}, 2, chosen=1, last=0)


# --- memory: only the stages that fit --------------------------------------------------------------------------------
def test_choice_never_picks_a_stage_that_does_not_fit():
    costs = [1.0, 1.0, 1.0]
    starved = swarm(rec("a", 0), rec("b", 0), rec("c", 2))  # stage 1 has no peer at all
    assert choose_stage(starved, costs) == 1
    picks = {choose_stage(starved, costs, fits=(0, 2), rng=random.Random(i)) for i in range(30)}
    assert picks == {2}  # the least served stage among those that fit
    assert choose_stage({}, costs, fits=[2], rng=random.Random(0)) == 2


def test_a_checkpoint_of_a_stage_that_no_longer_fits_does_not_pull_the_peer_back():
    snap = swarm(rec("a", 0), rec("b", 1))
    assert choose_stage(snap, [1.0, 1.0], held={1: 500}) == 1
    assert choose_stage(snap, [1.0, 1.0], held={1: 500}, fits=(0,)) == 0


def test_no_stage_fits_is_an_error():
    with pytest.raises(NoStageFits, match="none of the 2 stages"):
        choose_stage(swarm(rec("a", 0)), [1.0, 1.0], fits=())


def test_rebalancing_never_moves_to_a_stage_that_does_not_fit():
    snap = swarm(rec("a", 0), rec("b", 0), rec("c", 0), rec("e", 2))  # stage 1 is empty
    costs = [1.0, 1.0, 1.0]
    assert should_move(snap, costs, "a") == 1
    assert should_move(snap, costs, "a", fits=(0, 1)) == 1
    assert should_move(snap, costs, "a", fits=(0, 2)) is None  # stage 2 would not raise the minimum: stay
    assert should_move(snap, costs, "a", fits=(0,)) is None


def test_announced_throughput_is_a_median_so_one_descheduled_micro_batch_does_not_move_joiners():
    from peer.ops.metrics import PeerMetrics
    from peer.pipeline.meter import ComputeMeter

    meter = ComputeMeter(None, cost=1.0, is_last=False)
    for mb in range(20):
        meter.record(mb, 0.001, backward=True)
    meter.record(99, 0.05, backward=True)  # the OS took the core away for 50 ms
    assert meter.throughput() == pytest.approx(1000.0)  # a moving average said ~300
    metrics = PeerMetrics("b1", 0)
    metrics.inc("tokens", 256)
    metrics.stage = 1
    metrics.inc("tokens", 512)
    assert metrics.tokens_by_stage == {0: 256, 1: 512}  # a stage move splits the tokens a peer counted
