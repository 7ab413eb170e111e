"""A stage's sends to its neighbours: activations to a peer of the next stage, gradients back to the previous one.

``Hops`` picks the next hop with the ``Router`` (among the swarm's training peers; in sync mode the one replica a
flush is pinned to), retries a failing or busy hop elsewhere, and records every outcome in the Router (latency,
busy, failure), which is what routing and banning learn from. It keeps no micro-batch: what was sent where is the
servicer's (``peer.pipeline.servicer``).

A refusal of our tensors as out of bounds (``ErrorCode.OUT_OF_BOUNDS``: their norm is far from what the receiver has
been taking) judges our work, not the receiver. While another replica of that stage took our work in the last
``OUT_OF_BOUNDS_PEERS_S`` the refuser is the odd one out and counts a failure (banned with backoff, as before); while
none did, our own weights are what is off (a replica that started from the init beside replicas that trained, and
catches up through averaging), so the refuser is only skipped for ``OUT_OF_BOUNDS_WAIT_S``: banning every replica of
the next stage for longer and longer would starve this peer for good once its work fits again. After
``OUT_OF_BOUNDS_WARN_S`` of such refusals and no work taken the operator is told.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from peer.config import Mode
from peer.ids import short_id
from peer.lifecycle import PeerState
from peer.membership.routing import NoRouteError
from peer.pipeline.attest import sign
from protocol.errors import ErrorCode, RemoteError
from protocol.messages import Ack, Backward, Busy, Forward, Message

if TYPE_CHECKING:
    from peer.config import PeerConfig
    from peer.membership.records import PeerRecord
    from peer.membership.routing import Router
    from peer.ops.metrics import PeerMetrics
    from peer.pipeline.attest import Notary
    from peer.seams import Send
    from protocol.envelope import TensorEnvelope

logger = logging.getLogger(__name__)

FORWARD_RPC = "forward"
"""The handler that takes a ``Forward`` (activations for this stage)."""
BACKWARD_RPC = "backward"
"""The handler that takes a ``Backward`` (the gradient of a micro-batch this stage sent on)."""
NO_ROUTE_WARN_AFTER = 8  # waits for a route (backoff 0.1, 0.2, 0.4, then 0.8 s) before warning the operator
MAX_ROUTE_WAITS = 50  # waits for a route before a forward is given up (its micro-batch is dropped)
PARTNER_TRIES = 3  # sends of a spot-checked micro-batch to its second replica while that one answers Busy
OUT_OF_BOUNDS_PEERS_S = 10.0  # a refuser of our tensors as out of bounds is at fault while another replica of its
# stage took our work this recently
OUT_OF_BOUNDS_WAIT_S = 1.0  # else it is skipped this long, without a failure (our work is what is off)
OUT_OF_BOUNDS_WARN_S = 20.0  # refusals as out of bounds with nothing taken this long: the operator is told
ACKED_MAX = 256  # next-stage peers whose last Ack is remembered (the oldest forgotten first)

#: ``cap(peer_ids, weights)`` lowers routing weights (the share of hops not yet trusted: peer.pipeline.spotcheck)
Cap = Callable[[list[str], list[float]], list[float]]


class Hops:
    """The sends of the stage ``stage`` served by ``my_id``.

    Args:
        run_id: the run every message names.
        send: ``await send(peer_id, name, msg)``, one RPC with the configured timeout; returns the reply.
        swarm: the latest validated DHT snapshot.
        router: the next-hop choice, told every outcome.
        accepting: False once the stage drains: a forward then stops waiting for a route that may never come.
        notary: signs the training gradients a stage from 2 on returns (``peer.pipeline.attest``; None: unsigned).
    """

    def __init__(self, *, run_id: str, stage: int, my_id: str, cfg: PeerConfig, send: Send,
                 swarm: Callable[[], dict[str, PeerRecord]], router: Router, metrics: PeerMetrics,
                 accepting: Callable[[], bool], notary: Notary | None = None) -> None:
        self.run_id, self.stage, self.my_id, self.cfg, self.send = run_id, stage, my_id, cfg, send
        self.swarm, self.router, self.metrics, self.accepting = swarm, router, metrics, accepting
        self.notary = notary
        self.cap: Cap | None = None
        """Set when spot checks run: the share of choices a hop not yet trusted may get."""
        self.clock: Callable[[], float] = time.monotonic
        self._acked: dict[str, float] = {}  # next-stage peer -> when it last took a forward of ours
        self._out_of_bounds_since: float | None = None  # first refusal as out of bounds since work was last taken

    def next_hops(self, stage: int) -> list[PeerRecord]:
        """Candidates for a hop to ``stage``. Sync mode pins pipeline i to the i-th replica (by peer id) of every
        stage, so each replica of a stage receives exactly the M micro-batches of one flush."""
        records = [r for r in self.swarm().values() if r.state == PeerState.TRAINING]
        if self.cfg.mode != Mode.SYNC:
            return records
        mine = sorted(r.peer_id for r in records if r.stage == self.stage) or [self.my_id]
        rank = mine.index(self.my_id) if self.my_id in mine else 0
        nxt = sorted((r for r in records if r.stage == stage), key=lambda r: r.peer_id)
        return [nxt[rank % len(nxt)]] if nxt else []

    def next_down(self) -> bool:
        """Whether the next stage cannot take work for a while (``Router.down``: none of its peers announced, or all
        banned for failing)."""
        return self.router.down(self.next_hops(self.stage + 1), self.stage + 1)

    async def forward(self, msg: Forward, sent_to: set[str]) -> str | None:
        """Send ``msg`` to a peer of the next stage that acknowledges it, retrying elsewhere; returns that peer, or
        None when none did (``hop_retries`` failures, or no route for a while). Every peer tried joins ``sent_to``
        before its send: its gradient may arrive before its Ack."""
        stage = self.stage + 1
        tried: set[str] = set()
        failures, waits = 0, 0
        while failures < self.cfg.hop_retries and waits < MAX_ROUTE_WAITS:
            try:
                record = self.router.choose(self.next_hops(stage), stage, exclude=tried, cap=self.cap)
            except NoRouteError:
                if not self.accepting():  # draining: do not wait for a route to appear
                    break
                if self.stage > 0 and self.next_down():  # a later stage holding the micro-batch while its next
                    # stage is gone would be judged a black hole upstream: dropped now, upstream told, its sample
                    # re-sent by stage 0 (which waits for the route itself)
                    break
                waits += 1
                if waits == NO_ROUTE_WARN_AFTER:  # ~4 s without a route: tell the operator what the peer waits for
                    self.metrics.warn(f"no reachable peer serves stage {stage} (none announced, or all failed "
                                      f"recently); waiting, samples are re-queued: start a peer with --stage {stage}",
                                      key=f"no_route:{stage}")
                await asyncio.sleep(min(0.05 * 2 ** min(waits, 4), 1.0))
                tried.clear()
                continue
            t0 = time.monotonic()
            sent_to.add(record.peer_id)
            try:
                with self.router.sending(record.peer_id):
                    reply = await self.send(record.peer_id, FORWARD_RPC, msg)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                failures += 1
                tried.add(record.peer_id)
                self.metrics.inc("retries")
                if _out_of_bounds(e):
                    self._refused_as_out_of_bounds(record.peer_id, stage)
                    continue
                ban = self.router.failure(record.peer_id)
                logger.debug("%s to %s failed (%r); banned for %.1f s", FORWARD_RPC, short_id(record.peer_id), e, ban)
                continue
            if isinstance(reply, Ack):
                self.router.success(record.peer_id, time.monotonic() - t0)
                self.metrics.resolve(f"no_route:{stage}")  # a route exists again: the warning is no longer true
                self._taken(record.peer_id)
                return record.peer_id
            if isinstance(reply, Busy):
                self.router.busy(record.peer_id, reply.retry_after_s)
                self.metrics.inc("busy_received")
                continue
            failures += 1
            tried.add(record.peer_id)
            self.router.failure(record.peer_id)
            self.metrics.inc("retries")
        return None

    def _taken(self, peer: str) -> None:
        """``peer`` of the next stage took a forward of ours."""
        self._acked.pop(peer, None)
        self._acked[peer] = self.clock()
        while len(self._acked) > ACKED_MAX:
            del self._acked[next(iter(self._acked))]
        if self._out_of_bounds_since is not None:
            self._out_of_bounds_since = None
            self.metrics.resolve("out_of_bounds")

    def _refused_as_out_of_bounds(self, peer: str, stage: int) -> None:
        """``peer`` refused our activations as out of bounds: a failure of it while another replica of its stage takes
        our work, else our own weights are off and it is only skipped for a moment (module docstring)."""
        now = self.clock()
        self.metrics.inc("forwards_out_of_bounds")
        if any(p != peer and now - t <= OUT_OF_BOUNDS_PEERS_S for p, t in self._acked.items()):
            ban = self.router.failure(peer)
            logger.debug("%s refused our activations as out of bounds while others take them; banned for %.1f s",
                         short_id(peer), ban)
            return
        self.router.busy(peer, OUT_OF_BOUNDS_WAIT_S)
        if self._out_of_bounds_since is None:
            self._out_of_bounds_since = now
        elif now - self._out_of_bounds_since >= OUT_OF_BOUNDS_WARN_S:
            self.metrics.warn(f"stage {stage} has refused this peer's activations as out of bounds for over "
                              f"{OUT_OF_BOUNDS_WARN_S:.0f} s (their norm is far from what its replicas "
                              "train on): this replica's weights are out of step with its stage's, and its averaging "
                              "rounds pull them back; if this lasts, restart the peer so that it loads a replica's "
                              "state", key="out_of_bounds")

    async def forward_to(self, peer: str, msg: Forward) -> Message | None:
        """Send ``msg`` to ``peer`` itself (a spot check's second replica), waiting out a few Busy replies; its last
        reply, or None when the call failed (the Router is told)."""
        reply: Message | None = None
        for _ in range(PARTNER_TRIES):
            try:
                with self.router.sending(peer):
                    reply = await self.send(peer, FORWARD_RPC, msg)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if _out_of_bounds(e):  # judged like the hop's own refusal: ours or the partner's fault
                    self._refused_as_out_of_bounds(peer, self.stage + 1)
                else:
                    self.router.failure(peer)
                return None
            if not isinstance(reply, Busy):
                break
            await asyncio.sleep(min(max(reply.retry_after_s, 0.0), 0.5))
        return reply

    def frame(self, peer: str, mb_id: int, route: list[str], env: TensorEnvelope | None, loss: float | None,
              is_eval: bool, *, refused: bool = False, downstream: tuple[list[str] | None, int | None] = (None, None),
              relayed: list[list[bytes]] | None = None, answers: bytes = b"") -> Backward:
        """The ``Backward`` for ``peer``: ``downstream``, the next-stage peers whose gradients this one was computed
        from and the id it sent the micro-batch to them under (``Backward.downstream``), ``relayed`` their signatures
        of those gradients; a training gradient of a stage from 2 on is signed, with ``answers``, the digest of the
        forward it answers (``peer.pipeline.attest``)."""
        msg = Backward(run_id=self.run_id, mb_id=mb_id, route=route, gradient=env, loss=loss, is_eval=is_eval,
                       refused=refused, downstream=downstream[0], downstream_id=downstream[1], relayed=relayed)
        if self.notary is not None and self.stage >= 2 and env is not None and not is_eval:
            msg = sign(self.notary, msg, self.my_id, peer, answers)
        return msg

    async def backward(self, peer: str | None, mb_id: int, route: list[str], env: TensorEnvelope | None,
                       loss: float | None, is_eval: bool, *, refused: bool = False) -> None:
        """Send a ``Backward`` without a training gradient to ``peer`` (a drop, a refusal, an evaluation's loss;
        None: nobody to tell)."""
        if peer is not None:
            await self.deliver(peer, self.frame(peer, mb_id, route, env, loss, is_eval, refused=refused))

    async def deliver(self, peer: str, msg: Backward) -> None:
        """Send ``msg`` to ``peer`` (the previous hop), twice at most: a lost one times the micro-batch out upstream,
        whose sample stage 0 re-sends."""
        for attempt in range(2):
            try:
                await self.send(peer, BACKWARD_RPC, msg)
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if _out_of_bounds(e):  # it judged our gradient, and would again: nothing to retry, nobody to ban
                    self.metrics.inc("backwards_out_of_bounds")
                    return
                logger.debug("backward of %d to %s failed (attempt %d): %r", msg.mb_id, short_id(peer), attempt + 1,
                             e)
                self.metrics.inc("retries")
        self.router.failure(peer)


def _out_of_bounds(e: BaseException) -> bool:
    """Whether ``e`` is a refusal of the tensors we sent as out of the receiver's bounds."""
    return isinstance(e, RemoteError) and e.code == ErrorCode.OUT_OF_BOUNDS
