"""Blocking full average among a stage's replicas (``--mode sync``): one barrier per step, p = 1, tau = 0.

Every replica calls ``all_average(step, tensors, peers)`` once per optimiser step with its gradients; parts travel over
the validated pairwise exchange of the asynchronous rounds (``averaging.exchange``), only from announced training
replicas of the stage (``StageMembers``). A far outlier among three or more parts is dropped and the rest averaged with
the plain mean (the textbook baseline); a replica that does not arrive by ``sync_timeout_s`` costs the others the
wait, never a wrong sum. Barriers are keyed by step: a joiner that starts behind adopts the others' step (at most
``MAX_PENDING`` future steps held open). Every part ends with a digest of the sender's weights, so a barrier that
timed out and left the replicas apart is found and repaired (``peer.averaging.fork``, ``peer.sync_schedule``).
docs/design.md ("The synchronous baseline") gives the reasons.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

import torch

from peer.averaging.aggregate import barrier_mean
from peer.averaging.config import NetAveragingConfig
from peer.averaging.exchange import (
    PartExchange,
    Refused,
    Slot,
    exchange_all,
    finite_norm_check,
)
from peer.averaging.fork import Fork, fork_of
from peer.ids import short_id
from peer.lifecycle import PeerState
from protocol.errors import ErrorCode
from protocol.rpc import HandlerTable, RpcTransport, Transport
from trainer.config import RunConfig

if TYPE_CHECKING:
    from hivemind.p2p import P2P

    from peer.membership.records import PeerRecord
    from peer.ops.metrics import PeerMetrics

logger = logging.getLogger(__name__)

SYNC_RPC = "avg_sync"
MAX_PENDING = 4
MAX_JUMPS = 3
FINISHED_KEPT = 2  # finished barriers whose own part is kept to answer a replica whose reply from us was lost
AHEAD_HOLD_S = 5.0  # how long a barrier stays for its missing parts once replicas that finished it wait at a later one


class StageMembers:
    """Whether a sender is an announced training replica of ``stage`` in the peer's validated view (``swarm``). A
    sender not in it makes the view be re-read (``refresh``), at most once per ``refresh_s`` and shared by every
    caller waiting meanwhile, so a replica that joined a moment ago is admitted and a stranger's flood costs one DHT
    read per ``refresh_s``."""

    def __init__(self, *, stage: int, swarm: Callable[[], dict[str, PeerRecord]],
                 refresh: Callable[[], Awaitable[object]] | None = None, refresh_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stage, self.swarm, self.refresh, self.refresh_s, self.clock = stage, swarm, refresh, refresh_s, clock
        self._read_at = -float("inf")
        self._reading: asyncio.Task[object] | None = None

    def announced(self, peer: str) -> bool:
        record = self.swarm().get(peer)
        return record is not None and record.stage == self.stage and record.state == PeerState.TRAINING

    async def __call__(self, peer: str) -> bool:
        if self.announced(peer):
            return True
        if self.refresh is not None and self._reading is None and self.clock() - self._read_at >= self.refresh_s:
            self._read_at = self.clock()
            self._reading = asyncio.ensure_future(self.refresh())
            self._reading.add_done_callback(self._read_done)
        if self._reading is not None:
            try:
                await asyncio.shield(self._reading)
            except Exception as e:  # the old view stands; the sender is refused this time
                logger.debug("re-reading the stage's replicas failed: %r", e)
        return self.announced(peer)

    def _read_done(self, task: asyncio.Task[object]) -> None:
        self._reading = None
        if not task.cancelled():
            task.exception()  # retrieved: a failed read is logged by the caller that waited for it


class SyncAverager:
    """See the module docstring. Args as AveragingLoop, without the DHT and the worker; ``member``: async fn(sender)
    -> whether its part may be admitted at all (``StageMembers``; None: anyone, as in unit tests of the barrier)."""

    def __init__(self, *, p2p: P2P | None, rpc_server: HandlerTable | None, run: RunConfig, stage: int,
                 metrics: PeerMetrics,
                 config: NetAveragingConfig | None = None, transport: Transport | None = None,
                 me: str | None = None, clock: Callable[[], float] = time.time,
                 member: Callable[[str], Awaitable[bool]] | None = None) -> None:
        self.config = config or NetAveragingConfig()
        self.metrics, self.clock = metrics, clock
        self._averaging = run.averaging
        if me is None:
            if p2p is None:
                raise ValueError("SyncAverager needs me (this peer's id) when it has no p2p to read it from")
            me = p2p.peer_id.to_base58()
        self.me: str = me
        self.last_step = -1
        self._opened_by: dict[int, str] = {}
        self._finished: dict[int, Slot] = {}  # the last FINISHED_KEPT barriers we completed, to answer late callers
        # called with (step, peer) when a replica's part opens a barrier we have not opened (it is waiting there)
        self.on_remote_open: Callable[[int, str], None] | None = None
        # after each barrier: whether our weights differ from the replicas' (their digests), and whom to resync from
        self.fork: Fork | None = None
        # replicas whose parts went into a barrier's mean did validated work: known peers from then on (their large
        # requests keep their streams, protocol/rpc.py)
        self.vouch: Callable[[str], None] | None = getattr(rpc_server, "vouch", None)
        grads_check = finite_norm_check(self.config.sync_max_norm_ratio, 1.0)
        self.exchange = PartExchange(
            transport=transport or RpcTransport(p2p, rpc_server), name=SYNC_RPC, run_id=run.run_id, stage=stage,
            me=self.me, codec=self.config.sync_codec, metrics=metrics, clock=clock, admit=self._admit,
            check=lambda received, own: grads_check(received[:-1], own[:-1]),  # the last tensor is the digest
            member=member)

    async def start(self) -> None:
        await self.exchange.register()

    def _admit(self, step: int, peer: str) -> Slot:
        if step <= self.last_step:
            done = self._finished.get(step)
            if done is None or done.own_part is None:
                raise Refused(ErrorCode.NOT_READY, "step_over",
                              f"step {step} is over here (our last step is {self.last_step})")
            # A late caller of a barrier we finished (typically: its part reached us, our reply to it was lost with
            # its stream): answer with the part we averaged with, so it ends with the same mean instead of waiting
            # for us until its deadline. What it sends now is not used any more.
            replay = Slot(key=step, deadline=self.clock() + self.config.sync_grace_s, own_part=done.own_part,
                          own_values=done.own_values)
            replay.ready.set_result(None)
            return replay
        now = self.clock()
        for key in [k for k, sl in self.exchange.slots.items() if sl.own_part is None and sl.deadline < now]:
            self.exchange.close(key)  # opened by a peer, never reached by us: expired
            self._opened_by.pop(key, None)
        if len(self.exchange.slots) >= MAX_PENDING:
            raise Refused(ErrorCode.NOT_READY, "too_many_steps", f"too many open steps; ours is {self.last_step + 1}")
        self._opened_by[step] = peer
        slot = self.exchange.open(step, self.clock() + self.config.sync_timeout_s)
        if self.on_remote_open is not None:
            self.on_remote_open(step, peer)
        return slot

    def _ahead(self, step: int, peers: list[str], *, finished_too: bool = False) -> int | None:
        """The latest step after ``step`` that replicas in our view have opened here (they wait there), unless one of
        them gave us its part of ``step`` (``finished_too``: even then): that one finished ``step`` with us, and the
        parts we still miss can still come (a replica that finished answers a late caller with the part it
        averaged); leaving ``step`` for the later one would skip a step the others took, a fork to repair by loading
        a state. ``_watch_ahead`` leaves such a step too once it stayed incomplete for ``AHEAD_HOLD_S``."""
        current = self.exchange.slots.get(step)
        done = current.contributions if current is not None else {}
        later = []
        for k, slot in self.exchange.slots.items():
            waiting = {p for p in {*slot.senders, self._opened_by.get(k)} if p in peers}
            if k > step and waiting and (finished_too or not waiting & done.keys()):
                later.append(k)
        return max(later) if later else None

    async def all_average(self, step: int, tensors: list[torch.Tensor], peers: Iterable[str], *,
                          digest: torch.Tensor | None = None) -> tuple[list[torch.Tensor], int]:
        """Mean of ``tensors`` over the replicas that arrive in time, and their number (1: alone or all failed).

        The barrier used may be a later step than ``step`` (see the module docstring): read ``last_step`` after.
        ``digest``: ``peer.averaging.fork.weights_digest`` of the weights whose gradients ``tensors`` are; then
        ``fork`` says after the barrier whether they differ from the replicas' (None without a digest).
        """
        step = max(step, self.last_step + 1)
        shapes = [t.shape for t in tensors]
        tensors = [*tensors, digest if digest is not None else torch.zeros(1)]
        self.fork = None
        peers = sorted({p for p in peers if p != self.me})
        slot = None
        try:
            for jump in range(MAX_JUMPS + 1):
                ahead = self._ahead(step, peers, finished_too=jump > 0)  # after a jump: whatever _watch_ahead saw
                if ahead is not None and jump < MAX_JUMPS:
                    logger.info("sync barrier: replicas are at step %d, adopting it (we were at %d)", ahead, step)
                    step = ahead
                slot = await self._barrier(step, tensors, peers, may_jump=jump < MAX_JUMPS)
                if slot is not None:
                    break
        finally:
            if slot is not None and slot.own_part is not None:
                self._finished[step] = slot
                for old in sorted(self._finished)[:-FINISHED_KEPT]:
                    del self._finished[old]
            for key in [k for k in self.exchange.slots if k <= step]:
                self.exchange.close(key)
                self._opened_by.pop(key, None)
            self.last_step = step
        assert slot is not None
        missing = [p for p in peers if p not in slot.contributions]
        if missing:
            self.metrics.inc("sync_average_incomplete")
            logger.warning("step %d: averaged without %d of %d replicas (%s)", step, len(missing), len(peers) + 1,
                           short_id(missing[0]))
        # only the replicas the caller's (validated) view announces on this stage count, and through the same
        # robust aggregate as the asynchronous rounds: a stranger's or an outlying gradient is not averaged in
        members = {p: v[:-1] for p, v in slot.contributions.items() if p in peers}
        for peer in slot.contributions.keys() - members.keys():
            self.metrics.inc("rejected:avg_not_member")
            logger.debug("step %d: part of %s ignored: not an announced replica of this stage", step, short_id(peer))
        assert slot.own_values is not None  # our part was published before the barrier could complete
        own = slot.own_values[:-1]
        if digest is not None and members:
            digests = {p: slot.contributions[p][-1] for p in members}
            digests[self.me] = slot.own_values[-1]
            self.fork = fork_of(self.me, digests, [t.numel() for t in own], self.config.sync_digest_rtol)
            if self.fork is not None:
                self.metrics.inc("sync_fork_detected")
                logger.warning("step %d: our weights differ from those of %d of %d replicas; loading %s's state",
                               step, self.fork.agreeing, len(digests), short_id(self.fork.donor))
        # the textbook baseline averages gradients exactly: outliers dropped, the plain mean of the rest
        mean, dropped = await asyncio.get_running_loop().run_in_executor(
            None, lambda: barrier_mean(self.me, own, members, self._averaging,
                                       outlier_factor=self.config.outlier_factor, outlier_rms=self.config.outlier_rms))
        for peer in dropped:
            if peer == self.me:  # every replica steps with the others' mean, ours as well: no fork
                self.metrics.inc("avg_self_outlier")
                logger.info("step %d: our gradient was far from the replicas'; stepping with their mean", step)
                continue
            self.metrics.inc("rejected:avg_outlier")
            logger.debug("step %d: part of %s dropped: far from the robust centre", step, short_id(peer))
        if self.vouch is not None:
            for peer in members:
                if peer not in dropped:
                    self.vouch(peer)
        return [m.reshape(s) for m, s in zip(mean, shapes, strict=True)], len(members) + 1 - len(dropped)

    async def _barrier(self, step: int, tensors: list[torch.Tensor], peers: list[str], *,
                       may_jump: bool) -> Slot | None:
        """Run the barrier of ``step``; None when a replica in our view turned out to wait at a later step."""
        slot = self.exchange.open(step, self.clock() + self.config.sync_timeout_s)
        slot.deadline = self.clock() + self.config.sync_timeout_s
        if slot.own_part is None:
            await self.exchange.publish(slot, tensors)
        barrier = asyncio.create_task(exchange_all(self.exchange, slot, self.me, peers, self.clock(),
                                                   self.config.sync_grace_s, self.config.sync_timeout_s))
        watch = asyncio.create_task(self._watch_ahead(step, peers)) if may_jump else None
        tasks = {barrier} if watch is None else {barrier, watch}
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return slot if barrier in done else None

    async def _watch_ahead(self, step: int, peers: list[str]) -> None:
        """Return when the barrier of ``step`` should be left for a later one: at once when the replicas waiting there
        skipped ``step`` (we are behind), after ``AHEAD_HOLD_S`` when some finished it with us (its missing parts
        had that long to come: a replica that skipped it and waits ahead, a joiner, would never send its part)."""
        since: float | None = None
        while self._ahead(step, peers) is None:
            if self._ahead(step, peers, finished_too=True) is None:
                since = None
            elif since is None:
                since = self.clock()
            elif self.clock() - since >= AHEAD_HOLD_S:
                return
            await asyncio.sleep(0.05)


class FlushClock:
    """A later stage's view of the synchronous mode's flushes: which gradient barrier to run, and when.

    Stage 0 numbers its flushes and every training forward carries the number. Stage 0 starts flush ``f`` only when
    every gradient of flush ``f - 1`` came back, so once flush ``f`` has begun, every backward of ``f - 1`` on every
    later stage is done. A replica of a later stage closes flush ``f`` (runs barrier ``f`` and steps) at the first of:

    * its share of the flush is done (``on_drained``: the M-th backward of ``f`` here; the pipeline pins each replica
      to one of stage 0's pipelines, so a replica sees M micro-batches per flush). The last stage drains first, so its
      barrier overlaps the earlier stages' backwards, as GPipe's per-stage all-reduces do;
    * a forward of ``f + 1`` reaches it (``on_forward``: a drop or a refused micro-batch left it short of M);
    * another replica of its stage opens barrier ``f`` with it (``on_remote_barrier``: routing sent the flush
      elsewhere; it joins with whatever it accumulated, a zero gradient at worst, so that its partners do not wait
      for it and all replicas take the same step).

    Every replica keys the barrier by stage 0's number, so retried hops, re-routed micro-batches or missed flushes
    cannot shift one replica off the others (docs/performance.md, "The synchronous baseline stalled (fixed)").
    """

    def __init__(self) -> None:
        self.current: int | None = None  # the flush whose gradient this replica is accumulating
        self.closed: int | None = None  # the last flush whose barrier this replica ran or runs

    def _close(self, flush: int) -> int | None:
        if self.closed is not None and flush <= self.closed:
            return None
        self.closed = flush
        return flush

    def on_forward(self, flush: int) -> int | None:
        """The barrier to run before computing a training forward of ``flush``, or None."""
        if self.current is None:
            self.current = flush  # the first flush we see: nothing of ours to close yet
            return None
        if flush <= self.current:  # this flush, or a retried hop of an earlier one: its gradient joins this flush
            return None
        self.current = flush
        return self._close(flush - 1)

    def on_drained(self, flush: int) -> int | None:
        """This replica finished its share (M backwards) of ``flush``: the barrier to run now, or None."""
        if self.current is not None and flush < self.current:
            return None  # a late micro-batch of a flush closed already
        self.current = flush
        return self._close(flush)

    def on_remote_barrier(self, step: int) -> int | None:
        """Another replica opened barrier ``step`` (flush ``step`` is over): the barrier to join, or None."""
        if self.current is not None and step < self.current:
            return None  # closed already, or a stale part
        self.current = max(self.current if self.current is not None else step, step + 1)
        return self._close(step)
