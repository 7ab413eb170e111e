"""``--mode sync`` on one stage (the baseline the asynchronous mode is compared with): a gradient barrier among the
stage's replicas before every optimiser step, scheduled around the pipeline's flushes."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from peer.averaging.config import NetAveragingConfig
from peer.averaging.fork import resync, weights_digest
from peer.averaging.sync import FlushClock, StageMembers, SyncAverager
from peer.ids import short_id
from peer.lifecycle import PeerState

if TYPE_CHECKING:
    from peer.host import StageContext
    from peer.ops.metrics import PeerMetrics
    from peer.pipeline.servicer import PipelineServicer
    from peer.seams import Compute
    from trainer.config import RunConfig
    from trainer.worker import StageWorker

logger = logging.getLogger(__name__)
T = TypeVar("T")
# a replica that a partner's barrier finds with nothing of the flush waits this long for its share before joining
# with a zero gradient (the pinned route delivers it a moment later; routing that sent the whole flush to the partner
# does not)
EMPTY_FLUSH_WAIT_S = 3.0

__all__ = ["SyncSchedule", "barrier_step"]

MESH_WARN_S = 10.0  # a flush that waits this long for a full mesh says so


async def barrier_step(averager: SyncAverager, worker: StageWorker, compute: Compute, step: int, peers: list[str], *,
                       run: RunConfig, stage: int, metrics: PeerMetrics) -> int:
    """Gradient barrier ``step`` with ``peers``, one optimiser step with the mean, and, when the barrier's digests
    show that our weights forked from the replicas', their state loaded (peer.averaging.fork). Returns the number of
    replicas averaged. ``compute(fn, *args, urgent=...)`` runs ``fn`` on the compute thread."""
    # the mean over this flush's micro-batches, as the simulator's fullsync and GPipe take it: with the sum,
    # clipping at optim.grad_clip would act on M times larger norms
    grads, digest = await compute(
        lambda: (worker.mean_grads(), weights_digest(worker.parameters(), worker.local_step)))
    mean, n = await averager.all_average(step, grads, peers, digest=digest)
    await compute(worker.set_grads, mean)
    await compute(worker.optimizer_step)
    fork = averager.fork
    if fork is not None:

        def worker_call(fn: Callable[[StageWorker], T]) -> Awaitable[T]:
            return compute(fn, worker, urgent=True)

        await resync(fork, transport=averager.exchange.transport, run=run, stage=stage, worker_call=worker_call,
                     metrics=metrics, timeout_s=averager.config.sync_resync_s)
    return n


class SyncSchedule:
    """``--mode sync`` on one stage: a gradient barrier among the stage's replicas, then one optimiser step.

    Stage 0 closes a flush when every gradient of it is back (``flush``); a later stage closes flush f when its share
    of f is done, on the first forward of flush f + 1, or when a replica of its stage opens the barrier with it
    (``FlushClock``). Barriers run one at a time, in the background of the servicer: a forward of a later flush waits
    for the barriers before it (``forward_flush``), nothing else does.
    """

    def __init__(self, host: StageContext, stage: int, worker: StageWorker, pipe: PipelineServicer,
                 averager: SyncAverager) -> None:
        self.host, self.stage, self.worker, self.pipe, self.averager = host, stage, worker, pipe, averager
        self.step = worker.local_step
        self.clock: FlushClock = FlushClock()
        self.lock = asyncio.Lock()
        self.drained: dict[int, int] = {}  # flush -> backwards done here
        self.opened: set[int] = set()  # flushes whose barrier a replica of our stage opened with us
        self.running: asyncio.Task[None] | None = None  # the latest barrier (they run in order, under the lock)
        self.unmeshed_since: float | None = None  # when the wait for a full mesh began
        self.mesh_warned = False
        self.now: Callable[[], float] = time.monotonic

    @classmethod
    async def start(cls, host: StageContext, stage: int, worker: StageWorker, pipe: PipelineServicer) -> SyncSchedule:
        # a part is admitted only from an announced replica of the stage: a stranger's must not open barriers,
        # hold the pending steps or make this stage close a flush early
        config = NetAveragingConfig()
        members = StageMembers(stage=stage, swarm=lambda: host.net.swarm, refresh=host.net.refresh_swarm,
                               refresh_s=config.member_refresh_s)
        averager = SyncAverager(p2p=host.p2p, rpc_server=host.handlers, run=host.run, stage=stage,
                                metrics=host.metrics, config=config, member=members)
        await averager.start()
        self = cls(host, stage, worker, pipe, averager)
        if stage > 0:
            pipe.on_flush = self.forward_flush
            pipe.on_backward_done = self.backward_done
            averager.on_remote_open = self.remote_barrier
        return self

    async def average_and_step(self, step: int) -> None:
        """Gradient barrier ``step`` among the stage's replicas (p = 1, tau = 0), then one optimiser step; when the
        barrier's digests show that our weights forked from the replicas', their state is loaded before anything of
        the next flush runs (peer.averaging.fork)."""
        host, worker = self.host, self.worker
        peers = [r.peer_id for r in host.net.swarm.values() if r.stage == self.stage and r.state == PeerState.TRAINING]
        n = await barrier_step(self.averager, worker, host.compute, step, peers, run=host.run, stage=self.stage,
                               metrics=host.metrics)
        self.step = self.averager.last_step + 1  # the barrier may have jumped ahead to the replicas' step
        host.metrics.local_step = worker.local_step
        host.metrics.observe_round(ok=n > 1, group_size=n, tau=0.0)

    def full_mesh(self) -> bool:
        """Every stage has the same number (>= 1) of training replicas and we are one of them. A wait longer than
        ``MESH_WARN_S`` is logged and shown on the dashboard once, with the counts, until the mesh is full."""
        host = self.host
        counts = [0] * host.run.n_stages
        for r in host.net.swarm.values():
            if r.state == PeerState.TRAINING and 0 <= r.stage < host.run.n_stages:
                counts[r.stage] += 1
        member = host.net.my_id in host.net.swarm
        full = member and min(counts) >= 1 and len(set(counts)) == 1
        now = self.now()
        if full:
            self.unmeshed_since, self.mesh_warned = None, False
            host.metrics.resolve("sync_mesh")
        elif self.unmeshed_since is None:
            self.unmeshed_since = now
        elif now - self.unmeshed_since > MESH_WARN_S and not self.mesh_warned:
            self.mesh_warned = True
            text = (f"sync mode: flushes wait until every stage has the same number of training replicas; the view "
                    f"of the swarm shows {counts} per stage{'' if member else ' and not us'}"
                    f" (start or stop peers so that the counts match)")
            logger.warning("%s", text)
            host.metrics.warn(text, key="sync_mesh")
        return full

    async def flush(self) -> None:
        """Stage 0: every gradient of the flush is back; average and step (the barrier is the flush number)."""
        await self.average_and_step(self.step)

    def _run(self, barrier: int, why: str) -> None:
        logger.debug("closing flush %d: %s", barrier, why)
        self.running = self.pipe.spawn(self._barrier(barrier))

    async def _barrier(self, barrier: int) -> None:
        async with self.lock:
            try:
                await self.average_and_step(barrier)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the replicas resynchronise at the next barrier (its step is adopted)
                logger.warning("sync barrier %d failed: %r; the flush's gradient is dropped", barrier, e)
                self.host.metrics.inc("sync_barrier_failed")

    def _working_on(self, flush: int) -> bool:
        """Micro-batches of ``flush`` (or earlier) are still in this stage: their gradient belongs to its barrier."""
        return self.pipe.holds_flush(flush)

    def backward_done(self, flush: int) -> None:
        """A later stage: a backward of ``flush`` is done here; the M-th closes the flush at once (the drain), as
        does the last one here of a flush a replica already waits for."""
        self.drained[flush] = self.drained.get(flush, 0) + 1
        for old in [f for f in self.drained if f < flush - 2]:
            del self.drained[old]
        self.opened = {f for f in self.opened if f >= flush - 2}
        if self.drained[flush] >= self.host.cfg.sync_microbatches:
            barrier = self.clock.on_drained(flush)
            if barrier is not None:
                self._run(barrier, "its micro-batches are done here")
        elif flush in self.opened and not self._working_on(flush):
            barrier = self.clock.on_remote_barrier(flush)
            if barrier is not None:
                self._run(barrier, "a replica waits and our part of the flush is done")

    async def forward_flush(self, flush: int) -> None:
        """A later stage: a training forward of ``flush`` arrived; the flushes before it are closed first."""
        if self.clock.current is not None and flush < self.clock.current:
            self.host.metrics.inc("sync_late_forwards")  # a retry of an earlier flush: its gradient joins this one
        barrier = self.clock.on_forward(flush)
        if barrier is not None:
            self._run(barrier, f"a forward of flush {flush} arrived")
        if self.running is not None and not self.running.done():
            await asyncio.shield(self.running)

    def remote_barrier(self, step: int, peer: str) -> None:
        """A later stage: a replica of our stage waits at barrier ``step``; join it unless we did already."""
        stage = self.stage
        if any(r.peer_id == peer and r.stage == stage for r in self.host.net.swarm.values()):
            self.opened.add(step)
            if self._working_on(step):  # joining now would leave those micro-batches' gradient out of the step;
                return  # the last of them closes the flush (backward_done)
            if self.drained.get(step, 0) == 0:  # our share may still be on its way from stage 0: wait a little
                asyncio.get_running_loop().call_later(EMPTY_FLUSH_WAIT_S, self._join_empty, step)
                return
            self._join_empty(step)
        else:
            logger.debug("barrier %d opened by %s, not a replica of stage %d in our view", step, short_id(peer), stage)

    def _join_empty(self, step: int) -> None:
        """Join barrier ``step`` a replica opened, with what we hold of the flush (nothing at worst), unless our
        share arrived meanwhile (then its last backward closes it). While an earlier barrier still runs here (a
        resync loading a replica's state, peer.averaging.fork), the forwards of this flush wait for it and none of our
        share could arrive: we wait again instead of joining with nothing."""
        if self._working_on(step):
            return
        if self.lock.locked() and self.drained.get(step, 0) == 0:
            asyncio.get_running_loop().call_later(EMPTY_FLUSH_WAIT_S, self._join_empty, step)
            return
        barrier = self.clock.on_remote_barrier(step)
        if barrier is not None:
            self._run(barrier, "a replica opened its barrier")
