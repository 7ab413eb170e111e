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
    assert router.stats["x"].busy_until <= clock.t + router.ban_max_s
    assert not router.down([rec("x")], 1)  # busy is not down: it takes work again soon


def test_the_next_stage_is_down_when_every_peer_of_it_failed_or_none_is_announced():
    clock = Clock()
    router = Router([1.0, 1.0], clock=clock)
    recs = [rec("a"), rec("b"), rec("other", stage=2)]
    assert router.down([rec("other", stage=2)], 1)  # nobody announced for stage 1
    assert not router.down(recs, 1)
    router.failure("a")
    assert not router.down(recs, 1)  # b still takes work
    router.busy("b", 0.5)
    assert not router.down(recs, 1)
    router.failure("b")
    assert router.down(recs, 1)
    clock.t += 2.1  # the bans run out: worth trying again
    assert not router.down(recs, 1)
    assert router.down([rec("a", state="joining")], 1)


def test_a_hop_whose_call_failed_forfeits_what_it_held_at_once():
    """A dead peer answers nothing: what it held is dropped (and re-sent upstream) on its first failed call, not
    after the black-hole wait or the micro-batch deadline."""
    clock = Clock()
    router = Router([1.0, 1.0], clock=clock)
    router.sent("dead", 1)
    router.sent("dead", 2)
    router.sent("alive", 3)
    assert router.lost() == []
    router.failure("dead")
    assert router.lost() == [("dead", [1, 2])]
    assert router.lost() == []  # forfeited once
    router.success("dead", 0.01)  # it answers again: what it takes now is owed as usual
    router.sent("dead", 4)
    assert router.lost() == [] and router.stats["alive"].outstanding.keys() == {3}


def test_a_hop_silent_past_its_wait_forfeits_fewer_micro_batches_than_the_black_hole_rule_needs():
    """Two micro-batches held by a peer that stopped answering (dead, no call made to it since) were held until their
    deadline; now they are forfeited one floor after the black-hole wait, with a failure's short ban, not the
    longest: a peer restarted under its identity is routed to again soon. Not in sync mode (``silent=False``)."""
    from peer.membership.routing import BLACKHOLE_MIN_S

    clock = Clock()
    router = Router([1.0, 1.0], clock=clock, ban_max_s=60.0)
    router.sent("p", 0)
    clock.t += 0.1
    router.returned("p", 0)
    clock.t += 0.1
    router.sent("p", 1)
    router.sent("p", 2)
    clock.t += 2 * BLACKHOLE_MIN_S - 0.1
    assert router.lost() == [] and router.black_holes() == []  # still within the wait and the floor after it
    clock.t += 0.2
    assert router.lost(silent=False) == []
    assert router.lost() == [("p", [1, 2])] and router.black_holes() == []
    assert router.stats["p"].banned_until <= clock.t + router.ban_base_s


def test_a_restarted_peer_forfeits_what_it_held_and_is_judged_afresh():
    """A peer killed holding our micro-batches and restarted under its identity: once its record says it joins again
    (or counts fewer tokens), its bans for failing or swallowing work end, what it held is dropped, and it is
    capped as a newcomer until it answers; a ban for fabricated work stays."""
    clock = Clock()
    router = Router([1.0, 1.0], clock=clock, ban_max_s=60.0)
    for pid in ("p", "liar"):
        router.sent(pid, 0)
        clock.t += 0.1
        router.returned(pid, 0)
    router.observe([rec("p", thr=1.0), rec("liar")])
    for i in range(1, 5):
        router.sent("p", i)
    clock.t += 10.0
    assert [p for p, _ in router.black_holes()] == ["p"]  # banned for the longest ban
    router.sent("p", 9)  # (one more it held, sent before the ban)
    router.ban("liar", 600.0)
    assert router.down([rec("p"), rec("liar")], 1)
    router.observe([rec("p", state="joining"), rec("liar", state="joining")])
    assert router.lost() == [("p", [9])]
    assert [r.peer_id for r in router.candidates([rec("p"), rec("liar")], 1)] == ["p"]
    assert router.stats["p"].service_s is None  # a newcomer again: one micro-batch until it answers
    # a record counting fewer tokens than before is a restart too
    router.observe([PeerRecord(peer_id="q", stage=1, throughput=1.0, queue=0, version=0, state="training",
                               tokens=5000)])
    router.sent("q", 20)
    router.observe([PeerRecord(peer_id="q", stage=1, throughput=1.0, queue=0, version=0, state="training",
                               tokens=5200)])
    assert router.lost() == []
    router.observe([PeerRecord(peer_id="q", stage=1, throughput=1.0, queue=0, version=0, state="training",
                               tokens=40)])
    assert router.lost() == [("q", [20])]


