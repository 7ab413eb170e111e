"""The pipeline servicer: the forward and backward RPCs of one stage, and the micro-batches it holds.

A ``Forward`` is answered as soon as it is validated and queued (``Ack``), or refused with ``Busy`` when the queue is
full (backpressure), so no stream stays open across the pipeline. One consumer task feeds the compute thread, backward
work first (it frees stashed activations). Outputs go on through ``Hops`` (peer.pipeline.hops); when no hop takes a
micro-batch, a ``Backward`` without a gradient travels back so that every stage forgets it and stage 0 re-sends its
sample at once. The last stage computes the loss; a training micro-batch whose loss is far above its recent ones is
refused everywhere (``refused``), and held against its sender (``PipelineGuard``). What a stage checks of its
neighbours' work (spot checks, re-checks from held copies, testimony) is built in ``peer.pipeline.checks``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import torch

from peer.config import Mode
from peer.membership.records import PeerRecord
from peer.membership.routing import Router
from peer.pipeline.attest import Verdict, judge, relay, signed_by, signed_frame
from peer.pipeline.boundary import Boundary
from peer.pipeline.checks import neighbour_checks
from peer.pipeline.guard import PipelineGuard
from peer.pipeline.hops import Hops
from peer.pipeline.meter import ComputeMeter
from peer.pipeline.work import REFUSED, BackwardWork, ForwardWork, MicroBatchIds, Pending
from peer.seams import Compute, Send
from protocol.codecs.registry import decode
from protocol.envelope import TensorEnvelope
from protocol.errors import ErrorCode, ProtocolError
from protocol.limits import PeerBudgets
from protocol.messages import Ack, Backward, Busy, Error, Forward, Fraud, Message, Testimony, unpack
from protocol.validation import TensorSpec
from trainer.worker import LossRefused

if TYPE_CHECKING:
    from peer.config import PeerConfig
    from peer.ops.metrics import PeerMetrics
    from peer.pipeline.attest import Notary
    from peer.state.spare import SpareStore
    from trainer.config import RunConfig
    from trainer.worker import StageWorker

logger = logging.getLogger(__name__)

MAX_LOSS = 1e4
PENDING_PER_QUEUE_SLOT = 4  # micro-batches awaiting their gradient, per slot of the compute queue
NEXT_DOWN_RETRY_S = 1.0  # the Busy a later stage answers while its next stage is down
LIAR_BAN_S = 7 * 24 * 3600.0  # a witness proven to lie about our work gets none of it again (the run's life)
FRAUD_RATE = 2.0  # Fraud messages one peer may send per second (each costs a few signature checks and digests)


class PipelineServicer:
    """Serves one stage. Its ``StageService`` owns it and binds ``rpc_forward``/``rpc_backward`` in the peer's handler
    table; the driver and the stage service use the methods below for the micro-batches held here.

    Args:
        run: the run config (specs of every received tensor derive from it).
        stage: the stage this peer serves.
        worker: the StageWorker; touched only through ``compute`` (its dedicated thread).
        compute: ``await compute(fn, *args)`` runs ``fn`` on the compute thread.
        send: ``await send(peer_id, name, msg)`` one RPC with the configured timeout; returns the reply.
        swarm: returns the latest validated DHT snapshot.
        router, metrics, cfg: next-hop choice, PeerMetrics, PeerConfig.
        my_id: this peer's id (base58).
        spares: the held copy of the neighbour stage, to re-check the next stage's gradients from (None: no re-checks).
        upstream: stage 1 of a run of 3+ stages: its private copy of stage 0, to re-check stage 0's forwards from.
    """

    def __init__(self, *, run: RunConfig, stage: int, worker: StageWorker, compute: Compute, send: Send,
                 swarm: Callable[[], dict[str, PeerRecord]], router: Router, metrics: PeerMetrics, cfg: PeerConfig,
                 my_id: str, cost: float, spares: SpareStore | None = None,
                 upstream: SpareStore | None = None, notary: Notary | None = None) -> None:
        self.run, self.stage, self.worker, self.compute, self.send = run, stage, worker, compute, send
        self.notary = notary
        self.swarm, self.router, self.metrics, self.cfg, self.my_id = swarm, router, metrics, cfg, my_id
        self.is_first, self.is_last = stage == 0, stage == run.n_stages - 1
        b, t = run.data.batch_size, run.model.block_size
        # activations and gradients in the run's codec, or as subspace coefficients (peer/pipeline/boundary.py)
        self.boundary = Boundary(run, getattr(worker, "subspace", None))
        self.tok_spec = TensorSpec((b, t), torch.int64)  # plain runs' targets (subspace runs: in the token window)
        self.pending: dict[int, Pending] = {}
        self.backward_q: asyncio.Queue[BackwardWork] = asyncio.Queue()
        self.forward_q: asyncio.Queue[ForwardWork] = asyncio.Queue(maxsize=cfg.max_queue)
        self._wake = asyncio.Event()
        self._accepting = True
        self.vouch: Callable[[str], None] = lambda peer: None
        """Marks a peer as known (``RpcServer.vouch``) once its work is validated and trained; set by the stage."""
        self.revoke: Callable[[str], None] = lambda peer: None
        """Makes a peer a stranger again (``RpcServer.revoke``) once it is banned for bad work; set by the stage."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self.last_forward = time.monotonic()
        # the compute time of micro-batches here, and the throughput announced from it (peer/pipeline/meter.py)
        self.meter = ComputeMeter(compute, cost=cost, is_last=self.is_last)
        # sync mode, later stages: awaited with a training forward's flush number before it is computed
        self.on_flush: Callable[[int], Awaitable[None]] | None = None
        # sync mode, later stages: called with a training micro-batch's flush once its backward is done here (a
        # replica that finished its share of a flush opens that flush's barrier while the earlier stages drain)
        self.on_backward_done: Callable[[int], None] | None = None
        # the ids this stage gives the micro-batches it forwards (a gradient comes back under it)
        self.ids = MicroBatchIds()
        # who may send us work, which ids, norms and losses (peer/pipeline/guard.py)
        self.guard = PipelineGuard(stage=stage, swarm=swarm, count=metrics.inc, warn=metrics.warn,
                                   pinned=cfg.mode == Mode.SYNC)
        self.guard.share.on_ban = lambda peer: self.revoke(peer)  # its work refused again and again
        # the sends to the next stage's peers and back to the previous one (peer/pipeline/hops.py)
        self.hops = Hops(run_id=run.run_id, stage=stage, my_id=my_id, cfg=cfg, send=send, swarm=swarm, router=router,
                         metrics=metrics, accepting=lambda: self._accepting, notary=notary)
        # what this stage checks of its neighbours' work (peer/pipeline/checks.py): spot checks of the next stage's
        # hops and the answers they hold, re-checks from the held copy, the testimony kept for the stage two before,
        # and stage 1's re-checks of stage 0's forwards
        checks = neighbour_checks(self, spares=spares, upstream=upstream)
        self.spot, self.checks, self.recheck = checks.spot, checks.cross, checks.recheck
        self.testimony, self.fwdcheck = checks.testimony, checks.fwdcheck
        self.hops.cap = self.spot.cap_weights if self.spot is not None else None
        self._fraud_budget = PeerBudgets(rate=FRAUD_RATE, burst=int(2 * FRAUD_RATE))

    # ----- helpers ------------------------------------------------------------------------------------------------
    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ----- the micro-batches held here (the driver, the stage service and the sync schedule use these) ---------------
    @property
    def accepting(self) -> bool:
        """Whether this stage takes work (False once the peer leaves it)."""
        return self._accepting

    def stop_accepting(self) -> None:
        """Take no more forwards (and, draining, stop waiting for routes that may never come)."""
        self._accepting = False

    def inflight(self) -> int:
        """Micro-batches held here: this stage waits for their gradient (or, queued, their compute)."""
        return len(self.pending)

    def expect(self, mb_id: int, pending: Pending) -> None:
        """Stage 0: a micro-batch of its own is on its way; its gradient is awaited under ``mb_id``."""
        self.pending[mb_id] = pending

    def forget(self, mb_id: int) -> bool:
        """Forget ``mb_id`` without telling anyone (stage 0's own micro-batch finished or abandoned); whether it was
        held."""
        return self.pending.pop(mb_id, None) is not None

    def holds(self, mb_id: int, pending: Pending) -> bool:
        """Whether ``mb_id`` is still held here as ``pending`` (not dropped, expired or replaced meanwhile)."""
        return self.pending.get(mb_id) is pending

    def holds_flush(self, flush: int) -> bool:
        """Sync mode: training micro-batches of ``flush`` or an earlier one are still held here."""
        return any(p.flush is not None and p.flush <= flush and not p.is_eval for p in self.pending.values())

    async def drain(self, timeout_s: float) -> int:
        """Stop taking work, wait up to ``timeout_s`` for the micro-batches held here, then drop the rest (upstream is
        told, stage 0 re-trains their samples); returns how many were dropped."""
        self.stop_accepting()
        deadline = time.monotonic() + timeout_s
        while self.pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = list(self.pending)
        for mb in left:
            await self.drop(mb, notify=True)
        return len(left)

    async def close(self) -> None:
        """Cancel the sends and jobs this stage started, and wait for them to end."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def queue_backward(self, work: BackwardWork) -> None:
        """Queue validated backward work for the compute thread (it goes before forwards)."""
        self.backward_q.put_nowait(work)
        self._wake.set()

    def idle_s(self) -> float:
        """Seconds since the last forward request was accepted (or since this stage started)."""
        return time.monotonic() - self.last_forward

    def queued(self) -> int:
        return self.forward_q.qsize() + self.backward_q.qsize()

    def _reject(self, reason: str, code: ErrorCode, message: str) -> Error:
        self.metrics.inc(f"rejected:{reason}")
        return Error(code=code, message=message)

    async def _decode(self, env: TensorEnvelope, spec: TensorSpec, peer: str) -> torch.Tensor:
        return await asyncio.get_running_loop().run_in_executor(None, lambda: decode(env, spec, peer=peer))

    # ----- RPC handlers (network boundary) --------------------------------------------------------------------------
    async def rpc_forward(self, msg: Message, peer_id: str) -> Message:
        if not isinstance(msg, Forward):  # the server admits only Forward here (sizes.HANDLER_KINDS)
            return self._reject("bad_request", ErrorCode.BAD_REQUEST, "expected a Forward")
        if msg.run_id != self.run.run_id:
            return self._reject("wrong_run", ErrorCode.WRONG_RUN, f"this peer trains run {self.run.run_id}")
        if self.is_first or len(msg.route) != self.stage:
            return self._reject("wrong_stage", ErrorCode.WRONG_STAGE, f"this peer serves stage {self.stage}")
        if msg.route[-1] != peer_id:
            return self._reject("unauthorized", ErrorCode.UNAUTHORIZED, "the route must end with the sender")
        if not self.guard.announced_sender(peer_id):  # not (yet) in our view: retry later, no ban
            return Busy(retry_after_s=1.0)
        if self.guard.seen(msg.mb_id):
            return Error(code=ErrorCode.BAD_REQUEST, message=f"micro-batch {msg.mb_id} was already taken here")
        if not self._accepting:
            return self._reject("not_ready", ErrorCode.NOT_READY, "this peer is not taking work (joining/draining)")
        if msg.mb_id in self.pending:
            return self._reject("duplicate", ErrorCode.BAD_REQUEST, f"micro-batch {msg.mb_id} is already here")
        if not self.guard.share.admits(peer_id, sum(1 for q in self.pending.values() if q.prev_peer == peer_id)):
            return Busy(retry_after_s=0.5)  # it holds all the work its trained work has earned it so far
        if not msg.is_eval and (msg.flush is None) == (self.cfg.mode == Mode.SYNC):
            return self._reject("mode_mismatch", ErrorCode.BAD_REQUEST,
                                f"this peer runs --mode {self.cfg.mode}; peers of one swarm must share the mode")
        if not self.is_last and self.hops.next_down():  # work we could not send on: the sender keeps it (and
            # does not count it against us while our next stage is gone)
            self.metrics.inc("busy_next_down")
            return Busy(retry_after_s=NEXT_DOWN_RETRY_S)
        if self.forward_q.full() or len(self.pending) >= PENDING_PER_QUEUE_SLOT * self.cfg.max_queue:
            self.metrics.inc("busy_replies")  # backpressure: queued work and stashed micro-batches are both bounded
            return Busy(retry_after_s=0.05 * (1 + self.forward_q.qsize()))
        answers = b""  # the digest of a signed forward: its gradient signs it too
        if self.stage >= 2 and not msg.is_eval:
            signed = None if self.notary is None else await asyncio.get_running_loop().run_in_executor(
                None, signed_by, self.notary, msg, peer_id)
            if signed is None:
                return self._reject("unsigned", ErrorCode.BAD_REQUEST, "a training forward from stage 1 on must "
                                    "carry its sender's signature (peer.pipeline.attest)")
            answers = signed
        try:
            x, window, sent = await asyncio.get_running_loop().run_in_executor(
                None, self.boundary.decode_forward_sent, msg, peer_id)
            targets = None
            if self.is_last and window is not None:  # the window's last T ids (plain runs: the targets are them)
                targets = window[:, 1:]
                if msg.targets is not None and not torch.equal(
                        (await self._decode(msg.targets, self.tok_spec, peer_id)).long(), targets):
                    return self._reject("bad_request", ErrorCode.BAD_REQUEST, "targets other than the token window's")
            elif self.is_last:
                if msg.targets is None:
                    return self._reject("bad_request", ErrorCode.BAD_REQUEST, "the last stage needs targets")
                targets = (await self._decode(msg.targets, self.tok_spec, peer_id)).long()
                if int(targets.min()) < 0 or int(targets.max()) >= self.run.model.vocab_size:
                    return self._reject("bad_request", ErrorCode.BAD_REQUEST, "targets outside the vocabulary")
        except ProtocolError as e:
            return self._reject("bad_tensor", ErrorCode.BAD_REQUEST, str(e))
        if not self.guard.norm_ok("activations", sent, peer_id):
            return Error(code=ErrorCode.OUT_OF_BOUNDS, message="activation norm outside the bounds of recent traffic")
        if self.forward_q.full():  # filled while we decoded
            return Busy(retry_after_s=0.1)
        self.guard.accept_id(msg.mb_id)
        self.last_forward = time.monotonic()
        self.pending[msg.mb_id] = Pending(prev_peer=peer_id, next_peer=None, route=list(msg.route),
                                          deadline=time.monotonic() + self.cfg.microbatch_timeout_s,
                                          is_eval=msg.is_eval, flush=msg.flush, answers=answers)
        if self.fwdcheck is not None and not msg.is_eval:  # decided on arrival: its timing tells the sender nothing
            self.pending[msg.mb_id].fwdcheck = self.fwdcheck.wants(peer_id)
        if self.testimony is not None and not msg.is_eval:
            self.testimony.received(peer_id, msg)
        self.forward_q.put_nowait(ForwardWork(msg, x, targets, window))
        self._wake.set()
        return Ack()

    async def rpc_backward(self, msg: Message, peer_id: str) -> Message:
        if not isinstance(msg, Backward):  # the server admits only Backward here (sizes.HANDLER_KINDS)
            return self._reject("bad_request", ErrorCode.BAD_REQUEST, "expected a Backward")
        if msg.run_id != self.run.run_id:
            return self._reject("wrong_run", ErrorCode.WRONG_RUN, f"this peer trains run {self.run.run_id}")
        signed = msg  # as its sender signed it
        msg = dataclasses.replace(msg, mb_id=self.ids.local(msg.mb_id))  # the id we hold it under
        p = self.pending.get(msg.mb_id)
        if p is None:
            self.metrics.inc("late_backward")  # we already dropped it (timeout); not the sender's fault
            return Ack()
        if peer_id not in p.sent_to and not (p.is_eval and self.is_first):
            return self._reject("unauthorized", ErrorCode.UNAUTHORIZED, "gradient from a peer we did not send to")
        if p.is_eval != msg.is_eval:
            return self._reject("bad_request", ErrorCode.BAD_REQUEST, "is_eval does not match the micro-batch")
        if msg.loss is not None and not (math.isfinite(msg.loss) and 0.0 <= msg.loss < MAX_LOSS):
            return self._reject("bad_loss", ErrorCode.BAD_REQUEST, "loss must be finite and in [0, 1e4)")
        if msg.gradient is not None and not msg.is_eval and not self.is_first:  # a middle stage: signed by its
            # sender over the forward we sent it, relayed upstream with the gradient we return, and kept in our own
            # record, for a re-check whose witness is silent (peer.pipeline.attest)
            answers = b"" if p.sent is None else p.sent[1]
            digest = None if self.notary is None or not answers else await asyncio.get_running_loop(
                ).run_in_executor(None, signed_by, self.notary, signed, peer_id, self.my_id, answers)
            if digest is None:
                return self._reject("unsigned", ErrorCode.BAD_REQUEST, "a training gradient from stage 2 on must "
                                    "carry its sender's signature over the forward we sent it (peer.pipeline.attest)")
            p.relayed[peer_id] = relay(signed, digest, answers)
            if self.testimony is not None and p.sent is not None:
                self.testimony.sent(peer_id, p.sent[0], signed)
        grad = None
        if msg.gradient is not None and not msg.is_eval:
            try:
                grad = await asyncio.get_running_loop().run_in_executor(
                    None, self.boundary.decode_gradient, msg.gradient, peer_id)
            except ProtocolError as e:
                return self._reject("bad_tensor", ErrorCode.BAD_REQUEST, str(e))
        if grad is not None and not self.guard.norm_ok("gradients", grad, peer_id):
            # the micro-batch cannot finish here: dropped now, so stage 0 re-sends its sample at once and the hop owes
            # no gradient (held until microbatch_timeout_s, it would stall stage 0 while the bound adapts to early
            # training's growing gradients, and count against the hop as a black hole)
            self.spawn(self.drop(msg.mb_id, notify=not self.is_first))
            return Error(code=ErrorCode.OUT_OF_BOUNDS, message="gradient norm outside the bounds of recent traffic")
        if msg.refused and (msg.gradient is not None or msg.is_eval):
            return self._reject("bad_request", ErrorCode.BAD_REQUEST, "a refused micro-batch carries no gradient")
        if msg.loss is not None and not msg.refused and not self.guard.loss_ok(msg.loss, is_eval=msg.is_eval):
            msg = dataclasses.replace(msg, loss=None)  # an outlier: flagged, never reported as our loss
        self.router.returned(peer_id, msg.mb_id)
        if msg.mb_id not in self.pending:  # dropped while we decoded
            return Ack()
        p.trained_from = [peer_id]  # named in the gradient we return (a middle stage's re-checks ask them)
        if p.checks is not None and peer_id in p.checks and self.checks is not None:
            p.trained_from = list(p.checks)  # both replicas: a gradient trained on is their mean
            checked = self.checks.answer(p, peer_id, msg, grad)
            if checked is None:
                return Ack()  # held until its partner's gradient is here
            msg, grad = checked
        elif self.recheck is not None and self.recheck.answer(p, peer_id, msg, grad, self.guard.learning("gradients")):
            return Ack()  # held until the held copy of the next stage re-computed it
        self.queue_backward(BackwardWork(msg, grad))
        if grad is not None:  # a gradient within the bounds of recent traffic, for work we sent: validated work
            self.vouch(peer_id)
        return Ack()

    async def rpc_fraud(self, msg: Message, peer_id: str) -> Message:
        """A witness we sent work to lied about it to the stage before us (``peer.pipeline.attest``): checked here
        alone, and a proven liar gets no more of our work (``LIAR_BAN_S``), so that our own re-checks pass again."""
        if not isinstance(msg, Fraud) or msg.run_id != self.run.run_id or self.notary is None:
            return self._reject("bad_request", ErrorCode.BAD_REQUEST, "expected a Fraud of this run")
        if self._fraud_budget.empty(peer_id):
            return self._reject("fraud_rate_limited", ErrorCode.RATE_LIMITED,
                                f"fraud: at most {FRAUD_RATE:.0f} per second")
        self._fraud_budget.spend(peer_id)
        notary = self.notary

        def check() -> Verdict:
            testimony = unpack(msg.testimony)
            if not isinstance(testimony, Testimony):
                return Verdict.UNUSABLE
            return judge(notary, testimony, run_id=self.run.run_id, hop=self.my_id, witness=msg.witness,
                         mb_id=msg.mb_id, relayed=msg.relayed).verdict

        try:
            verdict = await asyncio.get_running_loop().run_in_executor(None, check)
        except ProtocolError as e:
            return self._reject("bad_fraud", ErrorCode.BAD_REQUEST, f"fraud: not a testimony ({e})")
        if verdict is not Verdict.WITNESS_LIED:
            return self._reject("bad_fraud", ErrorCode.BAD_REQUEST, "fraud: the testimony does not contradict itself")
        if not self.router.penalised(msg.witness, LIAR_BAN_S / 2):
            logger.warning("peer %s lied about our work to the stage before us (its own signatures prove it; told "
                           "by %s): no more work for it", msg.witness[-8:], peer_id[-8:])
            self.metrics.inc("liars_banned")
        self.router.ban(msg.witness, LIAR_BAN_S)
        return Ack()

    # ----- the compute consumer --------------------------------------------------------------------------------------
    async def serve(self) -> None:
        """Feed the compute thread forever: backward first. Exceptions of one item are logged, never fatal."""
        while True:
            if self.backward_q.empty() and self.forward_q.empty():
                self._wake.clear()
                await self._wake.wait()
                continue
            item: ForwardWork | BackwardWork = (self.backward_q.get_nowait() if not self.backward_q.empty()
                                                else self.forward_q.get_nowait())
            try:
                if isinstance(item, ForwardWork):
                    await self._process_forward(*item)
                else:
                    await self._process_backward(*item)
            except Exception:  # a bad item must not stop the stage; the micro-batch times out upstream
                logger.exception("processing micro-batch %d failed; dropping it", item.msg.mb_id)
                self.metrics.inc("compute_errors")
                await self.drop(item.msg.mb_id, notify=True)

    async def _process_forward(self, msg: Forward, x: torch.Tensor, targets: torch.Tensor | None,
                               window: torch.Tensor | None = None) -> None:
        p = self.pending.get(msg.mb_id)
        if p is None:
            return
        if self.is_last:
            if msg.is_eval:
                val_loss = await self.compute(self.worker.evaluate, x, targets)
                self.pending.pop(msg.mb_id, None)
                self.spawn(self.hops.backward(p.route[0], msg.mb_id, p.route, None, float(val_loss), True))
                return
            if self.on_flush is not None and msg.flush is not None:  # sync mode: every training forward has one
                await self.on_flush(msg.flush)
            if await self._forward_refused(p, msg.mb_id, x, window):
                return
            ceiling = self.guard.loss_ceiling()
            try:
                loss, grad = await self.meter.timed(msg.mb_id, True, functools.partial(
                    self.worker.forward_loss, max_loss=ceiling), msg.mb_id, x, targets)
            except LossRefused as e:
                self.pending.pop(msg.mb_id, None)
                self.guard.loss_verdict(p.prev_peer, e.loss, refused=e)
                self.spawn(self.hops.backward(p.prev_peer, msg.mb_id, p.route, None, e.loss, False, refused=True))
                return
            self.pending.pop(msg.mb_id, None)
            self.guard.loss_verdict(p.prev_peer, float(loss))
            if p.prev_peer is not None:
                self.vouch(p.prev_peer)  # its micro-batch passed the loss check and is trained
            self._count_step(float(loss), x)
            self._backward_done(msg.flush)
            assert grad is not None  # a later stage's input has a gradient (stage 0 sends no forward to itself)
            await self._return_gradient(p, msg.mb_id, grad, float(loss))
            return
        if msg.is_eval:
            y = await self.compute(self.worker.evaluate, x)
            self.pending.pop(msg.mb_id, None)
        else:
            if self.on_flush is not None and msg.flush is not None:  # sync mode: every training forward has one
                await self.on_flush(msg.flush)
            if await self._forward_refused(p, msg.mb_id, x, window):
                return
            y = await self.meter.timed(msg.mb_id, False, self.worker.forward, msg.mb_id, x)
        self.spawn(self.forward_next(msg.mb_id, y, msg.targets, msg.route + [self.my_id], msg.is_eval, msg.flush,
                                     window=window))

    async def _forward_refused(self, p: Pending, mb_id: int, x: torch.Tensor, window: torch.Tensor | None) -> bool:
        """Re-check a forward marked on arrival against the copy of stage 0; one the copy does not reproduce is
        refused, as by the loss check: not computed, not sent on, the sender told and its share halved."""
        if not p.fwdcheck or self.fwdcheck is None or p.prev_peer is None \
                or await self.fwdcheck.judge(p.prev_peer, mb_id, x, window):
            return False
        self.pending.pop(mb_id, None)
        self.guard.share.refused(p.prev_peer)
        self.spawn(self.hops.backward(p.prev_peer, mb_id, p.route, None, None, False, refused=True))
        return True

    def _backward_done(self, flush: int | None) -> None:
        if self.on_backward_done is not None and flush is not None:
            self.on_backward_done(flush)

    def _count_step(self, loss: float | None, x: torch.Tensor) -> None:
        if loss is not None:
            self.metrics.observe_loss(loss)
        self.metrics.inc("tokens", int(x.shape[0] * x.shape[1]))
        self.metrics.inc("samples", int(x.shape[0]))
        self.metrics.local_step = self.worker.local_step

    async def _process_backward(self, msg: Backward, grad: torch.Tensor | None) -> None:
        p = self.pending.pop(msg.mb_id, None)
        if p is None:
            return
        if p.is_eval:
            if p.done is not None and not p.done.done():
                p.done.set_result(msg.loss)
            return
        if grad is None:  # the route broke downstream, or the last stage refused the micro-batch
            await self.compute(self.worker.drop, msg.mb_id)
            self.meter.forget(msg.mb_id)
            if msg.refused:
                self.metrics.inc("microbatches_refused")
                if p.prev_peer is not None:
                    self.guard.share.refused(p.prev_peer, measured_here=False)
            if p.done is not None and not p.done.done():
                p.done.set_result(REFUSED if msg.refused else None)
            elif p.prev_peer is not None:
                why = msg.refused
                self.spawn(self.hops.backward(p.prev_peer, msg.mb_id, p.route, None, msg.loss if why else None, False,
                                               refused=why))
            return
        if p.prev_peer is not None:
            self.guard.share.trained(p.prev_peer)
            self.vouch(p.prev_peer)  # its micro-batch is trained
        grad_in = await self.meter.timed(msg.mb_id, True, self.worker.backward, msg.mb_id, grad)
        # observed pipeline staleness (tau_s of the papers, here whatever the network made it)
        self.metrics.observe_pipeline_delay(self.worker.last_delay)
        if not self.is_first:
            self.metrics.inc("tokens", self.run.data.batch_size * self.run.model.block_size)
            self.metrics.local_step = self.worker.local_step
            self._backward_done(p.flush)
        if p.done is not None and not p.done.done():
            p.done.set_result(msg.loss)
        if p.prev_peer is not None and grad_in is not None:
            relayed = [p.relayed[w] for w in p.trained_from or [] if w in p.relayed]
            await self._return_gradient(p, msg.mb_id, grad_in, msg.loss, downstream=(p.trained_from, p.sent_id),
                                        relayed=relayed or None)

    async def _return_gradient(self, p: Pending, mb_id: int, grad: torch.Tensor, loss: float | None, *,
                               downstream: tuple[list[str] | None, int | None] = (None, None),
                               relayed: list[list[bytes]] | None = None) -> None:
        """Encode (and from stage 2 on sign) the input gradient of ``mb_id`` and send it to the peer it came from;
        the testimony store keeps the frame as sent."""
        peer = p.prev_peer
        assert peer is not None

        def frame() -> Backward:
            env = self.boundary.encode_gradient(grad)
            return self.hops.frame(peer, mb_id, p.route, env, loss, False, downstream=downstream, relayed=relayed,
                                   answers=p.answers)

        msg = await asyncio.get_running_loop().run_in_executor(None, frame)
        if self.testimony is not None:
            self.testimony.returned(peer, msg)
        self.spawn(self.hops.deliver(peer, msg))

    # ----- sending ---------------------------------------------------------------------------------------------------
    async def forward_next(self, mb_id: int, y: torch.Tensor, targets_env: TensorEnvelope | None, route: list[str],
                           is_eval: bool, flush: int | None = None, *, window: torch.Tensor | None = None) -> bool:
        """Send activations to a peer of the next stage, retrying elsewhere; on failure drop and tell upstream.

        ``flush``: the sync mode's flush number, set by stage 0 and passed on unchanged (None in async mode).
        ``window``: the micro-batch's token window [B, T+1] (subspace runs send it with the coefficients).
        """
        # a later stage sends a training micro-batch under an id of its own: a spot check's copy, forwarded by the
        # second replica too, would otherwise meet the first copy as a replay two stages on. An evaluation keeps
        # stage 0's id: the last stage answers stage 0 directly.
        sent_id = mb_id if self.is_first or is_eval else self.ids.new(local=mb_id)
        notary = None if self.is_first or is_eval else self.notary  # what a witness may be asked about is signed

        def frame() -> tuple[Forward, bytes]:
            env, tokens = self.boundary.encode_forward(y, window)
            msg = Forward(run_id=self.run.run_id, mb_id=sent_id, route=route, activations=env, targets=targets_env,
                          is_eval=is_eval, sent_at=time.time(), flush=flush, tokens=tokens)
            return (msg, b"") if notary is None else signed_frame(notary, msg, self.my_id)

        msg, signed = await asyncio.get_running_loop().run_in_executor(None, frame)
        p = self.pending.get(mb_id)
        if p is not None and signed:
            p.sent = (msg, signed)  # its gradient must answer this frame; kept in our record with it
        if p is not None and not is_eval and self.recheck is not None and self.recheck.usable():
            p.recheck = msg  # the gradient may be re-computed from it when it comes back
        peer = await self.hops.forward(msg, p.sent_to if p else set())
        if peer is not None:
            if p is not None:
                p.next_peer, p.sent_id = peer, sent_id
                if not is_eval:
                    self.router.sent(peer, mb_id)  # its gradient is owed now (black-hole detection)
                    learning = self.guard.learning("gradients")
                    if self.checks is not None and self.checks.wants(peer, learning=learning) and not (
                            self.recheck is not None and self.recheck.untrusted(peer)):  # re-checked instead
                        await self.checks.second(p, peer, msg, local_id=mb_id)
            return True
        if not self.is_first:  # stage 0's driver counts its own drops when it re-queues the sample
            self.metrics.inc("microbatches_dropped")
        await self.drop(mb_id, notify=not self.is_first)
        return False

    async def drop(self, mb_id: int, *, notify: bool) -> None:
        """Forget a micro-batch here; with ``notify``, tell the previous stage so it forgets it too."""
        p = self.pending.pop(mb_id, None)
        self.meter.forget(mb_id)
        if p is None:
            return
        for hop in {p.next_peer, *(p.checks or ())} - {None}:
            self.router.cancel(hop, mb_id)
        if not p.is_eval:
            await self.compute(self.worker.drop, mb_id)
        if p.done is not None and not p.done.done():
            p.done.set_result(None)
        if notify and p.prev_peer is not None and not p.is_eval:
            self.spawn(self.hops.backward(p.prev_peer, mb_id, p.route, None, None, False))

    async def expire(self) -> int:
        """Drop micro-batches whose gradient is overdue; returns how many (the daemon calls it on a timer)."""
        # a hop we cannot reach forfeits its micro-batches; one that accepted work and answered none of it is banned,
        # work re-sent. Not in sync mode: there the next hop is pinned (no other route) and a later stage rightly
        # holds a flush's micro-batches while it waits at its barrier, so a ban would stall the pipeline for
        # ban_max_s; a flush's lost micro-batches time out and are re-sent.
        later = self.run.n_stages - self.stage - 2  # the stages after our next hop, judged before it
        asynchronous = self.cfg.mode == Mode.ASYNC
        # failed, restarted, or silent too long (async only, as black holes): what they hold will not come back
        for peer, held in self.router.lost(later_stages=later, silent=asynchronous):
            self.metrics.inc("microbatches_forfeited", len(held))
            logger.info("peer %s will not answer the %d micro-batches it holds; dropping them", peer, len(held))
            for mb in held:
                await self.drop(mb, notify=True)
        holes = self.router.black_holes(later_stages=later) if asynchronous else []
        for peer, held in holes:
            self.metrics.inc("black_holes_banned")
            self.metrics.warn(f"peer {peer[-8:]} accepted {len(held)} micro-batches and answered none; banned")
            logger.warning("peer %s accepted %d micro-batches and answered none; banned, dropping them", peer,
                           len(held))
            for mb in held:
                await self.drop(mb, notify=True)
        now = time.monotonic()
        overdue = [mb for mb, p in self.pending.items() if p.deadline < now]
        for mb in overdue:
            if not self.is_first:
                self.metrics.inc("microbatches_dropped")
            await self.drop(mb, notify=False)
        return len(overdue)

