"""Spot checks in flight (peer.pipeline.crosscheck): the second send and the two answers held until judged, with a
scripted network and hand-made gradients (no peer, no model)."""

from __future__ import annotations

import asyncio
import random

import torch

from peer.pipeline.crosscheck import CrossChecks
from peer.pipeline.spotcheck import SpotCheckConfig, SpotChecker
from peer.pipeline.work import BackwardWork, Pending
from protocol.messages import Ack, Backward
from tests.test_peer_hops import Net, forward, hops, rec


def checks(net: Net, records: list, **config: float) -> tuple[CrossChecks, dict[str, list]]:
    h, router, metrics = hops(net, records)
    spot = SpotChecker(SpotCheckConfig(**config), count=metrics.inc, rng=random.Random(0))
    seen: dict[str, list] = {"requeued": [], "dropped": [], "gone": []}

    async def drop(mb_id: int) -> None:
        seen["dropped"].append(mb_id)

    return CrossChecks(spot, stage=0, hops=h, router=router, metrics=metrics,
                       held=lambda mb_id, p: mb_id not in seen["gone"], requeue=seen["requeued"].append,
                       drop=drop), seen


def pending() -> Pending:
    return Pending(prev_peer=None, next_peer="b1", route=["a0"], deadline=1e12)


def backward(mb_id: int = 7) -> Backward:
    return Backward(run_id="run", mb_id=mb_id, route=["a0"], gradient=None, loss=None, is_eval=False)


def test_a_second_replica_gets_the_same_forward_and_both_answers_are_awaited():
    net = Net({"c1": [Ack()]})
    cc, seen = checks(net, [rec("b1"), rec("c1")])
    p = pending()
    asyncio.run(cc.second(p, "b1", forward()))
    assert net.calls == [("c1", "forward")] and p.checks == {"b1": None, "c1": None} and "c1" in p.sent_to
    assert cc.metrics.count("spotcheck_sent") == 1 and list(cc.router.stats["c1"].outstanding) == [7]  # owed


def test_a_lone_replica_is_not_checked():
    net = Net({})
    cc, _ = checks(net, [rec("b1")])
    p = pending()
    asyncio.run(cc.second(p, "b1", forward()))
    assert net.calls == [] and p.checks is None


def test_a_micro_batch_dropped_while_its_partner_was_asked_is_left_alone():
    cc, seen = checks(Net({"c1": [ConnectionError("down")]}), [rec("b1"), rec("c1")])
    seen["gone"].append(7)
    asyncio.run(cc.second(pending(), "b1", forward()))
    assert seen["dropped"] == seen["requeued"] == [] and cc.metrics.count("spotcheck_unavailable") == 0


def test_no_partner_answer_drops_an_untrusted_hops_work_and_keeps_a_trusted_ones():
    g = torch.ones(2, 3)
    cc, seen = checks(Net({"c1": [ConnectionError("down")]}), [rec("b1"), rec("c1")])
    p = pending()
    asyncio.run(cc.second(p, "b1", forward()))
    assert seen["dropped"] == [7] and p.checks is None and cc.metrics.count("spotcheck_unavailable") == 1
    cc, seen = checks(Net({"c1": [ConnectionError("down")]}), [rec("b1"), rec("c1")], trust_after=0)
    p = pending()

    async def answer_first() -> None:  # b1's gradient arrives while the partner is still being asked
        sending = asyncio.ensure_future(cc.second(p, "b1", forward()))
        await asyncio.sleep(0)
        assert p.checks is not None and cc.answer(p, "b1", backward(), g) is None
        await sending
    asyncio.run(answer_first())
    assert seen["dropped"] == [] and len(seen["requeued"]) == 1 and isinstance(seen["requeued"][0], BackwardWork)
    assert torch.equal(seen["requeued"][0].grad, g)


def test_two_answers_that_agree_train_their_mean_and_disagreeing_ones_ban_the_newcomer():
    g = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    cc, _ = checks(Net({}), [], ban_after=2, blame_span_s=0.0)
    p = pending()
    p.checks = {"b1": None, "c1": None}
    assert cc.answer(p, "c1", backward(), g) is None  # held until its partner's answer is here
    msg, grad = cc.answer(p, "b1", backward(), 3 * g)
    assert grad is not None and torch.allclose(grad, 2 * g) and p.checks is None
    for _ in range(2):
        p.checks = {"b1": None, "c1": None}
        cc.answer(p, "b1", backward(), g)
        msg, grad = cc.answer(p, "c1", backward(), -g)
        assert grad is None  # neither is trained on; dropped here and upstream
    assert cc.router.candidates([rec("b1"), rec("c1")], 1) in ([rec("b1")], [rec("c1")])  # one of them banned
    assert cc.metrics.count("spotcheck_banned") == 1 and cc.metrics.count("spotcheck_failed") == 2
    p.checks = {"b1": None, "c1": None}
    assert cc.answer(p, "b1", backward(), None) == (backward(), None) and p.checks is None  # a drop: void
    assert cc.metrics.count("spotcheck_void") == 1


def test_a_check_sent_under_a_stages_own_id_is_held_owed_and_dropped_under_the_local_one():
    cc, seen = checks(Net({"c1": [Ack()]}), [rec("b1"), rec("c1")])
    asyncio.run(cc.second(pending(), "b1", forward(), local_id=3))  # forward() carries 7, the id the hops see
    assert list(cc.router.stats["c1"].outstanding) == [3]
    cc2, seen2 = checks(Net({"c1": [ConnectionError("down")]}), [rec("b1"), rec("c1")])
    asyncio.run(cc2.second(pending(), "b1", forward(), local_id=3))
    assert seen2["dropped"] == [3]  # an untrusted hop without its partner's answer: dropped under the local id


def test_each_stage_labels_what_it_sends_so_two_copies_of_one_micro_batch_are_two_micro_batches_downstream():
    from peer.pipeline.work import MicroBatchIds

    a, b = MicroBatchIds(), MicroBatchIds()  # two replicas of stage 1, both sent micro-batch 7 (a spot check)
    sent_a, sent_b = a.new(local=7), b.new(local=7)
    assert sent_a != sent_b  # stage 2 takes both: neither is a replay of the other
    assert a.local(sent_a) == 7 and b.local(sent_b) == 7  # each maps its gradient back to the micro-batch it holds
    assert a.local(12345) == 12345  # not one of its labels: kept (stage 0's own ids)
    small = MicroBatchIds(remember=2)
    first = small.new(local=1)
    small.new(local=2), small.new(local=3)
    assert small.local(first) == first  # forgotten beyond its memory (the micro-batch timed out long before)
    assert len({a.new() for _ in range(1000)}) == 1000
