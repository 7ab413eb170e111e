"""The peer daemon: the life of one peer, from identity to exit, on one event loop with one compute thread.

start → identity key → join the DHT → serve RPCs → reachability self-check → choose a stage (``--stage`` or auto,
with jitter and re-check) → state from donors, else the local checkpoint, else the run's seeded init → announce
(expiring record, re-announced on a timer) → serve, drive micro-batches on stage 0, average in the background,
checkpoint periodically, rebalance when the stage is over-served → on SIGTERM/SIGINT or ``max_steps``: stop taking
work, drain within ``drain_timeout_s``, final checkpoint, withdraw the record, write the summary, exit 0.

All model work runs on one ``peer.compute.ComputeThread``: the worker is never touched from two threads and the event
loop never blocks on tensor math; averaging and state jobs go before queued micro-batches. Failures of remote peers are
logged at DEBUG and counted; nothing a remote peer sends can raise out of the serve loop.
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

from peer.compute import ComputeThread
from peer.config import PeerConfig
from peer.errors import DaemonError, UserError
from peer.membership.admission import organiser_key
from peer.membership.dht import JoinInterrupted, start_dht, stop_dht
from peer.membership.gate import AdmissionGate
from peer.membership.moves import Mover, MoveTiming
from peer.membership.reachability import REACH_RPC, ReachabilityHelper, check_reachable, observed_hosts, swarm_is_local
from peer.membership.records import PeerRecord, announce, fetch_swarm, record_validator, withdraw
from peer.membership.relay import needs_relay_restart, wait_relayed
from peer.membership.routing import Router
from peer.membership.run_guard import RunGuard
from peer.membership.signing import Signer
from peer.membership.stage_choice import (
    capacities,
    choose_stage,
    estimate_throughput,
    leaves_for_an_empty_stage,
    stage_costs,
)
from peer.ops.metrics import PeerMetrics
from peer.ops.progress import SwarmProgress, from_records
from peer.ops.status_server import StatusServer, StatusServerError
from peer.ops.summary import peer_summary, write_summary
from peer.pipeline.ledger import SampleLedger
from peer.pipeline.sizes import restrict_handlers
from peer.stage import StageHandlers, StageService, not_ready_error
from peer.state.checkpoint import StaleCheckpointError, checkpoint_steps, newest_checkpoint_stage, save_checkpoint
from peer.state.spare import SpareStore, spare_fields
from protocol.messages import Busy, Error, Message
from protocol.rpc import RpcLimits, RpcServer, call
from trainer.config import RunConfig, stage_layer_ranges
from trainer.worker import resolve_device

if TYPE_CHECKING:
    from hivemind import DHT
    from hivemind.p2p import P2P

    from peer.pipeline.driver import Stage0Driver
    from peer.pipeline.servicer import PipelineStage
    from trainer.worker import StageWorker

logger = logging.getLogger(__name__)

IDLE_EXIT_S = 3.0
RESTART_SETTLE_ANNOUNCES = 3  # announce periods a restarting peer waits before leaving its stage for an empty one
T = TypeVar("T")

__all__ = ["Daemon", "DaemonError"]


class Daemon:
    """One peer process. ``await Daemon(run, cfg).main()`` returns the exit code.

    It is the ``StageHost`` of the ``StageService`` it runs: ``self.service`` is the stage served now (None before
    the first choice), replaced as a whole on a stage move.
    """

    def __init__(self, run: RunConfig, cfg: PeerConfig, *, metrics: PeerMetrics | None = None) -> None:
        if cfg.stage is not None and cfg.stage >= run.n_stages:
            raise UserError(f"--stage {cfg.stage} does not exist: run {run.name!r} has {run.n_stages} stages "
                             f"(0..{run.n_stages - 1}); pass one of them or 'auto'")
        self.run, self.cfg = run, cfg
        self.metrics = metrics or PeerMetrics()
        self.metrics.run_id, self.metrics.n_stages, self.metrics.run_name = run.run_id, run.n_stages, run.name
        self.metrics.access = run.access.mode
        try:
            self.metrics.device = resolve_device(cfg.device)
        except ValueError as e:  # --device cuda without a GPU: say so before anything starts
            raise UserError(f"--device {cfg.device}: {e}") from None
        self.gate = AdmissionGate(run, cfg)  # closed runs: credentials; open runs: admits everyone
        blocks = [e - s for s, e in stage_layer_ranges(run)]
        self.costs = stage_costs(blocks, n_embd=run.model.n_embd, vocab_size=run.model.vocab_size)
        self.router = Router(self.costs, ban_base_s=cfg.ban_base_s, ban_max_s=cfg.ban_max_s)
        self.executor = ComputeThread("compute")
        self.stop = asyncio.Event()
        self.swarm: dict[str, PeerRecord] = {}
        self.service: StageService | None = None
        self.driver: Stage0Driver | None = None  # the last stage-0 driver, kept for the summary after a move
        self.dht: DHT | None = None
        self.signer: Signer | None = None
        self.p2p: P2P | None = None
        self.rpc: RpcServer | None = None
        self.limits = RpcLimits()
        self.handlers: StageHandlers | None = None
        self.my_id = ""
        self.maddrs: list[str] = []
        self.reachable = True
        self.through_relay = cfg.relay == "on"  # p2pd listens through a relay (peer.membership.relay)
        self.started = time.monotonic()
        self.initial_loss: float | None = None
        self.final_val_loss: float | None = None
        self.exit_reason = "running"
        self.run_guard = RunGuard(run.run_id, run.name)
        self.progress = SwarmProgress(run_name=run.name, total_steps=run.optim.total_steps)
        self.tasks: list[asyncio.Task] = []
        self.spares = SpareStore(run, cfg.checkpoint_dir)  # the copy of a neighbour stage kept (peer.state.spare)
        self.ledger = SampleLedger()  # training samples drawn and not trained yet, across stage moves and restarts
        self.mover = Mover(self.costs, quality=cfg.rebalance_quality, timing=MoveTiming(
            jitter_s=cfg.join_jitter_s, settle_s=cfg.rebalance_settle_s, cooldown_s=cfg.rebalance_cooldown_s))

    # ----- the stage served now --------------------------------------------------------------------------------------
    @property
    def stage(self) -> int | None:
        return self.service.stage if self.service is not None else None

    @property
    def worker(self) -> StageWorker | None:
        return self.service.worker if self.service is not None else None

    @property
    def pipe(self) -> PipelineStage | None:
        return self.service.pipe if self.service is not None else None

    @property
    def driver_task(self) -> asyncio.Task | None:
        return self.service.driver_task if self.service is not None else None

    # ----- compute thread -------------------------------------------------------------------------------------------
    async def compute(self, fn: Callable[..., T], *args: Any, urgent: bool = False) -> T:
        return await self.executor.run(fn, *args, urgent=urgent)

    # ----- RPC plumbing ---------------------------------------------------------------------------------------------
    async def send(self, peer_id: str, name: str, msg: Message, *, timeout: float | None = None) -> Message:
        assert self.p2p is not None
        reply = await call(self.p2p, peer_id, name, msg, timeout=timeout or self.cfg.rpc_timeout_s,
                           limits=self.limits, count=self.metrics.inc)
        if self.rpc is not None and not isinstance(reply, Busy):
            self.rpc.vouch(peer_id)  # it answered work of ours: the full budgets of a known peer from now on
        return reply

    async def _rpc_forward(self, msg: Message, peer_id: str) -> Message:
        pipe = self.pipe
        return await pipe.rpc_forward(msg, peer_id) if pipe is not None else self._not_ready()

    async def _rpc_backward(self, msg: Message, peer_id: str) -> Message:
        pipe = self.pipe
        return await pipe.rpc_backward(msg, peer_id) if pipe is not None else self._not_ready()

    def _not_ready(self) -> Error:
        self.metrics.inc("rejected:not_ready")
        return not_ready_error()

    # ----- start-up --------------------------------------------------------------------------------------------------
    async def _start_dht(self, *, rejoin: bool = False) -> None:
        self.dht = dht = await start_dht(self.cfg, self.stop, validators=[record_validator(self.run.run_id,
                                                                                           organiser_key(self.run))],
                                         through_relay=self.through_relay, rejoin=rejoin)
        self.p2p = await dht.replicate_p2p()
        self.my_id = dht.peer_id.to_base58()
        self.signer = Signer.from_identity_file(self.cfg.identity_path)  # signs our DHT records (same key as p2pd)
        self.gate.load_own(self.my_id)  # closed runs: our credential must admit this peer id, else a clear error
        self.metrics.peer_id = self.my_id
        visible = (await wait_relayed(dht, self.cfg.reachability_timeout_s) if self.through_relay
                   else await asyncio.get_running_loop().run_in_executor(None, dht.get_visible_maddrs))
        self.maddrs = [str(m) for m in visible][:8]
        self.metrics.maddrs = list(self.cfg.announce_maddrs) or list(self.maddrs)
        if self.cfg.maddrs_file is not None:
            tmp = self.cfg.maddrs_file.with_suffix(".tmp")
            tmp.write_text("".join(f"{m}\n" for m in self.maddrs))
            tmp.replace(self.cfg.maddrs_file)

    async def _start_rpc(self) -> None:
        assert self.p2p is not None
        self.rpc = RpcServer(self.p2p, self.limits, count=self.metrics.inc)
        restrict_handlers(self.rpc, self.run)  # message kinds, and request sizes from the run's shapes
        self.rpc.gate = self.gate.rpc_gate(lambda: self.swarm, self.refresh_swarm)
        await self.rpc.add_handler("forward", self._rpc_forward)
        await self.rpc.add_handler("backward", self._rpc_backward)
        p2p = self.p2p
        helper = ReachabilityHelper(  # dials back only the requester's own observed address (local swarms: any)
            run_id=self.run.run_id, timeout_s=self.cfg.reachability_timeout_s,
            observed=lambda pid: observed_hosts(p2p, pid),
            local_swarm=lambda: swarm_is_local([m for r in self.swarm.values() for m in r.maddrs] + self.maddrs))
        await self.rpc.add_handler(REACH_RPC, helper.handle)

    async def _check_reachability(self) -> None:
        helpers = [m.rsplit("/p2p/", 1)[1] for m in self.cfg.initial_peers if "/p2p/" in m]
        helpers = [h for h in helpers if h != self.my_id]
        try:
            ok, message = await self._reach(helpers)
        except Exception as e:  # the check is advice; it must never stop the peer
            ok, message = None, f"reachability could not be checked: {e!r}"
        if (wrong := self.run_guard.error()) is not None:  # ...but a swarm of another run must
            raise wrong
        if ok is False:
            self.reachable = False
            self.metrics.warn(message)
            logger.warning("%s", message)
        else:
            logger.info("reachability: %s", message)

    async def _reach(self, helpers: list[str]) -> tuple[bool | None, str]:
        call = self.run_guard.wrap(lambda pid, name, msg, timeout: self.send(pid, name, msg, timeout=timeout))
        return await check_reachable(
            call=call, helpers=helpers,
            run_id=self.run.run_id, stage=self.cfg.stage or 0, my_id=self.my_id,
            maddrs=list(self.cfg.announce_maddrs) or self.maddrs, timeout_s=self.cfg.reachability_timeout_s)

    async def refresh_swarm(self) -> dict[str, PeerRecord]:
        records = await fetch_swarm(self.dht, self.run.run_id, timeout=self.cfg.dht_timeout_s)
        if records or not self.swarm:
            self.swarm = records
        per_stage: dict[int, int] = {s: 0 for s in range(self.run.n_stages)}
        for r in self.swarm.values():
            per_stage[r.stage] = per_stage.get(r.stage, 0) + 1
        self.metrics.set_swarm(per_stage)
        self.metrics.swarm_progress = self.progress.update(from_records(self.swarm.values()))
        self.router.forget(self.swarm)
        return self.swarm

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
        first = choose_stage(await self.refresh_swarm(), self.costs, held=held, last=last)
        await asyncio.sleep(random.uniform(0, self.cfg.join_jitter_s))
        chosen = choose_stage(await self.refresh_swarm(), self.costs, held=held, last=last)
        settle = time.monotonic() + RESTART_SETTLE_ANNOUNCES * self.cfg.announce_every_s
        while leaves_for_an_empty_stage(self.swarm, self.run.n_stages, chosen, last) and time.monotonic() < settle:
            logger.info("stage %d looks empty: reading the swarm again before leaving stage %s (its peers may be "
                        "restarting too)", chosen, last)
            await asyncio.sleep(self.cfg.announce_every_s)
            chosen = choose_stage(await self.refresh_swarm(), self.costs, held=held, last=last)
        if chosen != first:
            logger.info("stage choice changed from %d to %d after re-checking the swarm", first, chosen)
        caps = ", ".join(f"{c:.2f}" for c in capacities(self.swarm, self.costs))
        logger.info("chose stage %d of %d (micro-batches/s per stage from %d announced peers: %s)", chosen,
                    self.run.n_stages, len(self.swarm), caps)
        return chosen

    def record(self, state: str) -> PeerRecord:
        thr = self.pipe.throughput() if self.pipe else 0.0
        if thr <= 0:
            thr = estimate_throughput({k: v for k, v in self.swarm.items() if k != self.my_id})
        snap = self.metrics.snapshot()
        return PeerRecord(peer_id=self.my_id, stage=self.stage or 0, throughput=float(thr),
                          queue=self.pipe.queued() if self.pipe else 0,
                          version=int(self.worker.local_step) if self.worker is not None else 0, state=state,
                          maddrs=self.maddrs, reachable=self.reachable,
                          tokens_per_s=float(snap.get("tokens_per_s") or 0.0), loss=self.metrics.train_loss,
                          tokens=int(snap.get("tokens_total") or 0), val_loss=self.metrics.val_loss,
                          **spare_fields(self.spares.info))

    async def announce(self, state: str | None = None) -> None:
        await announce(self.dht, self.run.run_id, self.record(state or self.metrics.state), self.cfg.record_ttl_s,
                       signer=self.signer, credential=self.gate.credential)

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
            self.metrics.inflight, self.metrics.queued = len(pipe.pending), pipe.queued()
            self.metrics.local_step = worker.local_step
        held = self.spares.info
        self.metrics.backup = None if held is None else (held.stage, held.step, held.taken_at)
        await self.refresh_swarm()
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
        worker = self.worker
        if self.cfg.checkpoint_dir is None or worker is None or not self.service.loaded:
            return  # (a start-up interrupted before the state was loaded has nothing worth keeping)
        state = await self.compute(worker.state_dict)
        try:
            path = await asyncio.get_running_loop().run_in_executor(
                None, save_checkpoint, self.cfg.checkpoint_dir, self.run, self.stage, state)
            logger.info("checkpoint of stage %d at step %d written to %s", self.stage, state["local_step"], path)
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
        self.metrics.state = "draining"  # also what the periodic announcement says until the move or back-off
        await self.announce("draining")

    async def _release_move(self) -> None:
        self.metrics.inc("stage_move_backoffs")
        if not self.stop.is_set():
            self.metrics.state = "training"
            await self.announce("training")

    async def _enter_stage(self, stage: int) -> None:
        """Claim ``stage`` in the DHT at once (so that joiners see it is taken), then start serving it."""
        self.service = StageService(self, stage)
        self.metrics.stage, self.metrics.state = stage, "loading_state"
        await self.announce("loading_state")
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
            await self._start_dht()
            await self._start_rpc()
            assert self.rpc is not None
            self.handlers = StageHandlers(self.rpc, self._not_ready)
            self._print_join_hint()
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
        await self._check_reachability()
        if needs_relay_restart(self.cfg.relay, self.reachable, self.through_relay):
            await self._rejoin_through_relay()
        await self._enter_stage(await self._choose_stage())

    async def _rejoin_through_relay(self) -> None:
        """--relay auto found us unreachable: start the DHT again listening through a relay, before any stage or
        record exists (the peer id stays; its handlers are registered on the new p2pd)."""
        logger.warning("other peers cannot connect to this peer: joining again through a relay (--relay auto)")
        assert self.rpc is not None and self.dht is not None
        await self.rpc.shutdown()
        await asyncio.get_running_loop().run_in_executor(None, stop_dht, self.dht)
        self.dht = self.p2p = self.rpc = None
        self.through_relay = True
        await self._start_dht(rejoin=True)
        await self._start_rpc()
        assert self.rpc is not None
        self.handlers = StageHandlers(self.rpc, self._not_ready)
        relayed = [m for m in self.maddrs if "/p2p-circuit" in m]
        self.metrics.warn(f"reachable only through a relay: {relayed[0]}" if relayed else
                          "listening through a relay, but no relay slot was reserved yet")

    async def _unless_stopped(self, work: Awaitable[None]) -> None:
        """Run a start-up phase, abandoned at once if the peer is asked to stop (SIGTERM, Ctrl-C) meanwhile."""
        task = asyncio.ensure_future(work)
        stopped = asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise JoinInterrupted(f"stopped while starting up (state: {self.metrics.state})")
        task.result()

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.stop.is_set():
            logger.warning("second %s: skipping the drain", sig.name)
            self.cfg = _replace(self.cfg, drain_timeout_s=0.01)
            return
        logger.info("%s received: stopping (drain up to %.0f s, final checkpoint, withdraw)", sig.name,
                    self.cfg.drain_timeout_s)
        self.exit_reason = sig.name
        self.stop.set()

    def _print_join_hint(self) -> None:
        addrs = [m for m in self.maddrs if "/p2p/" in m] or self.maddrs
        if not self.cfg.initial_peers:
            run_flag = "" if self.run.run_id == RunConfig.default().run_id else "--run <the same run file> "
            logger.info("started a new swarm for run %s (%s). Others join it with:\n  asyncmesh-peer join "
                        "--stage auto %s--initial-peers %s", self.run.name, self.run.run_id, run_flag,
                        " ".join(addrs[:2]))
        else:
            logger.info("joined the swarm of run %s (%s) as %s", self.run.name, self.run.run_id, self.my_id)

    async def _serve(self) -> None:
        """Wait until stopped: by a signal, by max_steps, or because stage 0's driver finished."""
        while not self.stop.is_set():
            driver_task = self.driver_task  # None unless this peer serves stage 0 (a stage move may change it)
            waiters = [asyncio.ensure_future(self.stop.wait())]
            if driver_task is not None:
                waiters.append(driver_task)
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED, timeout=1.0)
            waiters[0].cancel()
            if driver_task is not self.driver_task or driver_task is None or driver_task.cancelled():
                continue  # left stage 0 meanwhile: its driver was cancelled on purpose
            if driver_task.done() and not self.stop.is_set():
                if driver_task.exception() is not None:
                    logger.error("the stage-0 driver failed: %r", driver_task.exception())
                self.exit_reason = "max_steps"
                driver = self.driver
                self.final_val_loss = await driver.evaluate() if self.cfg.eval_batches and driver else None
                self.stop.set()

    async def _shutdown(self, status: StatusServer | None) -> None:
        self.metrics.begin_drain(self.cfg.drain_timeout_s)
        self.stop.set()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        try:
            if self.dht is not None and self.worker is not None:
                with contextlib.suppress(Exception):
                    await self.announce("draining")
            await self._leave_stage()
            await self.checkpoint()
            await self._settle_samples()
            if self.dht is not None and self.my_id:
                with contextlib.suppress(Exception):
                    await withdraw(self.dht, self.run.run_id, self.record("stopped"), self.cfg.record_ttl_s,
                                   signer=self.signer, credential=self.gate.credential)
        finally:
            self.metrics.state = "stopped"
            if self.rpc is not None:  # stop taking streams before the P2P daemon goes away under them
                with contextlib.suppress(Exception):
                    await self.rpc.shutdown()
            self.write_summary()
            if status is not None:
                await status.stop()
            if self.dht is not None:
                await asyncio.get_running_loop().run_in_executor(None, stop_dht, self.dht)
            self.executor.shutdown(wait=True, cancel_futures=True)

    async def _settle_samples(self) -> None:
        """At exit: keep the samples still owed next to the checkpoints, or count them lost (and say so)."""
        text = await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.ledger.settle(self.cfg.checkpoint_dir, run_over=self.exit_reason == "max_steps"))
        if text:
            self.metrics.warn(text)

    def summary(self) -> dict[str, Any]:
        """The figures a run reports (also written with --summary-json)."""
        head = {"peer_id": self.my_id, "stage": self.stage, "run_id": self.run.run_id, "mode": self.cfg.mode,
                "exit_reason": self.exit_reason}
        return peer_summary(self.metrics, head=head, elapsed_s=time.monotonic() - self.started,
                            steps=int(self.worker.local_step) if self.worker is not None else 0, driver=self.driver,
                            ledger=self.ledger, final_val_loss=self.final_val_loss)

    def write_summary(self) -> None:
        if self.cfg.summary_json is not None:
            write_summary(self.cfg.summary_json, self.summary())


def _replace(cfg: PeerConfig, **kw: Any) -> PeerConfig:
    return dataclasses.replace(cfg, **kw)

