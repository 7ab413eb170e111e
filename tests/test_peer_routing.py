"""Next-hop choice: weights, bans with backoff, busy skips (pure, fake clock)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from peer.membership.records import PeerRecord
from peer.membership.routing import NoRouteError, Router


def rec(pid: str, stage: int = 1, thr: float = 1.0, queue: int = 0, state: str = "training") -> PeerRecord:
    return PeerRecord(peer_id=pid, stage=stage, throughput=thr, queue=queue, version=0, state=state)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_choice_follows_capacity_and_queue():
    router = Router([1.0, 1.0], rng=random.Random(0))
    recs = [rec("fast", thr=10.0), rec("slow", thr=1.0), rec("queued", thr=10.0, queue=50)]
    counts = Counter(router.choose(recs, 1).peer_id for _ in range(3000))
    assert counts["fast"] > 3 * counts["slow"] > 0
    assert counts["fast"] > 3 * counts["queued"]


def test_latency_lowers_weight():
    router = Router([1.0, 1.0])
    near, far = rec("near", thr=100.0), rec("far", thr=100.0)
    for _ in range(30):
        router.success("near", 0.001)
        router.success("far", 0.5)
    assert router.weight(near) > 10 * router.weight(far)


def test_only_training_peers_of_the_stage_and_not_excluded():
    router = Router([1.0, 1.0])
    recs = [rec("a", stage=0), rec("b", state="joining"), rec("c"), rec("d")]
    assert {router.choose(recs, 1, exclude=["d"]).peer_id for _ in range(50)} == {"c"}
    with pytest.raises(NoRouteError, match="stage 1"):
        router.choose([rec("a", stage=0)], 1)


def test_ban_backoff_doubles_and_caps_and_success_resets():
    clock = Clock()
    router = Router([1.0, 1.0], ban_base_s=2.0, ban_max_s=10.0, clock=clock)
    assert [router.failure("x") for _ in range(5)] == [2.0, 4.0, 8.0, 10.0, 10.0]
    assert router.candidates([rec("x")], 1) == []
    with pytest.raises(NoRouteError):
        router.choose([rec("x")], 1)
    clock.t += 10.5
    assert router.choose([rec("x")], 1).peer_id == "x"
    router.success("x", 0.01)
    assert router.failure("x") == 2.0


def test_busy_skips_for_the_time_asked_without_failure():
    clock = Clock()
    router = Router([1.0, 1.0], clock=clock)
    router.busy("x", 0.5)
    assert router.candidates([rec("x")], 1) == [] and router.stats["x"].failures == 0
    clock.t += 0.6
    assert router.candidates([rec("x")], 1) == [rec("x")]
    router.busy("x", 1e9)  # a remote cannot make us ignore it forever
    assert router.stats["x"].banned_until <= clock.t + router.ban_max_s


def test_forget_bounds_memory():
    router = Router([1.0])
    router.failure("gone")
    router.success("here", 0.1)
    router.forget(["here"])
    assert set(router.stats) == {"here"}


def test_a_hop_that_never_answered_holds_one_micro_batch_while_another_can_take_them():
    """A black hole must not collect every slot in flight one by one (the stage would stall for the whole wait
    before it is judged): until its first answer a hop gets at most one of our micro-batches, unless it is the only
    hop; one overdue micro-batch is then enough to judge it."""
    from peer.membership.routing import BLACKHOLE_UNMEASURED_S

    clock = Clock()
    router = Router([1.0, 1.0], rng=random.Random(0), clock=clock)
    for i in range(5):  # the honest hop has answered
        router.sent("honest", i)
        clock.t += 0.1
        router.returned("honest", i)
    recs = [rec("honest"), rec("new")]
    router.sent("new", 100)  # the newcomer took one
    assert {router.choose(recs, 1).peer_id for _ in range(200)} == {"honest"}
    assert {router.choose([rec("new")], 1).peer_id for _ in range(20)} == {"new"}  # the only hop: no cap
    with router.sending("new2"):  # a send not yet acknowledged counts: concurrent micro-batches choose in one RTT
        assert {router.choose([rec("honest"), rec("new2")], 1).peer_id for _ in range(200)} == {"honest"}
    assert "new2" in {router.choose([rec("honest"), rec("new2")], 1).peer_id for _ in range(200)}
    clock.t += BLACKHOLE_UNMEASURED_S + 0.1
    assert router.black_holes() == [("new", [100])]
    router.sent("other", 200)  # a newcomer that answers is measured and capped no longer
    clock.t += 0.2
    router.returned("other", 200)
    router.sent("other", 201)
    router.sent("other", 202)
    assert "other" in {router.choose([rec("honest"), rec("other")], 1).peer_id for _ in range(200)}
