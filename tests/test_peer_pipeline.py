"""In-process pipeline: two PipelineServicer objects wired by a fake transport that packs and unpacks every message.

Exercises the daemon's forward/backward handlers, the compute queue, retries, drops and re-queues, and evaluation
with real StageWorkers, without processes or sockets (those are the swarm tests).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from peer.config import PeerConfig
from peer.membership.records import PeerRecord
from peer.membership.routing import Router
from peer.ops.metrics import PeerMetrics
from peer.pipeline.driver import Stage0Driver
from peer.pipeline.servicer import PipelineServicer
from peer.state.spare import SpareStore
from protocol.codecs.registry import encode
from protocol.messages import Ack, Error, Forward, pack, unpack
from tests.notaries import NamedNotary
from trainer.config import RunConfig
from trainer.data import BatchStream, load_corpus, val_batches
from trainer.worker import StageWorker

RUN = RunConfig.from_toml(Path(__file__).parent / "runs" / "tiny.toml")


class Net:
    """Delivers messages between in-process stages, through pack/unpack, with optional failures."""

    def __init__(self) -> None:
        self.stages: dict[str, PipelineServicer] = {}
        self.dead: set[str] = set()
        self.make = None  # build's factory of (re)started peers
        self.book: dict = {}  # name -> identity key (tests/notaries.py)

    def sender(self, me: str):
        async def send(peer: str, name: str, msg):
            if me in self.dead:  # a dead process sends nothing
                raise ConnectionError(f"{me} is gone")
            if peer in self.dead:
                raise ConnectionError(f"{peer} is gone")
            target = self.stages[peer]
            handler = {"forward": target.rpc_forward, "backward": target.rpc_backward}.get(name)
            if name == "testimony":
                handler = target.testimony.rpc_testimony if target.testimony is not None else None
            elif name == "fraud":
                handler = target.rpc_fraud
            if handler is None:
                raise ConnectionError(f"{peer} serves no {name!r}")
            return unpack(pack(await handler(unpack(pack(msg)), me)))
        return send


def build(net: Net, ids_by_stage: list[list[str]], cfg: PeerConfig, run: RunConfig = RUN):
    pool = ThreadPoolExecutor(max_workers=1)

    async def compute(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    records = {pid: PeerRecord(peer_id=pid, stage=s, throughput=1.0, queue=0, version=0, state="training")
               for s, ids in enumerate(ids_by_stage) for pid in ids}

    def make(pid: str, s: int) -> PipelineServicer:
        """A fresh peer ``pid`` at stage ``s`` (also: one restarted with its identity, nothing of it kept)."""
        net.stages[pid] = PipelineServicer(run=run, stage=s, worker=StageWorker(run, s), compute=compute,
                                           send=net.sender(pid), swarm=lambda: records,
                                           router=Router([1.0] * run.n_stages, rng=random.Random(0)),
                                           metrics=PeerMetrics(pid, s), cfg=cfg, my_id=pid, cost=1.0,
                                           notary=NamedNotary(pid, net.book))
        return net.stages[pid]

    for s, ids in enumerate(ids_by_stage):
        for pid in ids:
            make(pid, s)
    net.make = make
    return pool


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(RUN.data, RUN.model.vocab_size)


def _average_now(workers: list[StageWorker]) -> None:
    """Give ``workers`` the mean of their weights (on the compute thread, between two of their micro-batches)."""
    with torch.no_grad():
        for params in zip(*(w.parameters() for w in workers), strict=True):
            mean = torch.stack([p.detach() for p in params]).mean(0)
            for p in params:
                p.copy_(mean)


async def _average(net: Net, replicas: list[str], every_s: float) -> None:
    """What the daemon's averaging does for honest replicas of a stage, in its simplest form: their plain mean every
    ``every_s`` (replicas that never average drift apart, and one that routing starved evaluates badly)."""
    workers = [net.stages[pid].worker for pid in replicas]
    while True:
        await asyncio.sleep(every_s)
        await net.stages[replicas[0]].compute(_average_now, workers)


async def fresher_copies(spares: SpareStore) -> None:
    """The daemon's backup loop as far as re-checks see it: a copy asked for (``SpareStore.want_fresh``) comes at
    once, of the held state at the next step (the tests' next stage is a static copy or a liar: a fresher copy of
    the honest stage holds the same weights)."""
    while True:
        await spares.fresh_wanted.wait()
        spares.fresh_wanted.clear()
        info = spares.info
        state = None if info is None else spares.read(info.stage)
        if info is not None and state is not None:
            spares.offer(info.stage, {**state, "local_step": info.step + 1}, source=info.source,
                         taken_at=time.time())


async def _run_driver(net: Net, corpus, cfg: PeerConfig, steps: int, run_for: float = 120.0,
                      average: tuple[str, ...] = (), average_every_s: float = 0.5,
                      until: Callable[[], bool] | None = None) -> Stage0Driver:
    """Drive ``steps`` optimiser steps of stage 0 (or ``run_for`` seconds, or until ``until()`` holds: polled every
    0.1 s), then evaluate; the replicas named in ``average`` are averaged every ``average_every_s`` meanwhile."""
    pipe0 = net.stages["a0"]
    stop = asyncio.Event()
    driver = Stage0Driver(pipe=pipe0, stream=BatchStream(corpus.train, 32, 8, seed=1),
                          val=val_batches(corpus, 32, 8, 2), inflight=3, stop=stop, max_steps=steps,
                          metrics=pipe0.metrics)
    serving = [asyncio.ensure_future(p.serve()) for p in net.stages.values()]
    serving.append(asyncio.get_running_loop().call_later(run_for, stop.set))
    serving += [asyncio.ensure_future(fresher_copies(p.recheck.copy.spares)) for p in net.stages.values()
                if getattr(p, "recheck", None) is not None]
    if average:
        serving.append(asyncio.ensure_future(_average(net, list(average), average_every_s)))
    if until is not None:
        serving.append(asyncio.ensure_future(_stop_when(until, stop)))
    try:
        await driver.run_async()
        if not stop.is_set():
            await driver.evaluate()
    finally:
        for t in serving:
            t.cancel()
    return driver


async def _stop_when(until: Callable[[], bool], stop: asyncio.Event) -> None:
    while not until():
        await asyncio.sleep(0.1)
    stop.set()


@pytest.mark.timeout(150)
def test_two_stage_pipeline_trains_and_evaluates(corpus):
    torch.manual_seed(0)
    net = Net()
    cfg = PeerConfig(microbatch_timeout_s=30.0)
    pool = build(net, [["a0"], ["b1", "c1"]], cfg)
    measured = []
    net.stages["a0"].meter.on_first_measure = lambda: measured.append(net.stages["a0"].meter.throughput())
    vouched: dict[str, set[str]] = {pid: set() for pid in net.stages}
    for pid, stage in net.stages.items():
        stage.vouch = vouched[pid].add
    # the stage-1 replicas are averaged as the daemon would: unaveraged, one that routing under load starved of work
    # failed a spot check against the other (cosine < 0.1), or evaluated above the untrained loss
    driver = asyncio.run(_run_driver(net, corpus, cfg, steps=60, average=("b1", "c1")))
    pool.shutdown()
    # trust is earned by validated work: stage 0 vouches for the stage-1 peers whose gradients it took, they for it
    assert vouched["a0"] == {"b1", "c1"} and vouched["b1"] == vouched["c1"] == {"a0"}
    assert len(measured) == 1 and measured[0] > 0  # the daemon announces its first real throughput at once
    assert net.stages["a0"].worker.local_step >= 60
    steps1 = net.stages["b1"].worker.local_step + net.stages["c1"].worker.local_step
    assert steps1 >= 60 and net.stages["b1"].worker.local_step > 5 and net.stages["c1"].worker.local_step > 5
    first, last = sum(driver.losses[:5]) / 5, sum(driver.losses[-5:]) / 5
    assert last < first - 0.5, (first, last)
    assert driver.val_losses and driver.val_losses[-1] < first
    assert not net.stages["a0"].pending and not net.stages["b1"].pending
    checks = net.stages["a0"].metrics.snapshot()["counters"]  # two honest replicas check out (peer.pipeline.spotcheck)
    assert checks.get("spotcheck_passed", 0) >= 4 and checks.get("spotcheck_failed", 0) == 0, checks
    # stage 0 keeps 3 micro-batches in flight, so its gradients come back about 2 of its own steps late; how many
    # depends on the two stages' relative speed, which load changes: only "late at all" and "not later than the
    # micro-batches in flight" are asserted
    assert 0.2 < net.stages["a0"].metrics.pipeline_delay <= 3.0, net.stages["a0"].metrics.pipeline_delay


@pytest.mark.timeout(150)
def test_spot_checks_in_a_three_stage_pipeline_are_not_replays_downstream(corpus):
    """Stage 1's spot checks send a micro-batch to both stage-1 replicas, and each forwards it: stage 2 takes both
    copies (each stage labels what it sends), and no micro-batch is dropped for it."""
    torch.manual_seed(0)
    net = Net()
    cfg = PeerConfig(microbatch_timeout_s=30.0)
    run = RUN.replace(n_stages=3, model={"n_layer": 3})
    pool = build(net, [["a0"], ["b1", "c1"], ["d2", "e2"]], cfg, run)
    asyncio.run(_run_driver(net, corpus, cfg, steps=40))
    pool.shutdown()
    counters = {pid: stage.metrics.snapshot()["counters"] for pid, stage in net.stages.items()}
    sent = sum(counters[pid].get("spotcheck_sent", 0) for pid in ("a0", "b1", "c1"))
    assert sent >= 4, counters  # new hops are checked on every micro-batch until trusted
    assert all(counters[pid].get("rejected:replayed_microbatch", 0) == 0 for pid in ("d2", "e2")), counters
    # (stage 0 may still drop a few: early in training the gradient norms outgrow the bounds learnt on the first)
    assert net.stages["a0"].worker.local_step >= 40
    assert net.stages["d2"].worker.local_step + net.stages["e2"].worker.local_step >= 40 + 1  # copies train too


@pytest.mark.timeout(150)
def test_dead_hop_is_retried_elsewhere_and_broken_route_requeues(corpus):
    net = Net()
    cfg = PeerConfig(microbatch_timeout_s=30.0, hop_retries=2, ban_base_s=60.0)
    pool = build(net, [["a0"], ["b1", "dead1"]], cfg)
    net.dead.add("dead1")
    asyncio.run(_run_driver(net, corpus, cfg, steps=10))
    m0 = net.stages["a0"].metrics.snapshot()["counters"]
    assert net.stages["b1"].worker.local_step >= 10
    assert m0.get("retries", 0) >= 1  # the dead peer was tried, banned, and b1 took over
    assert m0.get("microbatches_dropped", 0) == 0
    # now the whole stage is gone: micro-batches are dropped and their samples re-queued, nothing is lost
    net.dead.add("b1")
    net.stages["a0"]._accepting = True  # the first run's drain at max_steps closed it (a stage-0 driver stops then)
    driver2 = asyncio.run(_run_driver(net, corpus, cfg, steps=10_000, run_for=3.0))
    pool.shutdown()
    m0 = net.stages["a0"].metrics.snapshot()["counters"]
    assert m0["microbatches_dropped"] >= 1 and m0["microbatches_requeued"] == m0["microbatches_dropped"]
    assert driver2.tokens == 0 and net.stages["a0"].worker.pending() == 0


async def _until(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return cond()


@pytest.mark.timeout(150)
def test_a_middle_hop_whose_next_stage_died_is_not_banned_and_training_resumes_when_it_returns(corpus):
    """Stage 2 dies whole while stage 1 holds stage 0's micro-batches. Stage 1 forfeits what the dead peers held,
    drops what it can no longer send on, tells stage 0, and answers Busy while it has no route; stage 0 does not judge
    it a black hole (a 60-s ban would stall the run long after stage 2 is back), and training resumes within seconds
    of stage 2's restart."""
    torch.manual_seed(0)
    net = Net()
    cfg = PeerConfig(microbatch_timeout_s=60.0)
    run = RUN.replace(n_stages=3, model={"n_layer": 3})
    pool = build(net, [["a0"], ["b1"], ["d2", "e2"]], cfg, run)
    pipe0 = net.stages["a0"]

    async def main() -> float:
        stop = asyncio.Event()
        driver = Stage0Driver(pipe=pipe0, stream=BatchStream(corpus.train, 32, 8, seed=1), val=[], inflight=3,
                              stop=stop, max_steps=100_000, metrics=pipe0.metrics)
        tasks = [asyncio.ensure_future(p.serve()) for p in net.stages.values()]

        async def expiring():  # the daemon's 1-s tick
            while True:
                await asyncio.sleep(1.0)
                for p in list(net.stages.values()):
                    await p.expire()

        tasks.append(asyncio.ensure_future(expiring()))
        running = asyncio.ensure_future(driver.run_async())
        try:
            assert await _until(lambda: pipe0.worker.local_step >= 15, 60.0), pipe0.metrics.snapshot()
            net.dead |= {"d2", "e2"}  # killed with the micro-batches they hold
            await asyncio.sleep(8.0)
            for pid in ("d2", "e2"):  # restarted under their identities, nothing kept
                tasks.append(asyncio.ensure_future(net.make(pid, 2).serve()))
            net.dead -= {"d2", "e2"}
            back, at = time.monotonic(), pipe0.worker.local_step
            assert await _until(lambda: pipe0.worker.local_step >= at + 10, 40.0), pipe0.metrics.snapshot()
            return time.monotonic() - back
        finally:
            stop.set()
            for t in [running, *tasks]:
                t.cancel()
            await asyncio.gather(running, *tasks, return_exceptions=True)

    resumed_s = asyncio.run(main())
    pool.shutdown()
    c0, c1 = (net.stages[pid].metrics.snapshot()["counters"] for pid in ("a0", "b1"))
    assert c0.get("black_holes_banned", 0) == 0, c0
    assert c1.get("busy_next_down", 0) >= 1, c1  # it took no work it could not send on
    assert c1.get("microbatches_forfeited", 0) + c1.get("microbatches_dropped", 0) >= 1, c1
    assert resumed_s < 15.0, resumed_s  # 10 steps within seconds of stage 2's return, not after a ban


