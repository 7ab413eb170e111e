"""The peer daemon: the life of one peer, from identity to exit, on one event loop with one compute thread.

start → identity key → join the DHT → serve RPCs → reachability self-check → choose a stage (``--stage`` or auto,
with jitter and re-check) → the most trained state among donors and local checkpoints, else the run's seeded init →
announce (expiring record, re-announced on a timer) → serve, drive micro-batches on stage 0, average in the
background, checkpoint periodically, rebalance when the stage is over-served → on SIGTERM/SIGINT or ``max_steps``:
stop taking work, drain within ``drain_timeout_s``, final checkpoint, withdraw the record, write the summary, exit 0.

What faces the network (DHT, RPC server, reachability, records) is ``peer.presence.Presence``; the stage served now
is a ``peer.stage.StageService``. All model work runs on one ``peer.compute.ComputeThread``: the worker is never
touched from two threads and the event loop never blocks on tensor math; averaging and state jobs go before queued
micro-batches. Failures of remote peers are logged at DEBUG and counted; nothing a remote peer sends can raise out of
the serve loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import signal
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from peer.budget import plan as plan_memory
from peer.compute import ComputeThread, DevicePace
from peer.config import Mode, PeerConfig
from peer.errors import DaemonError, UserError
from peer.host import StageContext
from peer.lifecycle import Lifecycle, PeerState
from peer.membership.dht import JoinInterrupted
from peer.membership.gate import AdmissionGate
from peer.membership.moves import Mover, MoveTiming
from peer.membership.records import PeerRecord
from peer.membership.relay import needs_relay_restart
from peer.membership.routing import Router
from peer.membership.stage_choice import (
    capacities,
    choose_stage,
    estimate_throughput,
    leaves_for_an_empty_stage,
    stage_costs,
)
from peer.ops.metrics import PeerMetrics
from peer.ops.status_server import StatusServer, StatusServerError
from peer.ops.summary import peer_summary, write_summary
from peer.pipeline.ledger import SampleLedger
from peer.presence import Presence
from peer.stage import StageService
from peer.state.checkpoint import StaleCheckpointError, checkpoint_steps, newest_checkpoint_stage, save_checkpoint
from peer.state.spare import SpareStore, spare_fields
from trainer.config import RunConfig, stage_layer_ranges
from trainer.worker import is_gpu, resolve_device, resolve_precision

if TYPE_CHECKING:
    from hivemind import DHT

    from peer.averaging.behaviour import AveragingBehaviour
    from peer.pipeline.driver import Stage0Driver
    from peer.pipeline.servicer import PipelineServicer
    from trainer.worker import StageWorker

logger = logging.getLogger(__name__)

IDLE_EXIT_S = 3.0
RESTART_SETTLE_ANNOUNCES = 3  # announce periods a restarting peer waits before leaving its stage for an empty one
T = TypeVar("T")

__all__ = ["Daemon", "DaemonError"]


class Daemon:
    """One peer process. ``await Daemon(run, cfg).main()`` returns the exit code.

    ``self.service`` is the stage served now (None before the first choice), replaced as a whole on a stage move;
    every stage gets the same ``StageContext`` (``self.context``), what it uses of this peer.
    """

    def __init__(self, run: RunConfig, cfg: PeerConfig, *, metrics: PeerMetrics | None = None,
                 averaging_behaviour: AveragingBehaviour | None = None) -> None:
        if cfg.stage is not None and cfg.stage >= run.n_stages:
            raise UserError(f"--stage {cfg.stage} does not exist: run {run.name!r} has {run.n_stages} stages "
                             f"(0..{run.n_stages - 1}); pass one of them or 'auto'")
        self.run, self.cfg = run, cfg
        self.averaging_behaviour = averaging_behaviour  # None: honest (peer.averaging.behaviour; tests, red team)
        self.metrics = metrics or PeerMetrics()
        self.metrics.run_id, self.metrics.n_stages, self.metrics.run_name = run.run_id, run.n_stages, run.name
        self.metrics.access = run.access.mode
        self.life = Lifecycle(self.metrics.observe_state)  # the peer's state: changed here only, shown by metrics
        try:
            self.metrics.device = resolve_device(cfg.device)
        except ValueError as e:  # --device cuda without a GPU: say so before anything starts
            raise UserError(f"--device {cfg.device}: {e}") from None
        self.precision = resolve_precision(cfg.precision, self.metrics.device)
        # what each stage needs against what this peer may use: a stage that does not fit is never served
        self.budget = plan_memory(run, device=self.metrics.device, precision=self.precision,
                                  inflight=cfg.inflight_for(run.n_stages), memory_gb=cfg.memory_gb,
                                  spare_in_memory=cfg.backup_every_s > 0 and cfg.checkpoint_dir is None,
                                  rechecks=cfg.rechecks and cfg.backup_every_s > 0 and cfg.mode == Mode.ASYNC)
        self.budget.check_stage(cfg.stage)
        self.metrics.memory = self.budget.as_dict()
        self.gate = AdmissionGate(run, cfg)  # closed runs: credentials; open runs: admits everyone
        blocks = [e - s for s, e in stage_layer_ranges(run)]
        self.costs = stage_costs(blocks, n_embd=run.model.n_embd, vocab_size=run.model.vocab_size)
        self.router = Router(self.costs, ban_base_s=cfg.ban_base_s, ban_max_s=cfg.ban_max_s)
        if cfg.compute_pace and is_gpu(self.metrics.device):
            raise UserError(f"compute_pace paces the CPU time of the compute thread; this peer computes on "
                             f"{self.metrics.device}: drop --set compute_pace or use --device cpu")
        self.executor = ComputeThread("compute", pace=DevicePace(cfg.compute_pace))
        self.stop = asyncio.Event()
        self.service: StageService | None = None
        self.driver: Stage0Driver | None = None  # the last stage-0 driver, kept for the summary after a move
        self.net = Presence(run, cfg, self.metrics, gate=self.gate, stop=self.stop, router=self.router)
        self.refresh_swarm = self.net.refresh_swarm
        self.started = time.monotonic()
        self.final_val_loss: float | None = None
        self.exit_reason = "running"
        self.tasks: list[asyncio.Task[None]] = []
        self.spares = SpareStore(run, cfg.checkpoint_dir)  # the copy of a neighbour stage kept (peer.state.spare)
        self.ledger = SampleLedger()  # training samples drawn and not trained yet, across stage moves and restarts
        self.mover = Mover(self.costs, quality=cfg.rebalance_quality, timing=MoveTiming(
            jitter_s=cfg.join_jitter_s, settle_s=cfg.rebalance_settle_s, cooldown_s=cfg.rebalance_cooldown_s),
            fits=self.budget.fitting)
        self.context = StageContext(  # what every stage served uses of this peer
            run=run, cfg=cfg, metrics=self.metrics, life=self.life, net=self.net, router=self.router, costs=self.costs,
            compute=self.compute, announce=self.announce, checkpoint=self.checkpoint, ledger=self.ledger,
            spares=self.spares, stop=self.stop, averaging_behaviour=averaging_behaviour)

    # ----- the stage served now --------------------------------------------------------------------------------------
    @property
    def stage(self) -> int | None:
        return self.service.stage if self.service is not None else None

    @property
    def worker(self) -> StageWorker | None:
        return self.service.worker if self.service is not None else None

    @property
    def pipe(self) -> PipelineServicer | None:
        return self.service.pipe if self.service is not None else None

    @property
    def driver_task(self) -> asyncio.Task[None] | None:
        return self.service.driver_task if self.service is not None else None

    # ----- compute thread -------------------------------------------------------------------------------------------
    async def compute(self, fn: Callable[..., T], *args: Any, urgent: bool = False) -> T:
        return await self.executor.run(fn, *args, urgent=urgent)

    # ----- the network side (peer.presence) ------------------------------------------------------------------------
    @property
    def my_id(self) -> str:
        return self.net.my_id

    @property
    def dht(self) -> DHT | None:
        return self.net.dht

    @property
    def swarm(self) -> dict[str, PeerRecord]:
        return self.net.swarm

    # ----- start-up --------------------------------------------------------------------------------------------------
    async def _start_network(self, *, rejoin: bool = False) -> None:
        if rejoin:
            await self.net.rejoin_through_relay()
        else:
            await self.net.start()

    async def _choose_stage(self) -> int:
        if self.cfg.stage is not None:
            return self.cfg.stage
        held: dict[int, int] = {}
        last: int | None = None
        if self.cfg.checkpoint_dir is not None:
            held = await asyncio.get_running_loop().run_in_executor(None, checkpoint_steps, self.cfg.checkpoint_dir,
                                                                    self.run)
            if held:
                last = newest_checkpoint_stage(self.cfg.checkpoint_dir, held)
                logger.info("checkpoints held (stage: step): %s; stage %s served last", held, last)
        first = choose_stage(await self.refresh_swarm(), self.costs, held=held, last=last,
                             fits=self.budget.fitting)
        await asyncio.sleep(random.uniform(0, self.cfg.join_jitter_s))
        chosen = choose_stage(await self.refresh_swarm(), self.costs, held=held, last=last,
                             fits=self.budget.fitting)
        settle = time.monotonic() + RESTART_SETTLE_ANNOUNCES * self.cfg.announce_every_s
        while leaves_for_an_empty_stage(self.swarm, self.run.n_stages, chosen, last) and time.monotonic() < settle:
            logger.info("stage %d looks empty: reading the swarm again before leaving stage %s (its peers may be "
                        "restarting too)", chosen, last)
            await asyncio.sleep(self.cfg.announce_every_s)
            chosen = choose_stage(await self.refresh_swarm(), self.costs, held=held, last=last,
                             fits=self.budget.fitting)
        if chosen != first:
            logger.info("stage choice changed from %d to %d after re-checking the swarm", first, chosen)
        caps = ", ".join(f"{c:.2f}" for c in capacities(self.swarm, self.costs))
        logger.info("chose stage %d of %d (micro-batches/s per stage from %d announced peers: %s)", chosen,
                    self.run.n_stages, len(self.swarm), caps)
        return chosen

    def record(self, state: PeerState) -> PeerRecord:
        thr = self.cfg.throughput or (self.pipe.meter.throughput() if self.pipe else 0.0)
        if thr <= 0:
            thr = estimate_throughput({k: v for k, v in self.swarm.items() if k != self.my_id})
        snap = self.metrics.snapshot()
        return PeerRecord(peer_id=self.my_id, stage=self.stage or 0, throughput=float(thr),
                          queue=self.pipe.queued() if self.pipe else 0,
                          version=int(self.worker.local_step) if self.worker is not None else 0, state=state,
                          maddrs=self.net.maddrs, reachable=self.net.reachable,
                          tokens_per_s=float(snap.get("tokens_per_s") or 0.0), loss=self.metrics.train_loss,
                          tokens=int(snap.get("tokens_total") or 0), val_loss=self.metrics.val_loss,
                          data_shard=self.service.data_shard if self.service is not None else None,
                          **spare_fields(self.spares.info))

    async def announce(self, state: PeerState | None = None) -> None:
        await self.net.announce(self.record(state or self.life.state))

    # ----- timers ---------------------------------------------------------------------------------------------------
    async def _every(self, period: float, fn: Callable[[], Awaitable[None]]) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), timeout=period)
            if self.stop.is_set():
                return
            try:
                await fn()
            except asyncio.CancelledError:
                raise
            except Exception:  # a failing timer must not take the peer down
                logger.exception("periodic task %s failed; it runs again next period", getattr(fn, "__name__", fn))

    async def _tick_announce(self) -> None:
        pipe, worker = self.pipe, self.worker
        if pipe is not None and worker is not None:
            self.metrics.inflight, self.metrics.queued = pipe.inflight(), pipe.queued()
            self.metrics.local_step = worker.local_step
            if worker.device.type == "cuda" and self.metrics.memory is not None:  # the estimate against the real peak
                self.metrics.memory["peak_bytes"] = torch.cuda.max_memory_allocated(worker.device)
        held = self.spares.info
        self.metrics.backup = None if held is None else (held.stage, held.step, held.taken_at)
        await self.refresh_swarm()
        if self.service is not None:
            self.service.move_shard()
        await self.announce()

    async def _tick_expire(self) -> None:
        pipe, worker = self.pipe, self.worker
        if pipe is not None:
            await pipe.expire()
        # a later stage stops at max_steps once its upstream has gone quiet (stage 0's final evaluation passed)
        if self.cfg.max_steps and worker is not None and worker.local_step >= self.cfg.max_steps \
                and self.stage != 0 and pipe is not None and pipe.idle_s() > IDLE_EXIT_S:
            self.exit_reason = "max_steps"
            self.stop.set()

    async def _tick_checkpoint(self) -> None:
        await self.checkpoint()

    async def checkpoint(self) -> None:
        worker, service, stage = self.worker, self.service, self.stage
        if self.cfg.checkpoint_dir is None or worker is None or service is None or not service.loaded or stage is None:
            return  # (a start-up interrupted before the state was loaded has nothing worth keeping)
        state = await self.compute(worker.state_dict)
        try:
            driver = self.service.driver if self.service is not None else None  # owed: taken with the state
            owed = self.ledger.snapshot(driver.untrained() if driver is not None and self.stage == 0 else [])
            path = await asyncio.get_running_loop().run_in_executor(
                None, save_checkpoint, self.cfg.checkpoint_dir, self.run, stage, state)
            logger.info("checkpoint of stage %d at step %d written to %s", self.stage, state["local_step"], path)
            # the data position and the samples owed at this checkpoint: a restart resumes both (peer.pipeline.ledger)
            await asyncio.get_running_loop().run_in_executor(None, self.ledger.save, self.cfg.checkpoint_dir, owed)
        except OSError as e:
            self.metrics.warn(f"checkpoint failed: {e}; check free space and permissions of --checkpoint-dir")
        except StaleCheckpointError as e:  # the file holds more training than this state: keep the file
            logger.warning("%s", e)
            self.metrics.warn(f"checkpoint of stage {self.stage} kept: {e}")

    async def _tick_rebalance(self) -> None:
        if self.cfg.stage is not None or self.stage is None or self.stop.is_set():
            return
        target = await self.mover.decide(my_id=self.my_id, read=self.refresh_swarm, claim=self._claim_move,
                                         release=self._release_move)
        if target is None:
            return
        if self.stop.is_set():
            return  # the claim ('draining') stands: the shutdown that follows leaves anyway
        logger.info("moving from stage %d to under-served stage %d", self.stage, target)
        self.metrics.inc("stage_moves")
        await self.checkpoint()
        await self._leave_stage()
        await self._enter_stage(target)

    async def _claim_move(self) -> None:
        self.life.enter(PeerState.DRAINING)  # also what the periodic announcement says until the move or back-off
        await self.announce(PeerState.DRAINING)

    async def _release_move(self) -> None:
        self.metrics.inc("stage_move_backoffs")
        if not self.stop.is_set():
            self.life.enter(PeerState.TRAINING)
            await self.announce(PeerState.TRAINING)

    async def _enter_stage(self, stage: int) -> None:
        """Claim ``stage`` in the DHT at once (so that joiners see it is taken), then start serving it."""
        self.service = StageService(self.context, stage)
        self.metrics.stage = stage
        self.life.enter(PeerState.LOADING_STATE, stage=stage)
        await self.announce(PeerState.LOADING_STATE)
        await self.service.start()
        if self.service.driver is not None:
            self.driver = self.service.driver

    async def _leave_stage(self) -> None:
        if self.service is not None:
            await self.service.leave()

    # ----- the whole life -------------------------------------------------------------------------------------------
    async def main(self) -> int:
        """startup → serve → shutdown; returns the process exit code."""
        if self.cfg.torch_threads:
            torch.set_num_threads(self.cfg.torch_threads)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._on_signal, sig)
        status = None
        try:
            if self.cfg.metrics_port is not None:  # first, so that the start-up phases themselves can be watched
                status = StatusServer(self.metrics, host=self.cfg.metrics_host, port=self.cfg.metrics_port)
                try:
                    await status.start()
                except StatusServerError as e:
                    status = None
                    raise DaemonError(str(e)) from None
            await self._start_network()
            self.net.print_join_hint()
            if self.cfg.checkpoint_dir is not None:
                await asyncio.get_running_loop().run_in_executor(None, self.ledger.load, self.cfg.checkpoint_dir)
                await asyncio.get_running_loop().run_in_executor(None, self.spares.scan)
            await self._unless_stopped(self._take_a_stage())
            self.tasks = [asyncio.ensure_future(self._every(self.cfg.announce_every_s, self._tick_announce)),
                          asyncio.ensure_future(self._every(1.0, self._tick_expire))]
            if self.cfg.checkpoint_every_s > 0:
                self.tasks.append(asyncio.ensure_future(self._every(self.cfg.checkpoint_every_s,
                                                                    self._tick_checkpoint)))
            if self.cfg.rebalance_every_s > 0:
                self.tasks.append(asyncio.ensure_future(self._every(self.cfg.rebalance_every_s,
                                                                    self._tick_rebalance)))
            await self._serve()
        except JoinInterrupted as e:
            logger.info("%s: %s before serving anything", self.exit_reason, e)
        finally:
            await self._shutdown(status)
        return 0

    async def _take_a_stage(self) -> None:
        await self.net.check_reachability()
        if needs_relay_restart(self.cfg.relay, self.net.reachable, self.net.through_relay):
            await self._start_network(rejoin=True)
        await self._enter_stage(await self._choose_stage())

    async def _unless_stopped(self, work: Awaitable[T], what: str = "starting up") -> T:
        """``work``'s result, abandoned at once (cancelled, JoinInterrupted) if the peer is asked to stop (SIGTERM,
        Ctrl-C) meanwhile: a start-up phase, or a final evaluation whose tries cannot succeed once the next stage's
        peers have left."""
        task = asyncio.ensure_future(work)
        stopped = asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise JoinInterrupted(f"stopped while {what} (state: {self.life.state})")
        return task.result()

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.stop.is_set():
            logger.warning("second %s: skipping the drain", sig.name)
            self.cfg = self.context.cfg = _replace(self.cfg, drain_timeout_s=0.01)  # the stage's drain too
            return
        logger.info("%s received: stopping (drain up to %.0f s, final checkpoint, withdraw)", sig.name,
                    self.cfg.drain_timeout_s)
        self.exit_reason = sig.name
        self.stop.set()

    async def _serve(self) -> None:
        """Wait until stopped: by a signal, by max_steps, or because stage 0's driver finished."""
        while not self.stop.is_set():
            driver_task = self.driver_task  # None unless this peer serves stage 0 (a stage move may change it)
            stopped = asyncio.ensure_future(self.stop.wait())
            await asyncio.wait([stopped] if driver_task is None else [stopped, driver_task],
                               return_when=asyncio.FIRST_COMPLETED, timeout=1.0)
            stopped.cancel()
            if driver_task is not self.driver_task or driver_task is None or driver_task.cancelled():
                continue  # left stage 0 meanwhile: its driver was cancelled on purpose
            if driver_task.done() and not self.stop.is_set():
                if driver_task.exception() is not None:
                    logger.error("the stage-0 driver failed: %r", driver_task.exception())
                self.exit_reason = "max_steps"
                driver = self.driver
                if self.cfg.eval_batches and driver:
                    try:
                        self.final_val_loss = await self._unless_stopped(driver.final_evaluate(),
                                                                         "running the final evaluation")
                    except JoinInterrupted as e:
                        logger.info("%s: %s", self.exit_reason, e)
                self.stop.set()

    async def _shutdown(self, status: StatusServer | None) -> None:
        self.life.drain(self.cfg.drain_timeout_s)
        self.stop.set()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        try:
            if self.dht is not None and self.worker is not None:
                with contextlib.suppress(Exception):
                    await self.announce(PeerState.DRAINING)
            await self._leave_stage()
            await self.checkpoint()
            await self._settle_samples()
            if self.dht is not None and self.my_id:
                with contextlib.suppress(Exception):
                    await self.net.withdraw(self.record(PeerState.STOPPED))
        finally:
            self.life.enter(PeerState.STOPPED)
            self.write_summary()
            if status is not None:
                await status.stop()
            await self.net.close()
            self.executor.shutdown(wait=True, cancel_futures=True)

    async def _settle_samples(self) -> None:
        """At exit: keep the samples still owed next to the checkpoints, or count them lost (and say so)."""
        text = await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.ledger.settle(self.cfg.checkpoint_dir, run_over=self.exit_reason == "max_steps"))
        if text:
            self.metrics.warn(text)

    def summary(self) -> dict[str, Any]:
        """The figures a run reports (also written with --summary-json)."""
        head: dict[str, Any] = {"peer_id": self.my_id, "stage": self.stage, "run_id": self.run.run_id,
                                "mode": self.cfg.mode, "exit_reason": self.exit_reason}
        if self.cfg.compute_pace:
            head["compute_pace"] = self.executor.pace.stats()
        return peer_summary(self.metrics, head=head, elapsed_s=time.monotonic() - self.started,
                            steps=int(self.worker.local_step) if self.worker is not None else 0, driver=self.driver,
                            ledger=self.ledger, final_val_loss=self.final_val_loss)

    def write_summary(self) -> None:
        if self.cfg.summary_json is not None:
            write_summary(self.cfg.summary_json, self.summary())


def _replace(cfg: PeerConfig, **kw: Any) -> PeerConfig:
    return dataclasses.replace(cfg, **kw)

