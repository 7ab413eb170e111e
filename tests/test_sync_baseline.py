"""The daemon's synchronous baseline is the papers' FullSync: its optimiser and schedule, and no black-hole ban."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from peer.config import PeerConfig
from peer.membership.records import PeerRecord
from peer.membership.routing import Router
from peer.ops.metrics import PeerMetrics
from peer.pipeline.servicer import PipelineServicer
from trainer.config import RunConfig
from trainer.optim import lr_at
from trainer.sim.methods import METHODS, fullsync_optim
from trainer.sim.simulator import SimConfig
from trainer.worker import StageWorker

RUN = RunConfig.from_toml(Path(__file__).parent / "runs" / "tiny.toml")


def test_fullsync_schedule_is_counted_in_samples_equal_to_the_async_modes():
    opt = fullsync_optim(RUN.optim, 4)
    assert (opt.optimizer, opt.beta1, opt.weight_stashing, opt.accumulate) == ("adamw", 0.9, False, 1)
    assert opt.warmup_steps == RUN.optim.warmup_steps // 4 and opt.total_steps == RUN.optim.total_steps // 4
    # flush k (M micro-batches per replica) runs at the learning rate of async step M * k, up to rounding
    for k in (0, 50, 100, 300):
        assert abs(lr_at(opt, k) - lr_at(RUN.optim, 4 * k + 3)) <= 0.05 * RUN.optim.lr, k
    nadam = fullsync_optim(RUN.optim, 4, optimizer="nadam", lr=1e-3)
    assert (nadam.optimizer, nadam.beta1, nadam.lr) == ("nadam", 0.99, 1e-3)
    with pytest.raises(ValueError):
        fullsync_optim(RUN.optim, 4, optimizer="sgd")


def test_the_simulators_fullsync_and_the_daemons_sync_worker_use_the_same_optimiser():
    sim = SimConfig(run=RUN, steps=8, micro_batches=4, accumulate=4, sync_optimizer="nadam", sync_lr=2e-3)
    run = METHODS["fullsync"].configure(RUN, sim)
    assert run.optim == fullsync_optim(RUN.optim, 4, optimizer="nadam", lr=2e-3)
    worker = StageWorker(RUN, 0, auto_step=False, optim=fullsync_optim(RUN.optim, 4))
    group = worker.optimizer.param_groups[0]
    # beta1 0.9 on every stage, not the run's no-stashing stage-dependent beta1 (0.99 at stage 0)
    assert type(worker.optimizer).__name__ == "AdamW" and group["betas"][0] == 0.9
    assert worker.state_dict()["run_id"] == RUN.run_id  # the run (and its id) stay the swarm's
    with pytest.raises(ValueError):
        PeerConfig(mode="sync", sync_optimizer="sgd")
    with pytest.raises(ValueError):
        SimConfig(run=RUN, steps=8, micro_batches=4, accumulate=4, sync_lr=-1.0)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_hop_that_holds_a_flush_is_not_banned_as_a_black_hole_in_sync_mode(mode: str):
    """In sync mode a later stage rightly holds a flush's micro-batches while it waits at its barrier; the pinned
    next hop is the only route, so a black-hole ban stalled the pipeline for ban_max_s (3 replicas per stage)."""
    clock = [1.0]
    router = Router([1.0, 1.0], rng=random.Random(0), clock=lambda: clock[0])
    pipe = PipelineServicer(run=RUN, stage=0, worker=StageWorker(RUN, 0), compute=None, send=None, swarm=dict,
                            router=router, metrics=PeerMetrics("a0", 0), cfg=PeerConfig(mode=mode), my_id="a0",
                            cost=1.0)
    for mb in range(4):
        router.sent("b1", mb)
    clock[0] += 30.0  # far past any black-hole wait, well within microbatch_timeout_s
    asyncio.run(pipe.expire())
    b1 = PeerRecord(peer_id="b1", stage=1, throughput=1.0, queue=0, version=0, state="training")
    assert router.candidates([b1], 1) == ([] if mode == "async" else [b1])  # banned in async mode only


def test_a_flush_that_waits_for_a_full_mesh_says_so_with_the_counts():
    """Sync mode starts a flush only when every stage has the same number of training replicas; a wait used to be
    silent (a replica whose view missed one peer waited without a word). It is logged and shown once per wait."""
    from types import SimpleNamespace

    from peer import sync_schedule
    from peer.sync_schedule import SyncSchedule

    run = RunConfig.from_toml(Path(__file__).parent / "runs" / "tiny.toml")
    swarm = {pid: PeerRecord(peer_id=pid, stage=s, throughput=1.0, queue=0, version=0, state="training")
             for pid, s in (("c", 0), ("a", 1), ("b", 1))}
    metrics = PeerMetrics("c", 0)
    host = SimpleNamespace(run=run, net=SimpleNamespace(swarm=swarm, my_id="c"), metrics=metrics)
    now = [100.0]
    sched = SyncSchedule(host, 0, SimpleNamespace(local_step=0), None, None)  # type: ignore[arg-type]
    sched.now = lambda: now[0]
    assert not sched.full_mesh() and not metrics.snapshot()["warnings"]
    now[0] += sync_schedule.MESH_WARN_S + 1
    assert not sched.full_mesh() and not sched.full_mesh()  # once per wait
    warnings = metrics.snapshot()["warnings"]
    assert len(warnings) == 1 and warnings[0]["count"] == 1 and "[1, 2]" in warnings[0]["text"], warnings
    swarm["d"] = PeerRecord(peer_id="d", stage=0, throughput=1.0, queue=0, version=0, state="training")
    assert sched.full_mesh() and not metrics.snapshot()["warnings"]  # resolved once the mesh is full
