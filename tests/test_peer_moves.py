"""Stage moves that cannot empty a stage: ``may_leave`` on hand-built snapshots, and several peers whose rebalance
timers align negotiating through an in-process DHT with propagation delay (the old decide/jitter/re-check procedure
empties the stage in the same scenario; the claim protocol never does)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest

from peer.membership.moves import Mover, MoveTiming
from peer.membership.records import PeerRecord
from peer.membership.stage_choice import capacities, may_leave, should_move


def rec(pid: str, stage: int, thr: float = 1.0, state: str = "training") -> PeerRecord:
    return PeerRecord(peer_id=pid, stage=stage, throughput=thr, queue=0, version=0, state=state)


def snap(*recs: PeerRecord) -> dict[str, PeerRecord]:
    return {r.peer_id: r for r in recs}


# ----- pure rules ------------------------------------------------------------------------------------------------
def test_may_leave_only_with_a_training_peer_left_and_no_other_claim():
    assert may_leave(snap(rec("a", 1, state="draining"), rec("b", 1)), "a")
    assert not may_leave(snap(rec("a", 1, state="draining"), rec("b", 1, state="draining")), "a")  # both claim
    assert not may_leave(snap(rec("a", 1, state="draining")), "a")  # the last peer of its stage never leaves
    assert not may_leave(snap(rec("a", 1, state="draining"), rec("b", 1, state="loading_state")), "a")
    assert not may_leave(snap(rec("a", 1, state="draining"), rec("b", 0)), "a")  # b serves another stage
    assert not may_leave(snap(rec("b", 1)), "a")  # our own claim is not visible yet: wait for it
    three = snap(rec("a", 1, state="draining"), rec("b", 1, state="draining"), rec("c", 1))
    assert not may_leave(three, "a") and not may_leave(three, "b")  # one mover per stage at a time


def test_a_draining_peer_counts_for_no_capacity():
    assert capacities(snap(rec("a", 0), rec("b", 1, state="draining")), [1.0, 1.0]) == [1.0, 0.0]
    # with its replica leaving, b must not move away from stage 1 as well
    assert should_move(snap(rec("a", 0, 0.2), rec("b", 1), rec("c", 1, state="draining")), [1.0, 1.0], "b") is None


def test_invalid_timing_is_refused():
    with pytest.raises(ValueError, match="settle_s"):
        MoveTiming(jitter_s=0, settle_s=-1, cooldown_s=0)


# ----- aligned timers through a DHT with propagation delay -------------------------------------------------------
class FakeDHT:
    """Records become visible to readers ``delay`` seconds after they were stored (as through a real DHT)."""

    def __init__(self, records: dict[str, PeerRecord], delay: float) -> None:
        self.visible = dict(records)
        self.delay = delay
        self.history: list[dict[str, PeerRecord]] = [dict(records)]

    async def read(self) -> dict[str, PeerRecord]:
        await asyncio.sleep(0.001)
        return dict(self.visible)

    async def store(self, record: PeerRecord) -> None:
        async def land() -> None:
            await asyncio.sleep(self.delay)
            self.visible[record.peer_id] = record
            self.history.append(dict(self.visible))
        asyncio.ensure_future(land())
        await asyncio.sleep(self.delay)  # a store returns once the responsible nodes hold it


SWARM = (rec("s0", 0, 0.5), rec("p", 1, 1.0), rec("q", 1, 1.0), rec("r", 1, 1.0))  # stage 0 starved


async def _old_procedure(dht: FakeDHT, pid: str, rng: random.Random, costs: list[float]) -> int | None:
    """The loop before the claim protocol: decide, jitter, re-check, then announce 'draining' and go (a 'draining'
    peer still counted for its stage's capacity then)."""
    async def read_as_before() -> dict[str, PeerRecord]:
        return {k: replace(r, state="training") if r.state == "draining" else r for k, r in (await dht.read()).items()}

    target = should_move(await read_as_before(), costs, pid)
    if target is None:
        return None
    await asyncio.sleep(rng.uniform(0, 0.05))
    target = should_move(await read_as_before(), costs, pid)
    if target is None:
        return None
    me = (await dht.read())[pid]
    await dht.store(replace(me, state="draining"))
    await dht.store(replace(me, stage=target, state="training"))
    return target


async def _claim_procedure(dht: FakeDHT, pid: str, rng: random.Random, costs: list[float]) -> int | None:
    mover = Mover(costs, quality=0.75, timing=MoveTiming(jitter_s=0.05, settle_s=0.1, cooldown_s=1.0), rng=rng)

    async def announce(state: str) -> None:
        me = (await dht.read()).get(pid) or dict(SWARM_BY_ID)[pid]
        await dht.store(replace(me, state=state))

    target = await mover.decide(my_id=pid, read=dht.read, claim=lambda: announce("draining"),
                                release=lambda: announce("training"))
    if target is not None:
        me = (await dht.read())[pid]
        await dht.store(replace(me, stage=target, state="training"))
    return target


SWARM_BY_ID = {r.peer_id: r for r in SWARM}


def _race(procedure, seed: int, pids: tuple[str, ...]) -> tuple[list[int | None], FakeDHT]:
    dht = FakeDHT(snap(*SWARM), delay=0.03)
    costs = [1.0, 1.0]

    async def main() -> list[int | None]:
        return await asyncio.gather(*(procedure(dht, pid, random.Random(seed * 100 + i), costs)
                                      for i, pid in enumerate(pids)))

    return asyncio.run(main()), dht


def _stage_ever_emptied(dht: FakeDHT, stage: int) -> bool:
    """True if at some moment no peer held ``stage`` any more (a 'draining' claimant still holds and serves it)."""
    return any(not any(r.stage == stage for r in view.values()) for view in dht.history)


def test_aligned_timers_empty_the_stage_with_the_old_procedure():
    emptied = 0
    for seed in range(5):
        moves, dht = _race(_old_procedure, seed, ("p", "q", "r"))
        emptied += _stage_ever_emptied(dht, 1)
    assert emptied == 5  # the scenario is a real race: every trial emptied stage 1


def test_aligned_timers_never_empty_a_stage_with_the_claim_protocol():
    for seed in range(10):
        moves, dht = _race(_claim_procedure, seed, ("p", "q", "r"))
        assert not _stage_ever_emptied(dht, 1), (seed, moves)
        assert not _stage_ever_emptied(dht, 0), (seed, moves)
        assert sum(m is not None for m in moves) <= 1, moves  # one mover per stage per round


def test_a_single_mover_still_moves_and_then_cools_down():
    moves, dht = _race(_claim_procedure, 0, ("p",))
    assert moves == [0]
    assert dht.visible["p"].stage == 0 and dht.visible["p"].state == "training"

    mover = Mover([1.0, 1.0], quality=0.75, timing=MoveTiming(jitter_s=0, settle_s=0, cooldown_s=60))
    mover.cool_down()

    async def never() -> dict[str, PeerRecord]:
        raise AssertionError("a cooling-down peer must not even read the swarm")

    async def nothing() -> None:
        return None

    assert asyncio.run(mover.decide(my_id="p", read=never, claim=nothing, release=nothing)) is None


def test_a_mover_never_moves_to_a_stage_outside_the_ones_that_fit():
    """The daemon gives its Mover the stages its memory holds: a starved stage that does not fit is not taken."""

    async def decide(fits):
        swarm = snap(rec("a", 0), rec("b", 0), rec("c", 0), rec("d", 2))  # stage 1 empty, stage 2 thin

        async def read():
            return dict(swarm)

        async def claim():
            swarm["a"] = replace(swarm["a"], state="draining")

        async def release():
            swarm["a"] = replace(swarm["a"], state="training")

        async def no_sleep(_s):
            return None

        mover = Mover([1.0, 1.0, 1.0], quality=0.75, timing=MoveTiming(jitter_s=0, settle_s=0, cooldown_s=0),
                      sleep=no_sleep, fits=fits)
        return await mover.decide(my_id="a", read=read, claim=claim, release=release)

    assert asyncio.run(decide(None)) == 1
    assert asyncio.run(decide((0, 1))) == 1
    assert asyncio.run(decide((0, 2))) is None  # stage 1 does not fit; stage 2 would not raise the minimum