def test_a_hop_that_never_answered_is_banned_briefly_at_first_and_longer_each_time():
    """An honest newcomer's first round trip can outlast the wait (a churn run banned one for 60 s); it held one
    micro-batch, so its first ban is short, and doubles per verdict until the hop answers; a hop that answered before
    and then swallows several is banned for the longest ban at once."""
    from peer.membership.routing import BLACKHOLE_NEWCOMER_BAN_S, BLACKHOLE_UNMEASURED_S

    clock = Clock()
    router = Router([1.0, 1.0], clock=clock, ban_max_s=60.0)
    bans = []
    for i in range(6):
        router.sent("new", i)
        clock.t += BLACKHOLE_UNMEASURED_S + 0.1
        assert [p for p, _ in router.black_holes()] == ["new"]
        bans.append(round(router.stats["new"].banned_until - clock.t, 1))
        clock.t = router.stats["new"].banned_until
    assert bans == [BLACKHOLE_NEWCOMER_BAN_S * 2**i for i in range(4)] + [60.0, 60.0], bans
    router.sent("new", 10)  # it answers at last: judged afresh
    clock.t += 0.5
    router.returned("new", 10)
    assert router.stats["new"].holes == 0
    clock.t += 0.1
    for i in range(11, 14):  # measured now, and swallowing 3
        router.sent("new", i)
    clock.t += 10.0
    assert [p for p, _ in router.black_holes()] == ["new"]
    assert router.stats["new"].banned_until - clock.t == pytest.approx(60.0)


def test_the_black_hole_wait_leaves_time_for_the_later_stages_to_judge_their_own_hops():
    """A hop whose own next stage died holds our micro-batches for no fault of its own; the stage after it judges
    that stage first (its wait is shorter by BLACKHOLE_STAGE_S per stage) and tells the hop, which tells us."""
    from peer.membership.routing import BLACKHOLE_MIN_S, BLACKHOLE_STAGE_S

    clock = Clock()
    router = Router([1.0, 1.0, 1.0], clock=clock)
    router.sent("hop", 0)
    clock.t += 0.1
    router.returned("hop", 0)  # measured: 0.1-s round trips, so the floor decides
    clock.t += 0.1
    for i in range(1, 4):
        router.sent("hop", i)
    clock.t += BLACKHOLE_MIN_S + 0.1
    assert router.black_holes(later_stages=1) == []  # the stage after the hop had its turn first
    assert [p for p, _ in router.black_holes(later_stages=0)] == ["hop"]  # the last stage: judged at the floor
    for i in range(4, 7):
        router.sent("hop", i)
    clock.t += BLACKHOLE_MIN_S + BLACKHOLE_STAGE_S + 0.1
    assert [p for p, _ in router.black_holes(later_stages=1)] == ["hop"]


def test_forget_bounds_memory():
    router = Router([1.0])
    router.failure("gone")
    router.success("here", 0.1)
    router.forget(["here"])
    assert set(router.stats) == {"here"}


def test_a_ban_for_fabricated_work_outlives_a_lapsed_record(monkeypatch):
    """A peer banned for bad work (``ban``) that lets its record lapse for a moment and announces again is still
    banned (a live red-team liar did this by accident and got its work back); the memory of such bans is bounded."""
    from peer.membership import routing

    clock = Clock()
    router = Router([1.0, 1.0], clock=clock)
    router.ban("liar", 3600.0)
    router.failure("flaky")
    router.forget(["honest"])  # both absent from the view for one refresh
    assert "liar" in router.stats and "flaky" not in router.stats
    assert [r.peer_id for r in router.candidates([rec("liar"), rec("honest")], 1)] == ["honest"]
    clock.t += 3601.0
    router.forget(["honest"])
    assert "liar" not in router.stats
    monkeypatch.setattr(routing, "MAX_PENALISED", 2)
    for i in range(4):
        router.ban(f"p{i}", 100.0 + i)
    router.forget([])
    assert set(router.stats) == {"p2", "p3"}  # the bans that end last are kept


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