@pytest.mark.timeout(60)
def test_no_peer_at_the_next_stage_is_shown_to_the_operator(corpus):
    net = Net()
    cfg = PeerConfig(microbatch_timeout_s=30.0)
    pool = build(net, [["a0"], []], cfg)  # stage 1 is empty: stage 0 can only wait
    driver = asyncio.run(_run_driver(net, corpus, cfg, steps=10, run_for=6.0))
    pool.shutdown()
    assert driver.tokens == 0 and net.stages["a0"].worker.local_step == 0
    warnings = [w["text"] for w in net.stages["a0"].metrics.snapshot()["warnings"]]
    assert any("no reachable peer serves stage 1" in w and "--stage 1" in w for w in warnings), warnings


def test_handlers_reject_bad_input_with_codes(corpus):
    net = Net()
    cfg = PeerConfig()
    pool = build(net, [["a0"], ["b1"]], cfg)
    stage1 = net.stages["b1"]
    x = torch.randn(8, 32, 32)
    y = torch.randint(0, 256, (8, 32))

    def fwd(**kw):
        base = dict(run_id=RUN.run_id, mb_id=1, route=["a0"], activations=encode(x, "int8"),
                    targets=encode(y, "none"), is_eval=False, sent_at=1.0)
        base.update(kw)
        return Forward(**base)

    async def go():
        out = {}
        out["run"] = await stage1.rpc_forward(fwd(run_id="other"), "a0")
        out["route"] = await stage1.rpc_forward(fwd(route=["zz"]), "a0")
        out["shape"] = await stage1.rpc_forward(fwd(activations=encode(torch.randn(8, 32, 16), "int8")), "a0")
        out["nan"] = await stage1.rpc_forward(fwd(activations=encode(torch.full((8, 32, 32), float("nan")),
                                                                      "none")), "a0")
        out["vocab"] = await stage1.rpc_forward(fwd(targets=encode(torch.full((8, 32), 999), "none")), "a0")
        out["mode"] = await stage1.rpc_forward(fwd(flush=3), "a0")  # a sync-mode sender, this peer is async
        out["ok"] = await stage1.rpc_forward(fwd(), "a0")
        out["dup"] = await stage1.rpc_forward(fwd(), "a0")
        return out

    out = asyncio.run(go())
    pool.shutdown()
    assert isinstance(out["ok"], Ack)
    for k in ("run", "route", "shape", "nan", "vocab", "mode", "dup"):
        assert isinstance(out[k], Error), k
    assert "--mode async" in out["mode"].message
    counters = stage1.metrics.snapshot()["counters"]
    assert counters["rejected:wrong_run"] == 1 and counters["rejected:bad_tensor"] == 2
    assert counters["rejected:mode_mismatch"] == 1


