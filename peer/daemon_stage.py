"""Serving one stage: its worker, its state (donor, checkpoint or init), its services, and the synchronous mode.

``StageLife`` is the part of the ``Daemon`` that enters and leaves a stage: on entry it claims the stage in the DHT,
builds the ``StageWorker`` on the compute thread, loads the stage's state (donors, else the local checkpoint, else the
run's seeded init), starts the pipeline servicer, the state server and the averaging loop (or, in ``--mode sync``,
the blocking gradient average), and on stage 0 the data driver. On exit it stops taking work, drains within the
deadline and stops those services, so a rebalancing move is ``leave`` then ``enter``.

``StageHandlers`` lets per-stage services register RPC handlers once per name and be re-bound on a stage move.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

logger = logging.getLogger(__name__)


class DaemonError(RuntimeError):
    """The peer cannot start or go on (the message says what to do)."""


class StageLife:
    """Mixin of ``peer.daemon.Daemon``: the attributes it uses (run, cfg, metrics, worker, pipe, ...) live there."""

    run: Any
    cfg: Any
    metrics: Any
    worker: Any
    pipe: Any

    # ----- a stage: worker, state, services -------------------------------------------------------------------------
    def _device(self) -> str:
        from trainer.worker import resolve_device

        try:
            return resolve_device(self.cfg.device)
        except ValueError as e:
            raise DaemonError(f"--device: {e}") from e

    async def _load_state(self, stage: int) -> str:
        """Donors, else the local checkpoint, else the seeded init already in the worker. Returns the source."""
        from peer.checkpoint import CheckpointError, load_checkpoint
        from peer.state_sync import StateSyncConfig, load_state_from_peers

        reference = await self.compute(self.worker.state_dict)
        try:
            state = await asyncio.wait_for(load_state_from_peers(
                p2p=self.p2p, run=self.run, stage=stage, metrics=self.metrics, dht=self.dht, reference=reference,
                config=StateSyncConfig()), timeout=self.cfg.state_load_timeout_s)
        except TimeoutError:
            state = None
            logger.warning("loading state from donors took over %.0f s; falling back", self.cfg.state_load_timeout_s)
        if state is not None:
            await self.compute(self.worker.load_state_dict, state)
            return "donor"
        if self.cfg.checkpoint_dir is not None:
            try:
                state = await self.compute(load_checkpoint, self.cfg.checkpoint_dir, self.run, stage)
            except CheckpointError as e:
                raise DaemonError(str(e)) from e
            if state is not None:
                await self.compute(self.worker.load_state_dict, state)
                return "checkpoint"
        return "seeded init"

    async def _enter_stage(self, stage: int) -> None:
        from peer.averaging import AveragingLoop, NetAveragingConfig
        from peer.pipeline import PipelineStage
        from peer.state_sync import StateServer, StateSyncConfig
        from trainer.worker import StageWorker

        self.stage, self.metrics.stage = stage, stage
        self.metrics.state = "loading_state"
        await self.announce("loading_state")  # claim the stage at once, so that joiners see it is taken
        device = self._device()
        self.worker = await self.compute(lambda: StageWorker(self.run, stage, device=device,
                                                             auto_step=self.cfg.mode == "async"))
        source = await self._load_state(stage)
        logger.info("stage %d state from %s (local step %d)", stage, source, self.worker.local_step)
        if source == "donor":  # a restart right after joining resumes from here instead of downloading again
            await self.checkpoint()
        self.metrics.local_step = self.worker.local_step
        self.pipe = PipelineStage(run=self.run, stage=stage, worker=self.worker, compute=self.compute,
                                  send=self.send, swarm=lambda: self.swarm, router=self.router,
                                  metrics=self.metrics, cfg=self.cfg, my_id=self.my_id, cost=self.costs[stage])
        # Until then our record carries a guess (the swarm's median): a joiner choosing its stage in the meantime
        # would weigh our guess against others' measurements and pile onto our stage, so announce the real figure.
        self.pipe.on_first_measure = lambda: self.pipe.spawn(self._announce_measured())
        age = self.cfg.state_snapshot_max_age_s
        self.state_server = StateServer(p2p=self.p2p, rpc_server=self.handlers, run=self.run, stage=stage,
                                        worker_call=self.worker_call, metrics=self.metrics,
                                        config=StateSyncConfig(snapshot_max_age_s=age, snapshot_idle_s=age))
        await self.state_server.start()
        self.state_server.ready = True
        if self.cfg.mode == "async":
            self.averager = AveragingLoop(p2p=self.p2p, rpc_server=self.handlers, dht=self.dht, run=self.run,
                                          stage=stage, worker_call=self.worker_call, metrics=self.metrics,
                                          config=NetAveragingConfig(period_s=self.cfg.averaging_period_s))
            await self.averager.start()
        else:
            from peer.avg_sync import FlushClock, SyncAverager

            self.sync_averager = SyncAverager(p2p=self.p2p, rpc_server=self.handlers, run=self.run, stage=stage,
                                              metrics=self.metrics)
            await self.sync_averager.start()
            self.sync_step = self.worker.local_step
            self.flush_clock, self.flush_lock = FlushClock(), asyncio.Lock()
            if stage > 0:
                self.pipe.on_flush = self._sync_forward_flush
                self.sync_averager.on_remote_open = self._sync_remote_barrier
        self.stage_tasks = [asyncio.ensure_future(self.pipe.serve())]
        self.metrics.state = "training"
        await self.announce("training")
        await self.refresh_swarm()
        if stage == 0:
            await self._start_driver()

    async def _start_driver(self) -> None:
        from peer.driver import Stage0Driver
        from trainer.data import BatchStream, load_corpus, shard_seed, val_batches

        data_cfg = self.run.data if self.cfg.data_path is None else self.run.replace(
            data={"source": self.cfg.data_path}).data
        corpus = await asyncio.get_running_loop().run_in_executor(
            None, load_corpus, data_cfg, self.run.model.vocab_size)
        stream = BatchStream(corpus.train, self.run.model.block_size, self.run.data.batch_size,
                             shard_seed(self.run.seed, self.my_id))
        val = val_batches(corpus, self.run.model.block_size, self.run.data.batch_size, self.cfg.eval_batches)
        self.driver = Stage0Driver(pipe=self.pipe, stream=stream, val=val, inflight=self.cfg.inflight_for(
            self.run.n_stages), stop=self.stop, max_steps=self.cfg.max_steps, metrics=self.metrics)
        if self.cfg.mode == "async":
            self.driver_task = asyncio.ensure_future(self.driver.run_async())
        else:
            self.driver_task = asyncio.ensure_future(
                self.driver.run_sync(self.cfg.sync_microbatches, self._sync_flush, self._full_mesh,
                                     lambda: self.sync_step))
        self.stage_tasks.append(self.driver_task)
        if self.cfg.eval_every_s > 0:
            self.stage_tasks.append(asyncio.ensure_future(self.driver.eval_loop(self.cfg.eval_every_s)))

    async def _leave_stage(self) -> None:
        """Stop taking work, wait for in-flight micro-batches (bounded), stop the stage's services."""
        if self.pipe is None:
            return
        self.pipe.accepting = False
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        while self.pipe.pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.pipe.pending:
            logger.info("drain deadline reached with %d micro-batches in flight; dropping them",
                        len(self.pipe.pending))
        for mb in list(self.pipe.pending):
            await self.pipe.drop(mb, notify=True)
        if self.averager is not None:
            await self.averager.stop()
        for t in [*self.stage_tasks, *self.pipe.tasks]:
            t.cancel()
        await asyncio.gather(*self.stage_tasks, *self.pipe.tasks, return_exceptions=True)
        self.driver_task = None
        self.handlers.clear()
        self.pipe, self.averager, self.sync_averager = None, None, None

    async def _announce_measured(self) -> None:
        try:
            await self.announce()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the periodic announcement follows within announce_every_s anyway
            logger.debug("announcing the first measured throughput failed: %r", e)

    # ----- synchronous mode -----------------------------------------------------------------------------------------
    async def _sync_average_and_step(self, step: int) -> None:
        """Gradient barrier ``step`` among the stage's replicas (p = 1, tau = 0), then one optimiser step."""
        peers = [r.peer_id for r in self.swarm.values() if r.stage == self.stage and r.state == "training"]
        grads = await self.compute(self.worker.grads)
        mean, n = await self.sync_averager.all_average(step, grads, peers)
        await self.compute(self.worker.set_grads, mean)
        await self.compute(self.worker.optimizer_step)
        self.sync_step = self.sync_averager.last_step + 1  # the barrier may have jumped ahead to the replicas' step
        self.metrics.local_step = self.worker.local_step
        self.metrics.observe_round(ok=n > 1, group_size=n, tau=0.0)

    def _full_mesh(self) -> bool:
        """Sync mode: every stage has the same number (>= 1) of training replicas and we are one of them."""
        counts = [0] * self.run.n_stages
        for r in self.swarm.values():
            if r.state == "training" and 0 <= r.stage < self.run.n_stages:
                counts[r.stage] += 1
        return self.my_id in self.swarm and min(counts) >= 1 and len(set(counts)) == 1

    async def _sync_flush(self) -> None:
        """Stage 0: every gradient of the flush is back; average and step (the barrier is the flush number)."""
        await self._sync_average_and_step(self.sync_step)

    async def _sync_forward_flush(self, flush: int) -> None:
        """A later stage: a training forward of ``flush`` arrived; close the previous flush first (FlushClock)."""
        async with self.flush_lock:
            if self.flush_clock.current is not None and flush < self.flush_clock.current:
                self.metrics.inc("sync_late_forwards")  # a retry of an earlier flush: its gradient joins this one
            barrier = self.flush_clock.on_forward(flush)
            if barrier is not None:
                logger.debug("a forward of flush %d closes flush %d", flush, barrier)
                await self._sync_average_and_step(barrier)

    def _sync_remote_barrier(self, step: int, peer: str) -> None:
        """A later stage: a replica of our stage waits at barrier ``step``; join it unless we did already."""
        if any(r.peer_id == peer and r.stage == self.stage for r in self.swarm.values()):
            self.pipe.spawn(self._sync_join_barrier(step))
        else:
            logger.debug("barrier %d opened by %s, not a replica of stage %d in our view", step, peer[-6:], self.stage)

    async def _sync_join_barrier(self, step: int) -> None:
        async with self.flush_lock:
            barrier = self.flush_clock.on_remote_barrier(step)
            logger.debug("a replica opened barrier %d: %s", step, "joining it" if barrier is not None else "closed")
            if barrier is not None:
                await self._sync_average_and_step(barrier)


class StageHandlers:
    """An RpcServer stand-in for the per-stage services (averaging, state): each name is registered once on the real
    server and delegates to whichever service of the *current* stage registered it, so a stage move re-binds them."""

    def __init__(self, rpc: Any, not_ready: Any) -> None:
        self.rpc, self.not_ready = rpc, not_ready
        self.limits = getattr(rpc, "limits", None)
        self.count = getattr(rpc, "count", None)  # traffic accounting of the real server, for RpcTransport
        self.table: dict[str, Any] = {}

    async def add_handler(self, name: str, fn: Any) -> None:
        if name not in self.table:
            async def delegate(msg: Any, peer_id: str, _name: str = name) -> Any:
                handler = self.table.get(_name)
                return await handler(msg, peer_id) if handler is not None else self.not_ready()
            await self.rpc.add_handler(name, delegate)
        self.table[name] = fn

    def clear(self) -> None:
        for name in self.table:
            self.table[name] = None
