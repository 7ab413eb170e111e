"""A stage's sends (peer.pipeline.hops) and its compute meter (peer.pipeline.meter), with a scripted network: no
peer, no model, no sleeping beyond a few Busy waits of milliseconds."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from peer.config import Mode, PeerConfig
from peer.membership.records import PeerRecord
from peer.membership.routing import Router
from peer.ops.metrics import PeerMetrics
from peer.pipeline.hops import BACKWARD_RPC, FORWARD_RPC, OUT_OF_BOUNDS_WAIT_S, OUT_OF_BOUNDS_WARN_S, Hops
from peer.pipeline.meter import ComputeMeter
from protocol.codecs.registry import encode
from protocol.errors import ErrorCode, RemoteError
from protocol.messages import Ack, Busy, Forward, Message


def rec(pid: str, stage: int = 1) -> PeerRecord:
    return PeerRecord(peer_id=pid, stage=stage, throughput=1.0, queue=0, version=0, state="training")


class Net:
    """Answers each call with the next scripted reply of its peer (an exception is raised); records every call."""

    def __init__(self, script: dict[str, list[Message | Exception]]) -> None:
        self.script, self.calls = script, []

    async def send(self, peer_id: str, name: str, msg: Message) -> Message:
        self.calls.append((peer_id, name))
        await asyncio.sleep(0)  # a call yields to the event loop, as a real one does
        reply = self.script[peer_id].pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply


def hops(net: Net, records: list[PeerRecord], **cfg: object) -> tuple[Hops, Router, PeerMetrics]:
    router, metrics = Router([1.0, 1.0], rng=random.Random(0)), PeerMetrics("a0", 0)
    swarm = {r.peer_id: r for r in records}
    return Hops(run_id="run", stage=0, my_id="a0", cfg=PeerConfig(**cfg), send=net.send, swarm=lambda: swarm,
                router=router, metrics=metrics, accepting=lambda: True), router, metrics


def forward() -> Forward:
    return Forward(run_id="run", mb_id=7, route=["a0"], activations=encode(torch.zeros(1, 2, 4), "none"),
                   targets=None, is_eval=False, sent_at=0.0)


def test_a_failing_hop_is_banned_and_the_forward_goes_to_another():
    net = Net({"c1": [ConnectionError("down")], "b1": [Ack()]})  # the seeded router tries c1 first
    h, router, metrics = hops(net, [rec("b1"), rec("c1"), rec("x0", stage=0)], hop_retries=3)
    sent_to: set[str] = set()
    assert asyncio.run(h.forward(forward(), sent_to)) == "b1"
    assert net.calls == [("c1", FORWARD_RPC), ("b1", FORWARD_RPC)] and sent_to == {"b1", "c1"}
    assert router.candidates([rec("b1"), rec("c1")], 1) == [rec("b1")] and metrics.count("retries") == 1


def test_busy_is_not_a_failure_and_too_many_failures_give_up():
    net = Net({"b1": [Busy(retry_after_s=0.0), ConnectionError("x")], "c1": [ConnectionError("x")]})
    h, router, metrics = hops(net, [rec("b1"), rec("c1")], hop_retries=2)
    got = asyncio.run(h.forward(forward(), set()))
    assert got is None and len(net.calls) == 3  # a Busy hop is asked again; two failures end the forward
    assert metrics.count("busy_received") == 1 and metrics.count("retries") == 2
    assert router.stats["b1"].failures == router.stats["c1"].failures == 1


def test_a_draining_stage_stops_waiting_for_a_route():
    net = Net({})
    h, _, _ = hops(net, [])  # nobody serves stage 1
    h.accepting = lambda: False
    assert asyncio.run(asyncio.wait_for(h.forward(forward(), set()), 1.0)) is None and net.calls == []


def test_a_backward_is_sent_twice_at_most_then_the_hop_counts_a_failure():
    net = Net({"z0": [ConnectionError("a"), ConnectionError("b")]})
    h, router, metrics = hops(net, [rec("z0", stage=0)])
    asyncio.run(h.backward("z0", 7, ["z0"], None, None, False))
    assert net.calls == [("z0", BACKWARD_RPC)] * 2 and metrics.count("retries") == 2
    assert router.stats["z0"].failures == 1
    asyncio.run(h.backward(None, 7, [], None, None, False))  # nobody to tell: nothing sent
    assert len(net.calls) == 2


def test_sync_mode_pins_each_replica_to_one_next_hop():
    records = [rec("a0", stage=0), rec("a9", stage=0), rec("b1"), rec("c1")]
    h, _, _ = hops(Net({}), records, mode=Mode.SYNC)
    assert [r.peer_id for r in h.next_hops(1)] == ["b1"]  # a0 is the first replica of stage 0 by id: b1 is its hop


def test_the_meter_times_a_micro_batch_forward_plus_backward_and_forgets_dropped_ones():
    async def compute(fn, *args, urgent=False):
        return fn(*args)

    measured: list[float] = []
    meter = ComputeMeter(compute, cost=2.0, is_last=False)
    meter.on_first_measure = lambda: measured.append(meter.throughput())
    meter.record(1, 0.2, backward=False)
    assert meter.throughput() == 0.0 and measured == []  # a forward alone is half a micro-batch
    meter.record(1, 0.3, backward=True)
    assert meter.throughput() == pytest.approx(2.0 / 0.5) and measured == [pytest.approx(4.0)]
    meter.record(2, 5.0, backward=False)
    meter.forget(2)  # dropped: its forward's time counts for nothing
    meter.record(2, 0.5, backward=True)
    assert meter.compute_s_per_mb == pytest.approx(0.5) and len(measured) == 1
    assert asyncio.run(meter.timed(3, True, lambda a, b: a + b, 1, 2)) == 3


def _out_of_bounds() -> RemoteError:
    return RemoteError(ErrorCode.OUT_OF_BOUNDS, "activation norm outside the bounds of recent traffic")


def test_activations_refused_by_every_next_replica_as_out_of_bounds_skip_them_without_a_ban():
    # our weights are what is off (every replica refuses them): nobody is banned, each is skipped for a moment, and
    # the operator is told once it lasts
    net = Net({"b1": [_out_of_bounds()] * 3, "c1": [_out_of_bounds()] * 3})
    h, router, metrics = hops(net, [rec("b1"), rec("c1")], hop_retries=2)
    now = [100.0]
    h.clock = router.clock = lambda: now[0]
    assert asyncio.run(h.forward(forward(), set())) is None
    assert metrics.count("forwards_out_of_bounds") == 2 and metrics.count("retries") == 2
    for pid in ("b1", "c1"):
        assert router.stats[pid].failures == 0 and router.stats[pid].banned_until == 0.0
        assert router.stats[pid].busy_until == pytest.approx(now[0] + OUT_OF_BOUNDS_WAIT_S)
    assert not any("out of bounds" in w["text"] for w in metrics.snapshot()["warnings"])
    now[0] += OUT_OF_BOUNDS_WARN_S + OUT_OF_BOUNDS_WAIT_S  # still refused after the warning's time
    assert asyncio.run(h.forward(forward(), set())) is None
    warned = [w for w in metrics.snapshot()["warnings"] if "out of bounds" in w["text"]]
    assert len(warned) == 1 and "stage 1" in warned[0]["text"]
    net.script["b1"] = [Ack()]  # our work fits again: the warning goes
    now[0] += OUT_OF_BOUNDS_WAIT_S + 0.1
    assert asyncio.run(h.forward(forward(), set())) == "b1"
    assert not any("out of bounds" in w["text"] for w in metrics.snapshot()["warnings"])


def test_a_lone_refuser_while_its_stage_takes_our_work_counts_a_failure():
    net = Net({"b1": [Ack(), Ack()], "c1": [_out_of_bounds()]})
    h, router, metrics = hops(net, [rec("b1"), rec("c1")], hop_retries=3)
    h.cap = lambda ids, w: [1.0 if p == "b1" else 0.0 for p in ids]  # the first forward goes to b1
    assert asyncio.run(h.forward(forward(), set())) == "b1"
    h.cap = lambda ids, w: [1.0 if p == "c1" else 1e-9 for p in ids]  # the next one tries c1 first
    assert asyncio.run(h.forward(forward(), set())) == "b1"
    assert router.stats["c1"].failures == 1 and router.stats["c1"].banned_until > 0
    assert metrics.count("forwards_out_of_bounds") == 1


def test_a_backward_refused_as_out_of_bounds_is_neither_retried_nor_held_against_the_hop():
    net = Net({"z0": [_out_of_bounds()]})
    h, router, metrics = hops(net, [rec("z0", stage=0)])
    asyncio.run(h.backward("z0", 7, ["z0"], None, None, False))
    assert net.calls == [("z0", BACKWARD_RPC)] and metrics.count("backwards_out_of_bounds") == 1
    assert "z0" not in router.stats or router.stats["z0"].failures == 0
