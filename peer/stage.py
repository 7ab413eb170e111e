"""Serving one stage: one object owns everything a peer runs for its stage, created on entry and dropped as a whole.

``StageService(host, stage)`` is created when the peer claims the stage; ``start()`` builds the ``StageWorker`` on the
compute thread, loads the stage's state (the most advanced of donors, the local checkpoint and the run's seeded
init), starts the pipeline servicer, the generation handler (``infer``), the state server and the averaging loop (or,
in ``--mode sync``, the gradient barrier of ``peer.sync_schedule``), and on stage 0 the data driver. ``leave()`` stops
taking work, drains within the deadline and stops those services, so a rebalancing move is ``leave`` on one object
and ``start`` of the next: nothing of the old stage is reset field by field, it is dropped together.

What a stage uses of its peer is a ``peer.host.StageContext``, not the daemon; every handler it serves is bound in
the peer's one handler table (``peer.handlers.table``) and unbound when it leaves.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from peer.averaging.config import NetAveragingConfig
from peer.averaging.loop import AveragingLoop
from peer.config import Mode
from peer.errors import DaemonError
from peer.host import StageContext
from peer.lifecycle import PeerState
from peer.pipeline.attest import FRAUD_RPC, KeyNotary
from peer.pipeline.driver import Stage0Driver
from peer.pipeline.hops import BACKWARD_RPC, FORWARD_RPC
from peer.pipeline.infer import INFER_RPC, InferService
from peer.pipeline.servicer import PipelineServicer
from peer.pipeline.shards import move_if_shared, open_shard, reading_shard
from peer.pipeline.testimony import TESTIMONY_RPC
from peer.state.backup import backup_loop, upstream_stage
from peer.state.checkpoint import CheckpointError
from peer.state.restore import restore_state
from peer.state.spare import SpareStore, adopt_checkpoint
from peer.state.sync import StateServer, StateSyncConfig
from peer.sync_schedule import SyncSchedule
from trainer.data import BatchStream, load_corpus, shard_seed, val_batches
from trainer.sim.methods import fullsync_optim
from trainer.tokenizer import MissingExtra
from trainer.worker import StageWorker, resolve_device, resolve_precision

if TYPE_CHECKING:
    import torch

    from trainer.config import DataConfig
    from trainer.stream import ShardStream

logger = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["DaemonError", "StageContext", "StageService"]


class StageService:
    """Everything this peer runs for one stage: ``StageService(host, stage)``, then ``await start()``."""

    def __init__(self, host: StageContext, stage: int) -> None:
        self.host, self.stage = host, stage
        self.worker: StageWorker | None = None
        self.pipe: PipelineServicer | None = None
        self.upstream: SpareStore | None = None  # stage 1 of a 3+ stage run: its copy of stage 0 (forward re-checks)
        self.infer: InferService | None = None
        self.state_server: StateServer | None = None
        self.averager: AveragingLoop | None = None
        self.sync: SyncSchedule | None = None
        self.driver: Stage0Driver | None = None
        self.driver_task: asyncio.Task[None] | None = None
        self.tasks: list[asyncio.Task[None]] = []
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
        if host.cfg.initial_peers:  # a joiner has no validated work of its own yet: borrow the initial peers'
            anchors = await host.net.ask_anchors()
            logger.info("witnesses of a state are drawn from %d peers: the initial peers that answered and those "
                        "they vouch for", len(anchors))
        try:
            restored = await restore_state(
                run=host.run, stage=self.stage, my_id=host.net.my_id, refresh=host.net.refresh_swarm, p2p=host.p2p,
                dht=host.dht, metrics=host.metrics, reference=reference, checkpoint_dir=host.cfg.checkpoint_dir,
                io=host.compute, timeout_s=host.cfg.state_load_timeout_s, spare=host.spares,
                trusted=host.net.trusted_peers, witness_wait_s=host.cfg.record_ttl_s + host.cfg.announce_every_s)
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
        # stage 1 of a longer run re-checks stage 0's forwards from a private copy of it (peer.state.backup)
        upstream = upstream_stage(host.run.n_stages, stage) if host.cfg.rechecks and not sync else None
        self.upstream = SpareStore(host.run, None) if upstream is not None else None
        self.pipe = pipe = PipelineServicer(run=host.run, stage=stage, worker=self.worker, compute=host.compute,
                                            send=host.net.send, swarm=lambda: host.net.swarm, router=host.router,
                                            metrics=host.metrics, cfg=host.cfg, my_id=host.net.my_id,
                                            cost=host.costs[stage],
                                            spares=host.spares if host.cfg.rechecks else None, upstream=self.upstream,
                                            notary=KeyNotary(host.net.signer) if host.net.signer else None)
        await host.handlers.add_handler(FORWARD_RPC, pipe.rpc_forward)  # served from now (reserved at start-up)
        await host.handlers.add_handler(BACKWARD_RPC, pipe.rpc_backward)
        if pipe.testimony is not None:  # what it received and returned, and sent on and got back (re-checks)
            await host.handlers.add_handler(TESTIMONY_RPC, pipe.testimony.rpc_testimony)
        if 0 < stage < host.run.n_stages - 1:  # a middle stage is shown proof that a witness lied about its work
            await host.handlers.add_handler(FRAUD_RPC, pipe.rpc_fraud)
        # generation through the swarm (``infer``): forward only, at low priority, only while this stage trains
        self.infer = InferService(run=host.run, stage=stage, worker=self.worker, compute=host.compute,
                                  metrics=host.metrics, queued=pipe.queued,
                                  serving=lambda: pipe.accepting and host.life.serving)
        await host.handlers.add_handler(INFER_RPC, self.infer.rpc_infer)
        # Until then our record carries a guess (the swarm's median): a joiner choosing its stage in the meantime
        # would weigh our guess against others' measurements and pile onto our stage, so announce the real figure.
        pipe.meter.on_first_measure = lambda: pipe.spawn(self._announce_measured())
        pipe.vouch, pipe.revoke = host.net.vouch, host.net.revoke
        age = host.cfg.state_snapshot_max_age_s
        # sync mode: a replica that forked loads our state as of our latest step (peer.averaging.fork), and steps are
        # a flush apart, so a new transfer never starts on a snapshot of an earlier step
        lag = 0 if sync else StateSyncConfig.snapshot_max_lag_steps
        self.state_server = StateServer(p2p=host.p2p, rpc_server=host.handlers, run=host.run, stage=stage,
                                        worker_call=self.worker_call, metrics=host.metrics,
                                        config=StateSyncConfig(snapshot_max_age_s=age, snapshot_idle_s=age,
                                                               snapshot_max_lag_steps=lag),
                                        spare=host.spares)
        await self.state_server.start()
        self.state_server.ready = True
        if host.cfg.mode == Mode.ASYNC:
            self.averager = AveragingLoop(p2p=host.p2p, rpc_server=host.handlers, dht=host.dht, run=host.run,
                                          stage=stage, worker_call=self.worker_call, metrics=host.metrics,
                                          config=NetAveragingConfig(), behaviour=host.averaging_behaviour,
                                          prepare=self.worker.averaging_prepare,
                                          place=self.worker.averaging_place)
            await self.averager.start()
        else:
            self.sync = await SyncSchedule.start(host, stage, self.worker, pipe)
        self.tasks = [asyncio.ensure_future(pipe.serve())]
        if host.cfg.backup_every_s > 0 and host.run.n_stages > 1:  # a copy of the next stage (peer.state.backup)
            backups = functools.partial(
                backup_loop, run=host.run, stage=stage, my_id=host.net.my_id, period_s=host.cfg.backup_every_s,
                metrics=host.metrics, p2p=host.p2p, swarm=lambda: host.net.swarm,
                busy=lambda: not host.life.serving or pipe.queued() >= max(2, host.cfg.max_queue // 2),
                trusted=host.net.trusted_peers)
            self.tasks.append(asyncio.ensure_future(backups(spares=host.spares)))
            if self.upstream is not None:
                self.tasks.append(asyncio.ensure_future(backups(spares=self.upstream, of=upstream, weights_only=True)))
        host.life.enter(PeerState.TRAINING)
        await host.announce()
        await host.net.refresh_swarm()
        if stage == 0:
            await self._start_driver()

    async def _start_driver(self) -> None:
        host, run, cfg = self.host, self.host.run, self.host.cfg
        assert self.pipe is not None
        data_cfg = run.data if cfg.data_path is None else run.replace(data={"source": cfg.data_path}).data
        stream: BatchStream | ShardStream
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
            sync = self.sync
            assert sync is not None
            self.driver_task = asyncio.ensure_future(
                self.driver.run_sync(cfg.sync_microbatches, sync.flush, sync.full_mesh, lambda: sync.step))
        self.tasks.append(self.driver_task)
        if cfg.eval_every_s > 0:
            self.tasks.append(asyncio.ensure_future(self.driver.eval_loop(cfg.eval_every_s)))

    def _open_corpus(self, data_cfg: DataConfig) -> tuple[BatchStream, list[tuple[torch.Tensor, torch.Tensor]]]:
        """A token array (stdlib, text, .bin): random windows seeded by the peer id, resumed from the ledger."""
        run, cfg = self.host.run, self.host.cfg
        corpus = load_corpus(data_cfg, run.model.vocab_size)
        stream = BatchStream(corpus.train, run.model.block_size, run.data.batch_size,
                             shard_seed(run.seed, self.host.net.my_id))
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
        dropped = await pipe.drain(self.host.cfg.drain_timeout_s)
        if dropped:
            text = (f"leaving stage {self.stage}: drain deadline reached with {dropped} micro-batches in "
                    f"flight; dropping their work (stage 0 re-trains their samples)")
            logger.warning("%s", text)
            self.host.metrics.warn(text)
        if self.averager is not None:
            await self.averager.stop()
        for t in self.tasks:
            t.cancel()
        await pipe.close()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.host.handlers.clear()
        self.pipe = self.infer = self.averager = self.sync = self.driver_task = None


def _device(name: str) -> str:
    try:
        return resolve_device(name)
    except ValueError as e:
        raise DaemonError(f"--device: {e}") from e