@pytest.mark.timeout(150)
def test_sync_mode_carries_the_flush_number_and_closes_a_flush_before_the_next_forward(corpus):
    """Stage 0 stamps every training forward with its flush; a later stage hears each flush before computing it."""
    net = Net()
    cfg = PeerConfig(microbatch_timeout_s=30.0, mode="sync")
    pool = build(net, [["a0"], ["b1"]], cfg)
    pipe0, pipe1 = net.stages["a0"], net.stages["b1"]
    pipe0.worker.auto_step = pipe1.worker.auto_step = False  # sync mode: the flush steps, not each backward
    seen: list[tuple[int, int]] = []  # (flush, stage-1 micro-batches computed before it was announced)

    async def on_flush(flush: int) -> None:
        seen.append((flush, pipe1.metrics.snapshot()["counters"].get("samples", 0) // 8))

    pipe1.on_flush = on_flush

    async def go() -> None:
        stop = asyncio.Event()
        driver = Stage0Driver(pipe=pipe0, stream=BatchStream(corpus.train, 32, 8, seed=1), val=[], inflight=3,
                              stop=stop, max_steps=3, metrics=pipe0.metrics)
        flushes = iter(range(40, 100))
        serving = [asyncio.ensure_future(p.serve()) for p in net.stages.values()]

        async def step() -> None:
            await pipe0.compute(pipe0.worker.optimizer_step)
        try:
            await asyncio.wait_for(driver.run_sync(4, step, flush_no=lambda: next(flushes)), 120)
        finally:
            for t in serving:
                t.cancel()

    asyncio.run(go())
    pool.shutdown()
    assert pipe0.worker.local_step == 3
    assert [f for f, _ in seen] == [40] * 4 + [41] * 4 + [42] * 4  # every forward, in flush order
    assert [n for _, n in seen][::4] == [0, 4, 8]  # flush f arrived only after all of flush f - 1 was computed
