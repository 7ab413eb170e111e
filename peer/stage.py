"""Serving one stage: one object owns everything a peer runs for its stage, created on entry and dropped as a whole.

``StageService(host, stage)`` is created when the peer claims the stage; ``start()`` builds the ``StageWorker`` on the
compute thread, loads the stage's state (the most advanced of donors, the local checkpoint and the run's seeded
init), starts the pipeline servicer, the generation handler (``infer``), the state server and the averaging loop (or,
in ``--mode sync``, the blocking gradient average through ``SyncSchedule``), and on stage 0 the data driver.
``leave()`` stops taking work, drains within the deadline and stops those services, so a rebalancing move is
``leave`` on one object and ``start`` of the next: nothing of the old stage is reset field by field, it is dropped
together.

``StageHost`` is what a stage needs of the peer around it (the ``Daemon``): run and peer config, metrics, the P2P
node and DHT, the handler table, the compute thread, sends, the swarm view and announcements.
``StageHandlers`` lets per-stage services register RPC handlers once per name and be re-bound on a stage move.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from peer.averaging.behaviour import AveragingBehaviour
from peer.averaging.config import NetAveragingConfig
from peer.averaging.loop import AveragingLoop
from peer.averaging.sync import FlushClock, SyncAverager
from peer.config import Mode
from peer.errors import DaemonError
from peer.ids import short_id
from peer.lifecycle import Lifecycle, PeerState
from peer.membership.records import PeerRecord
from peer.membership.routing import Router
from peer.pipeline.driver import Stage0Driver
from peer.pipeline.infer import INFER_RPC, InferService
from peer.pipeline.ledger import SampleLedger
from peer.pipeline.servicer import PipelineStage
from peer.pipeline.shards import move_if_shared, open_shard, reading_shard
from peer.state.backup import backup_loop
from peer.state.checkpoint import CheckpointError
from peer.state.restore import restore_state
from peer.state.spare import SpareStore, adopt_checkpoint
from peer.state.sync import StateServer, StateSyncConfig
from protocol.errors import ErrorCode
from protocol.messages import Error, Message
from protocol.rpc import Handler, HandlerTable, RpcLimits
from trainer.data import BatchStream, load_corpus, shard_seed, val_batches
from trainer.sim.methods import fullsync_optim
from trainer.tokenizer import MissingExtra
from trainer.worker import StageWorker, resolve_device, resolve_precision

if TYPE_CHECKING:
    import torch
    from hivemind import DHT
    from hivemind.p2p import P2P

    from peer.config import PeerConfig
    from peer.ops.metrics import PeerMetrics
    from trainer.config import DataConfig, RunConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")
# sync mode: a replica that a partner's barrier finds with nothing of the flush waits this long for its share before
# joining with a zero gradient (the pinned route delivers it a moment later; routing that sent the whole flush to the
# partner does not)
EMPTY_FLUSH_WAIT_S = 3.0

__all__ = ["DaemonError", "StageHost", "StageService", "StageHandlers", "SyncSchedule"]


class StageHost(Protocol):
    """What a stage uses of the peer that hosts it (``peer.daemon.Daemon``)."""

    run: RunConfig
    cfg: PeerConfig
    metrics: PeerMetrics
    life: Lifecycle
    router: Router
    costs: list[float]
    my_id: str
    p2p: P2P
    dht: DHT
    handlers: StageHandlers
    stop: asyncio.Event
    swarm: dict[str, PeerRecord]
    ledger: SampleLedger
    spares: SpareStore
    averaging_behaviour: AveragingBehaviour | None

    async def compute(self, fn: Callable[..., T], *args: Any, urgent: bool = False) -> T: ...

    async def send(self, peer_id: str, name: str, msg: Message, *, timeout: float | None = None) -> Message: ...

    async def announce(self, state: PeerState | None = None) -> None: ...

    async def checkpoint(self) -> None: ...

    async def refresh_swarm(self) -> dict[str, PeerRecord]: ...

    def trusted_peers(self) -> list[str]: ...

    def vouch(self, peer_id: str) -> None: ...


class StageService:
    """Everything this peer runs for one stage: ``StageService(host, stage)``, then ``await start()``."""

    def __init__(self, host: StageHost, stage: int) -> None:
        self.host, self.stage = host, stage
        self.worker: StageWorker | None = None
        self.pipe: PipelineStage | None = None
        self.infer: InferService | None = None
        self.state_server: StateServer | None = None
        self.averager: AveragingLoop | None = None
        self.sync: SyncSchedule | None = None
        self.driver: Stage0Driver | None = None
        self.driver_task: asyncio.Task | None = None
        self.tasks: list[asyncio.Task] = []
        self.loaded = False  # the stage's state is loaded: only then may a checkpoint of this worker be written

    async def worker_call(self, fn: Callable[[StageWorker], T]) -> T:
        """Run ``fn(worker)`` on the compute thread before any queued micro-batch (the interface of averaging and
        state sync: short jobs that must not wait behind a full compute queue, see peer.compute)."""
        return await self.host.compute(fn, self.worker, urgent=True)

    # ----- entry -----------------------------------------------------------------------------------------------------
    async def load_state(self) -> str:
        """The most advanced of donors, the local checkpoint and the seeded init (``peer.state.restore``). Returns
        the source's kind."""
        host = self.host
        assert self.worker is not None
        reference = await host.compute(self.worker.state_dict)
        try:
            restored = await restore_state(
                run=host.run, stage=self.stage, my_id=host.my_id, refresh=host.refresh_swarm, p2p=host.p2p,
                dht=host.dht, metrics=host.metrics, reference=reference, checkpoint_dir=host.cfg.checkpoint_dir,
                io=host.compute, timeout_s=host.cfg.state_load_timeout_s, spare=host.spares,
                trusted=host.trusted_peers)
        except CheckpointError as e:
            raise DaemonError(str(e)) from e
        if restored.state is not None:
            await host.compute(self.worker.load_state_dict, restored.state)
        return restored.source.kind

    async def start(self) -> None:
        """Build the worker, load the state and start every service of the stage (the caller announced the claim)."""
        host, stage = self.host, self.stage
        device = _device(host.cfg.device)
        precision = resolve_precision(host.cfg.precision, device)
        sync = host.cfg.mode == Mode.SYNC  # the papers' GPipe baseline: its own optimiser, schedule in samples
        optim = (fullsync_optim(host.run.optim, host.cfg.sync_microbatches, optimizer=host.cfg.sync_optimizer,
                                lr=host.cfg.sync_lr or None) if sync else None)
        self.worker = await host.compute(lambda: StageWorker(host.run, stage, device=device, precision=precision,
                                                             auto_step=not sync, optim=optim))
        source = await self.load_state()
        self.loaded = True
        logger.info("stage %d state from %s (local step %d)", stage, source, self.worker.local_step)
        if source in ("donor", "spare"):  # a restart right after joining resumes from here, not downloading again
            await host.checkpoint()
        await asyncio.get_running_loop().run_in_executor(  # a former stage's checkpoint, offered to the swarm
            None, adopt_checkpoint, host.spares, host.cfg.checkpoint_dir, host.run, stage)
        host.metrics.local_step = self.worker.local_step
        self.pipe = pipe = PipelineStage(run=host.run, stage=stage, worker=self.worker, compute=host.compute,
                                         send=host.send, swarm=lambda: host.swarm, router=host.router,
                                         metrics=host.metrics, cfg=host.cfg, my_id=host.my_id,
                                         cost=host.costs[stage])
        # generation through the swarm (``infer``): forward only, at low priority, only while this stage trains
        self.infer = InferService(run=host.run, stage=stage, worker=self.worker, compute=host.compute,
                                  metrics=host.metrics, queued=pipe.queued,
                                  serving=lambda: pipe.accepting and host.life.serving)
        await host.handlers.add_handler(INFER_RPC, self.infer.rpc_infer)
        # Until then our record carries a guess (the swarm's median): a joiner choosing its stage in the meantime
        # would weigh our guess against others' measurements and pile onto our stage, so announce the real figure.
        pipe.on_first_measure = lambda: pipe.spawn(self._announce_measured())
        pipe.vouch = host.vouch
        age = host.cfg.state_snapshot_max_age_s
        self.state_server = StateServer(p2p=host.p2p, rpc_server=host.handlers, run=host.run, stage=stage,
                                        worker_call=self.worker_call, metrics=host.metrics,
                                        config=StateSyncConfig(snapshot_max_age_s=age, snapshot_idle_s=age),
                                        spare=host.spares)
        await self.state_server.start()
        self.state_server.ready = True
        if host.cfg.mode == Mode.ASYNC:
            self.averager = AveragingLoop(p2p=host.p2p, rpc_server=host.handlers, dht=host.dht, run=host.run,
                                          stage=stage, worker_call=self.worker_call, metrics=host.metrics,
                                          config=NetAveragingConfig(), behaviour=host.averaging_behaviour)
            await self.averager.start()
        else:
            self.sync = await SyncSchedule.start(host, self)
        self.tasks = [asyncio.ensure_future(pipe.serve())]
        if host.cfg.backup_every_s > 0 and host.run.n_stages > 1:  # a copy of the next stage (peer.state.backup)
            self.tasks.append(asyncio.ensure_future(backup_loop(
                run=host.run, stage=stage, my_id=host.my_id, period_s=host.cfg.backup_every_s, spares=host.spares,
                metrics=host.metrics, p2p=host.p2p, swarm=lambda: host.swarm,
                busy=lambda: not host.life.serving or pipe.queued() >= max(2, host.cfg.max_queue // 2),
                trusted=host.trusted_peers)))
        host.life.enter(PeerState.TRAINING)
        await host.announce(PeerState.TRAINING)
        await host.refresh_swarm()
        if stage == 0:
            await self._start_driver()

    async def _start_driver(self) -> None:
        host, run, cfg = self.host, self.host.run, self.host.cfg
        assert self.pipe is not None
        data_cfg = run.data if cfg.data_path is None else run.replace(data={"source": cfg.data_path}).data
        try:
            if data_cfg.streamed:
                stream, val = await open_shard(self.host, data_cfg)
            else:
                stream, val = await asyncio.get_running_loop().run_in_executor(None, self._open_corpus, data_cfg)
        except (ValueError, MissingExtra) as e:  # DataError, or a tokenizer file the library refuses
            raise DaemonError(f"data.source {data_cfg.source!r}: {e}") from e
        host.ledger.attach(stream)
        self.driver = Stage0Driver(pipe=self.pipe, stream=stream, val=val, inflight=cfg.inflight_for(run.n_stages),
                                   stop=host.stop, max_steps=cfg.max_steps, metrics=host.metrics, ledger=host.ledger,
                                   samples_log=cfg.samples_log)
        if cfg.mode == Mode.ASYNC:
            self.driver_task = asyncio.ensure_future(self.driver.run_async())
        else:
            assert self.sync is not None
            self.driver_task = asyncio.ensure_future(
                self.driver.run_sync(cfg.sync_microbatches, self.sync.flush, self.sync.full_mesh,
                                     lambda: self.sync.step))
        self.tasks.append(self.driver_task)
        if cfg.eval_every_s > 0:
            self.tasks.append(asyncio.ensure_future(self.driver.eval_loop(cfg.eval_every_s)))

    def _open_corpus(self, data_cfg: DataConfig) -> tuple[BatchStream, list[tuple[torch.Tensor, torch.Tensor]]]:
        """A token array (stdlib, text, .bin): random windows seeded by the peer id, resumed from the ledger."""
        run, cfg = self.host.run, self.host.cfg
        corpus = load_corpus(data_cfg, run.model.vocab_size)
        stream = BatchStream(corpus.train, run.model.block_size, run.data.batch_size,
                             shard_seed(run.seed, self.host.my_id))
        saved = self.host.ledger.position(stream.key)
        if saved is not None:
            stream.resume(saved)
            logger.info("data stream %s resumed after %d batches", stream.key, stream.batches)
        return stream, val_batches(corpus, run.model.block_size, run.data.batch_size, cfg.eval_batches)

    def move_shard(self) -> None:
        """Called after each read of the swarm: leave a data shard a peer with a smaller id also reads."""
        if self.driver is not None and self.pipe is not None and self.pipe.accepting:
            move_if_shared(self.host, self.driver)

    @property
    def data_shard(self) -> int | None:
        """The data shard this stage-0 peer reads (announced in its record), or None."""
        return reading_shard(self.driver) if self.pipe is not None else None

    async def _announce_measured(self) -> None:
        try:
            await self.host.announce()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the periodic announcement follows within announce_every_s anyway
            logger.debug("announcing the first measured throughput failed: %r", e)

    # ----- exit ------------------------------------------------------------------------------------------------------
    async def leave(self) -> None:
        """Stop taking work, wait for in-flight micro-batches (bounded), stop the stage's services."""
        pipe = self.pipe
        if pipe is None:
            return
        pipe.accepting = False
        deadline = time.monotonic() + self.host.cfg.drain_timeout_s
        while pipe.pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if pipe.pending:
            text = (f"leaving stage {self.stage}: drain deadline reached with {len(pipe.pending)} micro-batches in "
                    f"flight; dropping their work (stage 0 re-trains their samples)")
            logger.warning("%s", text)
            self.host.metrics.warn(text)
        for mb in list(pipe.pending):
            await pipe.drop(mb, notify=True)
        if self.averager is not None:
            await self.averager.stop()
        for t in [*self.tasks, *pipe.tasks]:
            t.cancel()
        await asyncio.gather(*self.tasks, *pipe.tasks, return_exceptions=True)
        self.host.handlers.clear()
        self.pipe = self.infer = self.averager = self.sync = self.driver_task = None


class SyncSchedule:
    """``--mode sync`` on one stage: a gradient barrier among the stage's replicas, then one optimiser step.

    Stage 0 closes a flush when every gradient of it is back (``flush``); a later stage closes flush f when its share
    of f is done, on the first forward of flush f + 1, or when a replica of its stage opens the barrier with it
    (``FlushClock``). Barriers run one at a time, in the background of the servicer: a forward of a later flush waits
    for the barriers before it (``forward_flush``), nothing else does.
    """

    def __init__(self, host: StageHost, service: StageService, averager: SyncAverager) -> None:
        self.host, self.service, self.averager = host, service, averager
        assert service.worker is not None
        self.step = service.worker.local_step
        self.clock: FlushClock = FlushClock()
        self.lock = asyncio.Lock()
        self.drained: dict[int, int] = {}  # flush -> backwards done here
        self.opened: set[int] = set()  # flushes whose barrier a replica of our stage opened with us
        self.running: asyncio.Task | None = None  # the latest barrier started (they run in order, under the lock)

    @classmethod
    async def start(cls, host: StageHost, service: StageService) -> SyncSchedule:
        averager = SyncAverager(p2p=host.p2p, rpc_server=host.handlers, run=host.run, stage=service.stage,
                                metrics=host.metrics)
        await averager.start()
        self = cls(host, service, averager)
        if service.stage > 0:
            assert service.pipe is not None
            service.pipe.on_flush = self.forward_flush
            service.pipe.on_backward_done = self.backward_done
            averager.on_remote_open = self.remote_barrier
        return self

    async def average_and_step(self, step: int) -> None:
        """Gradient barrier ``step`` among the stage's replicas (p = 1, tau = 0), then one optimiser step."""
        host, worker = self.host, self.service.worker
        assert worker is not None
        peers = [r.peer_id for r in host.swarm.values()
                 if r.stage == self.service.stage and r.state == PeerState.TRAINING]
        # the mean over this flush's micro-batches, as the simulator's fullsync and GPipe take it: with the sum,
        # clipping at optim.grad_clip would act on M times larger norms
        grads = await host.compute(worker.mean_grads)
        mean, n = await self.averager.all_average(step, grads, peers)
        await host.compute(worker.set_grads, mean)
        await host.compute(worker.optimizer_step)
        self.step = self.averager.last_step + 1  # the barrier may have jumped ahead to the replicas' step
        host.metrics.local_step = worker.local_step
        host.metrics.observe_round(ok=n > 1, group_size=n, tau=0.0)

    def full_mesh(self) -> bool:
        """Every stage has the same number (>= 1) of training replicas and we are one of them."""
        host = self.host
        counts = [0] * host.run.n_stages
        for r in host.swarm.values():
            if r.state == PeerState.TRAINING and 0 <= r.stage < host.run.n_stages:
                counts[r.stage] += 1
        return host.my_id in host.swarm and min(counts) >= 1 and len(set(counts)) == 1

    async def flush(self) -> None:
        """Stage 0: every gradient of the flush is back; average and step (the barrier is the flush number)."""
        await self.average_and_step(self.step)

    def _run(self, barrier: int, why: str) -> None:
        logger.debug("closing flush %d: %s", barrier, why)
        assert self.service.pipe is not None
        self.running = self.service.pipe.spawn(self._barrier(barrier))

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
        assert self.service.pipe is not None
        return any(p.flush is not None and p.flush <= flush and not p.is_eval
                   for p in self.service.pipe.pending.values())

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
        stage = self.service.stage
        if any(r.peer_id == peer and r.stage == stage for r in self.host.swarm.values()):
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
        share arrived meanwhile (then its last backward closes it)."""
        if self._working_on(step):
            return
        barrier = self.clock.on_remote_barrier(step)
        if barrier is not None:
            self._run(barrier, "a replica opened its barrier")


def _device(name: str) -> str:
    try:
        return resolve_device(name)
    except ValueError as e:
        raise DaemonError(f"--device: {e}") from e


class StageHandlers:
    """A handler table for the per-stage services (averaging, state): each name is registered once on the real
    server and delegates to whichever service of the *current* stage registered it, so a stage move re-binds them."""

    def __init__(self, rpc: HandlerTable, not_ready: Callable[[], Error]) -> None:
        self.rpc, self.not_ready = rpc, not_ready
        self.limits: RpcLimits = rpc.limits
        self.count = rpc.count  # traffic accounting of the real server, for RpcTransport
        self.vouch = getattr(rpc, "vouch", None)  # RpcTransport vouches for peers that answered our calls
        self.table: dict[str, Handler | None] = {}

    async def add_handler(self, name: str, fn: Handler) -> None:
        if name not in self.table:
            async def delegate(msg: Message, peer_id: str, _name: str = name) -> Message:
                handler = self.table.get(_name)
                return await handler(msg, peer_id) if handler is not None else self.not_ready()
            await self.rpc.add_handler(name, delegate)
        self.table[name] = fn

    def clear(self) -> None:
        for name in self.table:
            self.table[name] = None


def not_ready_error() -> Error:
    return Error(code=ErrorCode.NOT_READY, message="this peer has not chosen its stage yet; retry elsewhere")


