"""No spin, no silent sample loss: a stage-0 driver whose next stage is unreachable backs off instead of spinning,
and a driver that stops (its peer leaves stage 0) hands its re-queued and in-flight samples back to the peer's ledger,
which the next driver trains first and which survives a restart through the checkpoint folder."""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from peer.config import PeerConfig
from peer.membership.records import PeerRecord
from peer.membership.routing import Router
from peer.ops.metrics import PeerMetrics
from peer.pipeline.driver import Stage0Driver
from peer.pipeline.ledger import SAMPLES_FILE, SampleLedger
from peer.pipeline.servicer import PipelineServicer
from trainer.config import RunConfig
from trainer.data import BatchStream, load_corpus
from trainer.worker import StageWorker

RUN = RunConfig.from_toml(Path(__file__).parent / "runs" / "tiny.toml")


class CountingStream(BatchStream):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.drawn: list[tuple[torch.Tensor, torch.Tensor]] = []

    def next(self):
        s = super().next()
        self.drawn.append(s)
        return s


def _stage0(records: dict[str, PeerRecord], send) -> tuple[PipelineServicer, ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(max_workers=1)

    async def compute(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    cfg = PeerConfig(microbatch_timeout_s=30.0, rpc_timeout_s=1.0)
    pipe = PipelineServicer(run=RUN, stage=0, worker=StageWorker(RUN, 0), compute=compute, send=send,
                            swarm=lambda: records, router=Router([1.0, 1.0], rng=random.Random(0), ban_base_s=0.01,
                                                                 ban_max_s=0.02),
                            metrics=PeerMetrics("a0", 0), cfg=cfg, my_id="a0", cost=1.0)
    return pipe, pool


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(RUN.data, RUN.model.vocab_size)


@pytest.mark.timeout(60)
def test_an_unreachable_next_stage_does_not_make_stage_0_spin(corpus):
    records = {"b1": PeerRecord(peer_id="b1", stage=1, throughput=1.0, queue=0, version=0, state="training")}

    async def send(peer, name, msg):  # the only stage-1 peer is gone: every send fails at once
        raise ConnectionError("gone")

    pipe, pool = _stage0(records, send)

    async def go() -> Stage0Driver:
        stop = asyncio.Event()
        driver = Stage0Driver(pipe=pipe, stream=CountingStream(corpus.train, 32, 8, seed=1), val=[], inflight=3,
                              stop=stop, max_steps=0, metrics=pipe.metrics)
        task = asyncio.ensure_future(driver.run_async())
        await asyncio.sleep(4.0)
        stop.set()
        await asyncio.wait_for(task, 10)
        return driver

    driver = asyncio.run(go())
    pool.shutdown()
    dropped = pipe.metrics.snapshot()["counters"].get("microbatches_dropped", 0)
    # before the back-off: hundreds of forwards in 4 s; with it, a handful per slot (0.1 + 0.2 + ... capped at 2 s)
    assert 3 <= dropped <= 30, dropped
    # nothing was trained and nothing is lost: every drawn sample is owed by the ledger
    assert len(driver.ledger) == len(driver.stream.drawn) > 0


@pytest.mark.timeout(60)
def test_leaving_stage_0_hands_samples_back_and_the_next_driver_trains_them_first(corpus, tmp_path):
    records: dict[str, PeerRecord] = {}  # no stage 1 at all: samples wait for a route

    async def send(peer, name, msg):
        raise AssertionError("no peer to send to")

    pipe, pool = _stage0(records, send)
    ledger = SampleLedger()

    async def go() -> Stage0Driver:
        stop = asyncio.Event()
        driver = Stage0Driver(pipe=pipe, stream=CountingStream(corpus.train, 32, 8, seed=1), val=[], inflight=3,
                              stop=stop, max_steps=0, metrics=pipe.metrics, ledger=ledger)
        task = asyncio.ensure_future(driver.run_async())
        await asyncio.sleep(1.0)  # three micro-batches wait for a route to stage 1
        pipe.stop_accepting()  # the peer leaves stage 0 (StageService.leave), then cancels the driver
        await asyncio.sleep(0.5)
        assert not task.done()  # a driver that returned by itself would read as "max_steps reached" to the daemon
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return driver

    driver = asyncio.run(go())
    pool.shutdown()
    drawn = driver.stream.drawn
    assert len(drawn) == 3 and len(ledger) == 3 and ledger.handed_back == 3
    assert {id(s) for s in ledger.owed} == {id(s) for s in drawn}
    # a restart keeps them: saved next to the checkpoints, loaded by the next run of this peer
    ledger.save(tmp_path)
    again = SampleLedger()
    assert again.load(tmp_path) == 3
    for (x, y), (x2, y2) in zip(drawn, again.owed, strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    # the next driver draws the owed samples before new ones
    nxt = Stage0Driver(pipe=pipe, stream=CountingStream(corpus.train, 32, 8, seed=2), val=[], inflight=3,
                       stop=asyncio.Event(), max_steps=0, metrics=pipe.metrics, ledger=again)
    assert all(torch.equal(nxt._sample()[0], x) for x, _ in drawn)
    assert nxt.stream.drawn == [] and len(again) == 0
    again.save(tmp_path)
    kept = torch.load(tmp_path / SAMPLES_FILE, weights_only=True)
    assert kept["samples"] == [] and kept["positions"][driver.stream.key]["batches"] == 3  # the position stays
    SampleLedger().save(tmp_path)
    assert not (tmp_path / SAMPLES_FILE).exists()  # nothing owed and no position: no file


def test_giving_up_owed_samples_is_counted():
    ledger = SampleLedger()
    ledger.give_back([(torch.zeros(1), torch.zeros(1))] * 2)
    assert ledger.lose_all("test") == 2 and ledger.lost == 2 and len(ledger) == 0


def test_settling_at_exit_keeps_owed_samples_or_says_they_are_lost(tmp_path):
    sample = (torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.long))
    kept = SampleLedger()
    kept.give_back([sample])
    assert kept.settle(tmp_path, run_over=False) is None and (tmp_path / SAMPLES_FILE).exists()
    lost = SampleLedger()
    lost.give_back([sample, sample])
    assert "2 training samples lost" in lost.settle(None, run_over=False) and lost.lost == 2
    over = SampleLedger()
    over.give_back([sample])
    assert over.settle(None, run_over=True) is None and over.lost == 0
