"""Keyed exchange of tensor parts between same-stage peers: the transport under the averaging loops.

One ``PartExchange`` serves one RPC name; each *slot* (an averaging round, or a synchronous step) holds our part and
the validated parts others sent under the same key. A call is symmetric (the request carries the caller's part, the
reply the callee's), and the smaller id calls first, so each pair exchanges a slice once. Everything received is
validated before it is kept (run, stage, key, the sender equal to the authenticated libp2p id, exact shapes and dtype,
finite values, the slot owner's ``check``; ``member`` refuses non-members before decoding), and a refusal is an error
reply counted as ``rejected:avg_<reason>``. Our own values are quantised and decoded again locally, so peers holding
the same contributions compute bit-identical means. docs/design.md ("Data-parallel axis") and docs/protocol.md give
the timing and the wire format; ``keep_offers`` serves the red team's measurements only.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from protocol.codecs.registry import decode, encode
from protocol.envelope import TensorEnvelope
from protocol.errors import ErrorCode, FrameTooLarge, ProtocolError, RemoteError, StreamNotOpened
from protocol.messages import AveragingPart, Busy, Error, Message
from protocol.rpc import Transport
from protocol.validation import TensorSpec

if TYPE_CHECKING:
    from peer.ops.metrics import PeerMetrics

logger = logging.getLogger(__name__)


class Outcome(enum.Enum):
    """How one call of ``PartExchange.exchange`` ended (``exchange_all`` retries by it)."""

    OK = "ok"  # the peer's part came back, valid
    UNREACHED = "unreached"  # no stream could be opened: nothing was sent
    FAILED = "failed"  # sent, and no part came back: a stream reset, a timeout, the peer not ready or busy
    REFUSED = "refused"  # the peer refused our part, or we refused its

#: error codes of a reply that may change on a later call (the rest refuse the part for what it is or who sent it)
TRANSIENT_CODES = frozenset({ErrorCode.NOT_READY, ErrorCode.BUSY, ErrorCode.RATE_LIMITED, ErrorCode.TIMEOUT,
                             ErrorCode.INTERNAL})


class Refused(Exception):
    """A part that is refused with an error code (raised by ``admit`` hooks).

    ``reason`` is a short registered name (counted as ``rejected:avg_<reason>``, see peer/ops/names.py); ``detail``
    the sentence the sender reads. A counter name never carries the detail: it may hold a round number the sender
    chose, and every distinct name would be a counter kept for the peer's life.
    """

    def __init__(self, code: ErrorCode, reason: str, detail: str = "") -> None:
        super().__init__(detail or reason)
        self.code = code
        self.reason = reason


@dataclass
class Slot:
    """One round (or step) of exchange: our part, the parts received, and its deadline on ``clock``."""

    key: int
    deadline: float
    ready: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    own_part: AveragingPart | None = None
    own_values: list[torch.Tensor] | None = None
    contributions: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    senders: set[str] = field(default_factory=set)
    closed: bool = False
    offers: dict[str, AveragingPart] | None = None  # parts received before ours was set (kept by keep_offers only)


#: check(received, own) -> None if acceptable, else a short reason (becomes the counter rejected:avg_<reason>)
Check = Callable[[list[torch.Tensor], list[torch.Tensor]], str | None]


def relative_distance_check(max_rel: float, max_rms: float) -> Check:
    """Accept a tensor list whose L2 distance to ours is at most ``max_rel * |ours| + max_rms * sqrt(numel)``.

    The relative term bounds what one peer can move a large tensor; the absolute term lets zero-initialised tensors
    (biases) take part. Honest replicas of one stage stay far inside it: they start from the same seeded init and
    are pulled together by every round.
    """

    def check(received: list[torch.Tensor], own: list[torch.Tensor]) -> str | None:
        for r, o in zip(received, own, strict=True):
            bound = max_rel * float(o.norm()) + max_rms * math.sqrt(o.numel())
            if float((r - o).norm()) > bound:
                return "too_far"
        return None

    return check


def finite_norm_check(max_ratio: float, floor: float) -> Check:
    """Accept a tensor list whose norm is at most ``max_ratio`` times ours (or ``floor``): for gradients."""

    def check(received: list[torch.Tensor], own: list[torch.Tensor]) -> str | None:
        if not any(bool(o.any()) for o in own):
            # nothing of ours to compare with (a replica that got none of the flush joins with zeros): refusing
            # every partner would stall them to their timeout; the optimiser's clip still bounds the step
            return None
        for r, o in zip(received, own, strict=True):
            if float(r.norm()) > max(max_ratio * float(o.norm()), floor):
                return "too_large"
        return None

    return check


def _reason(e: Exception) -> str:
    """Counter suffix for a decode failure: shape, dtype, payload (codec/length) or nonfinite (NaN, Inf)."""
    field = getattr(e, "field", "") or ""
    kind = field.rsplit(".", 1)[-1] if "." in field else "nonfinite"
    return {"shape": "shape", "dtype": "dtype", "codec": "payload", "data": "payload"}.get(kind, "nonfinite")


class PartExchange:
    """Slots of one RPC name; see the module docstring.

    Args:
        transport: RPC layer. name: RPC handler name. run_id, stage, me: identity checked on every part.
        codec: wire codec of the parts (run.compression.averaging, or 'none' for exact sums).
        check: owner's validation of a decoded part against our own values.
        admit: called with (key, sender) for a part whose slot does not exist yet; returns the slot (possibly still
            opening) or raises Refused. Lets the asynchronous loop open a round on demand and the synchronous barrier
            wait for its step.
        metrics: PeerMetrics (counters). clock: time source of slot deadlines (unix time).
        member: async fn(sender) -> whether the sender may take part at all (None: anyone who passes the checks).
        keep_offers: keep the raw parts that arrive before our own part is set (``Slot.offers``); off for an honest
            peer (peer.averaging.behaviour).
    """

    def __init__(self, *, transport: Transport, name: str, run_id: str, stage: int, me: str, codec: str,
                 check: Check, admit: Callable[[int, str], Slot], metrics: PeerMetrics,
                 clock: Callable[[], float] = time.time,
                 member: Callable[[str], Awaitable[bool]] | None = None, keep_offers: bool = False) -> None:
        self.transport, self.name, self.run_id, self.stage, self.me = transport, name, run_id, stage, me
        self.codec, self.check, self.admit, self.metrics, self.clock = codec, check, admit, metrics, clock
        self.member = member
        self.slots: dict[int, Slot] = {}
        self.keep_offers = keep_offers

    async def register(self) -> None:
        await self.transport.add_handler(self.name, self._handle)

    def open(self, key: int, deadline: float) -> Slot:
        """The slot for ``key``, created if new (its own part still unset)."""
        slot = self.slots.get(key)
        if slot is None:
            slot = self.slots[key] = Slot(key=key, deadline=deadline, offers={} if self.keep_offers else None)
        return slot

    async def publish(self, slot: Slot, values: list[torch.Tensor]) -> None:
        """Set our part: encode with the codec and decode back (off the event loop), then wake waiting handlers."""
        loop = asyncio.get_running_loop()
        envelopes, own = await loop.run_in_executor(None, self._quantize, values)
        slot.own_values = own
        slot.own_part = AveragingPart(run_id=self.run_id, stage=self.stage, round_no=slot.key, sender=self.me,
                                      tensors=envelopes, weight=1.0)
        if not slot.ready.done():
            slot.ready.set_result(None)

    def fail(self, slot: Slot, reason: str) -> None:
        """Opening the slot failed (e.g. the worker refused): waiting handlers answer NOT_READY."""
        if not slot.ready.done():
            slot.ready.set_exception(Refused(ErrorCode.NOT_READY, reason))
            slot.ready.exception()  # mark retrieved: nobody may be waiting

    def close(self, key: int) -> Slot | None:
        slot = self.slots.pop(key, None)
        if slot is not None:
            slot.closed = True
            self.fail(slot, "slot_closed")
        return slot

    def _quantize(self, values: list[torch.Tensor]) -> tuple[list[TensorEnvelope], list[torch.Tensor]]:
        flat = [v.detach().reshape(-1).float().contiguous() for v in values]
        envelopes = [encode(v, self.codec) for v in flat]
        own = [decode(e, TensorSpec(shape=tuple(v.shape), dtype=v.dtype), peer="self") for e, v in
               zip(envelopes, flat, strict=True)]
        return envelopes, own

    def decode_offers(self, offers: dict[str, AveragingPart],
                      like: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
        """Of ``offers`` (a copy of a slot's: handlers add to it on the event loop), those that decode to the shapes
        of ``like``, by sender; the rest are skipped. Nothing is accepted or counted: the slot's checks run when our
        part is set."""
        out = {}
        for peer, msg in offers.items():
            try:
                out[peer] = self._decode(msg, peer, like)
            except Refused:
                continue
        return out

    # ---- receiving ---------------------------------------------------------------------------------------------
    def _validate(self, msg: AveragingPart, peer: str, slot: Slot) -> list[torch.Tensor]:
        """Decode and check a part against our own values; raises Refused(BAD_REQUEST, reason)."""
        own = slot.own_values
        assert own is not None
        values = self._decode(msg, peer, own)
        reason = self.check(values, own)
        if reason is not None:
            raise Refused(ErrorCode.BAD_REQUEST, reason)
        return values

    def _decode(self, msg: AveragingPart, peer: str, own: list[torch.Tensor]) -> list[torch.Tensor]:
        """A part's tensors, exactly of ``own``'s shapes and dtype and finite; raises Refused(BAD_REQUEST, reason)."""
        if msg.sender != peer:
            raise Refused(ErrorCode.BAD_REQUEST, "sender_mismatch")
        if len(msg.tensors) != len(own):
            raise Refused(ErrorCode.BAD_REQUEST, "tensor_count")
        values = []
        for j, (env, o) in enumerate(zip(msg.tensors, own, strict=True)):
            try:
                t = decode(env, TensorSpec(shape=tuple(o.shape), dtype=o.dtype), peer=peer, field=f"tensors[{j}]")
            except ProtocolError as e:
                raise Refused(ErrorCode.BAD_REQUEST, _reason(e)) from e
            if t.shape != o.shape or t.dtype != o.dtype:
                raise Refused(ErrorCode.BAD_REQUEST, "shape")
            if not bool(torch.isfinite(t).all()):
                raise Refused(ErrorCode.BAD_REQUEST, "nonfinite")
            values.append(t)
        return values

    def _identity_error(self, msg: Message, key: int | None = None) -> Refused | None:
        if not isinstance(msg, AveragingPart):
            return Refused(ErrorCode.BAD_REQUEST, "not_a_part")
        if msg.run_id != self.run_id:
            return Refused(ErrorCode.WRONG_RUN, "wrong_run")
        if msg.stage != self.stage:
            return Refused(ErrorCode.WRONG_STAGE, "wrong_stage")
        if key is not None and msg.round_no != key:
            return Refused(ErrorCode.BAD_REQUEST, "wrong_round")
        return None

    async def _accept(self, msg: AveragingPart, peer: str, slot: Slot) -> None:
        loop = asyncio.get_running_loop()
        values = await loop.run_in_executor(None, self._validate, msg, peer, slot)
        if slot.closed:
            raise Refused(ErrorCode.NOT_READY, "closed")
        if peer not in slot.contributions:
            slot.contributions[peer] = values
            slot.arrived.set()

    def _reject(self, err: Refused, peer: str, key: object) -> None:
        self.metrics.inc(f"rejected:avg_{err.reason}")
        logger.debug("refused %s part from %s for key %s: %s", self.name, peer, key, err)

    async def _handle(self, msg: Message, peer: str) -> Message:
        err = self._identity_error(msg)
        if err is not None:
            self._reject(err, peer, getattr(msg, "round_no", "?"))
            return Error(code=err.code, message=f"{self.name}: {err}")
        assert isinstance(msg, AveragingPart)  # _identity_error refused everything else
        try:
            if self.member is not None and not await self.member(peer):
                raise Refused(ErrorCode.UNAUTHORIZED, "not_member")
            slot = self.slots.get(msg.round_no) or self.admit(msg.round_no, peer)
            timeout = slot.deadline - self.clock()
            if timeout <= 0:
                raise Refused(ErrorCode.NOT_READY, "closed")
            slot.senders.add(peer)  # the slot's owner waits for this peer's part too, even if it did not know it
            if slot.offers is not None and not slot.ready.done():
                slot.offers.setdefault(peer, msg)
                slot.arrived.set()
            await asyncio.wait_for(asyncio.shield(slot.ready), timeout)
            await self._accept(msg, peer, slot)
        except Refused as e:
            if e.code != ErrorCode.NOT_READY:
                self._reject(e, peer, msg.round_no)
                known = self.slots.get(msg.round_no)
                if known is not None and peer not in known.contributions:
                    known.senders.discard(peer)
                    known.arrived.set()  # whoever waits for this sender's part stops waiting
            return Error(code=e.code, message=f"{self.name} key {msg.round_no}: {e}")
        except TimeoutError:
            return Error(code=ErrorCode.NOT_READY, message=f"{self.name} key {msg.round_no}: not open in time")
        assert slot.own_part is not None  # slot.ready is set by publish(), after our part
        return slot.own_part

    # ---- sending -----------------------------------------------------------------------------------------------
    async def exchange(self, slot: Slot, peer: str, timeout: float) -> Outcome:
        """Send our part to ``peer`` and keep its reply if valid; on failure (logged, counted) how it failed
        (``Outcome``)."""
        assert slot.own_part is not None, "publish() before exchange()"
        timeout = min(timeout, slot.deadline - self.clock())
        if timeout <= 0:
            return Outcome.FAILED
        try:
            reply = await self.transport.call(peer, self.name, slot.own_part, timeout=timeout)
        except RemoteError as e:
            logger.debug("%s with %s for key %d: peer answered %s", self.name, peer, slot.key, e)
            self.metrics.inc("avg_exchange_refused")
            return Outcome.FAILED if e.code in TRANSIENT_CODES else Outcome.REFUSED
        except StreamNotOpened as e:
            logger.debug("%s with %s for key %d: no stream: %r", self.name, peer, slot.key, e)
            self.metrics.inc("avg_exchange_failed")
            return Outcome.UNREACHED
        except FrameTooLarge as e:  # our part or its reply exceeds the limits: no later call does better
            logger.debug("%s with %s for key %d: %r", self.name, peer, slot.key, e)
            self.metrics.inc("avg_exchange_failed")
            return Outcome.REFUSED
        except (TimeoutError, ProtocolError, ConnectionError, OSError) as e:
            logger.debug("%s with %s for key %d failed: %r", self.name, peer, slot.key, e)
            self.metrics.inc("avg_exchange_failed")
            return Outcome.FAILED
        except Exception as e:  # a broken peer must cost one exchange, never the loop
            logger.debug("%s with %s for key %d failed unexpectedly: %r", self.name, peer, slot.key, e)
            self.metrics.inc("avg_exchange_failed")
            return Outcome.FAILED
        if isinstance(reply, Busy):
            self.metrics.inc("avg_exchange_busy")
            return Outcome.FAILED
        if isinstance(reply, Error):
            self.metrics.inc("avg_exchange_refused")
            return Outcome.FAILED if reply.code in TRANSIENT_CODES else Outcome.REFUSED
        err = self._identity_error(reply, slot.key)
        try:
            if err is not None:
                raise err
            assert isinstance(reply, AveragingPart)  # _identity_error refused everything else
            await self._accept(reply, peer, slot)
        except Refused as e:
            if e.code != ErrorCode.NOT_READY:
                self._reject(e, peer, slot.key)
                return Outcome.REFUSED
            return Outcome.FAILED
        return Outcome.OK


EXCHANGE_BACKOFF_S = 0.2
EXCHANGE_BACKOFF_MAX_S = 2.0
EXCHANGE_SENDS = 6
EXCHANGE_REFUSALS = 3
EXCHANGE_REFUSED_WAIT_S = 2.5


async def exchange_all(exchange: PartExchange, slot: Slot, me: str, peers: list[str], window_start: float,
                       grace_s: float, call_timeout_s: float) -> None:
    """Exchange with ``peers`` until each has given a part or the slot's deadline passes.

    The smaller id calls at once; the larger waits ``grace_s`` after ``window_start`` for that call and then calls
    itself. A call that fails is retried with backoff (0.2 s doubling to at most ``EXCHANGE_BACKOFF_MAX_S``) while
    the slot is open and that peer's part has not arrived otherwise: without the retry, one reset stream left both
    sides waiting for the other's call until the deadline. How often depends on what the failure cost: a call that
    could not open a stream sent nothing and is retried until the deadline (with three calls at most, a first barrier
    that met connections still being dialled waited out its 60 s); a call that sent the part and got none back (a
    reset, a timeout, a peer not ready or busy) counts towards ``EXCHANGE_SENDS`` sends per peer and slot, as each
    sends the whole part again; a refusal (of our part by the peer, or of its part by us) towards
    ``EXCHANGE_REFUSALS`` of them, each at least ``EXCHANGE_REFUSED_WAIT_S`` after the last, so that a peer whose
    view of the stage lags (it re-reads it every 2 s) can admit us meanwhile. Returns early once every peer has
    contributed.
    """

    async def with_peer(peer: str) -> None:
        if peer < me:
            delay = window_start + grace_s - exchange.clock()
            if delay > 0:
                try:
                    await asyncio.wait_for(_contributed(slot, peer), delay)
                    return
                except TimeoutError:
                    pass
        attempt = sends = refusals = 0
        while peer not in slot.contributions and not slot.closed:
            outcome = await exchange.exchange(slot, peer, call_timeout_s)
            if outcome == Outcome.OK:
                return
            sends += outcome != Outcome.UNREACHED
            refusals += outcome == Outcome.REFUSED
            backoff = min(EXCHANGE_BACKOFF_S * 2 ** min(attempt, 4), EXCHANGE_BACKOFF_MAX_S)
            if outcome == Outcome.REFUSED:
                backoff = max(backoff, EXCHANGE_REFUSED_WAIT_S)
            attempt += 1
            if sends >= EXCHANGE_SENDS or refusals >= EXCHANGE_REFUSALS or slot.deadline - exchange.clock() <= backoff:
                return
            try:  # the peer's own call may deliver its part meanwhile
                await asyncio.wait_for(_contributed(slot, peer), backoff)
                return
            except TimeoutError:
                pass

    peers = sorted({*peers, *slot.senders} - {me})
    await asyncio.gather(*(with_peer(p) for p in peers))
    remaining = slot.deadline - exchange.clock()
    if remaining > 0:
        try:
            await asyncio.wait_for(_all_contributed(slot, peers), remaining)
        except TimeoutError:
            pass


async def _contributed(slot: Slot, peer: str) -> None:
    while peer not in slot.contributions:
        slot.arrived.clear()
        await slot.arrived.wait()


async def _all_contributed(slot: Slot, peers: Iterable[str]) -> None:
    """Until every peer in ``peers`` and every peer that has sent us a part since has contributed."""
    while True:
        waiting = ({*peers} | slot.senders) - set(slot.contributions)
        if not waiting:
            return
        slot.arrived.clear()
        await slot.arrived.wait()
