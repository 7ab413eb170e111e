"""Request/response RPC over hivemind P2P binary streams, with our framing and limits.

One stream per call: the caller opens a libp2p stream to `asyncmesh.<name>`, writes one framed message, reads one
framed reply. The server checks every frame header against `RpcLimits` and the sender's byte budget before reading
its body, and *always* answers: a refused or failed request gets an `Error` (or `Busy`) reply as soon as the problem
is known, never silence. hivemind's own protobuf streams read a length with no bound and its unary calls drop
messages over ~4 MiB silently (docs/design.md), which is why this module exists.

    server = RpcServer(p2p, RpcLimits())
    await server.add_handler("forward", on_forward)          # async (msg, peer_id: str) -> Message
    reply = await call(p2p, peer_id, "forward", msg, timeout=10.0)   # raises RemoteError on Error replies
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from hivemind.p2p import P2P, PeerID

from protocol.errors import (
    ErrorCode,
    FrameTooLarge,
    PeerUnreachable,
    ProtocolError,
    RemoteError,
    StreamNotOpened,
    error_code_for,
)
from protocol.framing import HEADER, StreamEnded, read_message, write_message
from protocol.gate import StrangerGate
from protocol.inbound import InboundListener
from protocol.limits import InflightLedger, PeerBudgets, RpcLimits
from protocol.messages import Busy, Error, Message, pack, payload_bytes, unpack

__all__ = ["RpcServer", "RpcLimits", "call", "Handler", "HandlerTable", "Counting", "Caller", "Transport",
           "RpcTransport", "PROTOCOL_PREFIX"]

logger = logging.getLogger(__name__)

Handler = Callable[[Message, str], Awaitable[Message]]
Counting = Callable[[str, int], None]  # e.g. PeerMetrics.inc


class HandlerTable(Protocol):
    """Where services register their handlers: an ``RpcServer``, or a table that delegates to one (a peer's
    per-stage services re-bind theirs on a stage move). ``limits`` and ``count`` are the server's."""

    limits: RpcLimits
    count: Counting | None

    async def add_handler(self, name: str, fn: Handler) -> None: ...


#: messages with more payload bytes than this are (un)packed in the default executor, not on the event loop
OFFLOOP_BYTES = 1 << 20
#: libp2p protocol names are PROTOCOL_PREFIX + handler name (unversioned: versions are negotiated in messages)
PROTOCOL_PREFIX = "asyncmesh."


async def _pack(msg: Message) -> bytes:
    if payload_bytes(msg) < OFFLOOP_BYTES:
        return pack(msg)
    return await asyncio.get_running_loop().run_in_executor(None, pack, msg)


async def _unpack(data: bytes | bytearray) -> Message:
    if len(data) < OFFLOOP_BYTES:
        return unpack(data)
    return await asyncio.get_running_loop().run_in_executor(None, unpack, data)


class _Saturated(Exception):
    """Internal: this server has no room for the request right now; answered with Busy."""


class _TooManyStreams(_Saturated):
    """Internal: the sender had its share of streams open when this one arrived (the refusal was charged then)."""


#: peers remembered as known (vouched for); the least recently vouched are forgotten first
MAX_KNOWN_PEERS = 4096
#: seconds between two log lines about failing handlers (a stranger must not be able to grow our logs)
INTERNAL_LOG_EVERY_S = 60.0


class _NotAdmitted(Exception):
    """Internal: the sender failed the server's admission gate (a closed run); answered with UNAUTHORIZED."""


class _WrongKind(Exception):
    """Internal: a well-formed message of a kind this handler does not take; answered with BAD_REQUEST."""


@dataclasses.dataclass
class _Policy:
    """Per-handler limits set with ``RpcServer.restrict``: accepted message kinds and the largest request."""

    kinds: tuple[type[Message], ...] | None = None
    max_message_bytes: int | None = None


class RpcServer:
    """Serves named handlers on a hivemind P2P instance.

    Args:
        p2p: a started hivemind.P2P (e.g. `dht.replicate_p2p()` or `P2P.create()`).
        limits: sizes, budgets and timeouts; the defaults suit activations and 64 MiB state chunks.

        count: optional ``count(name, n)`` (e.g. a metrics object's ``inc``) told of every ``bytes_in`` /
            ``bytes_out`` the server reads and writes, so traffic shows up wherever the caller keeps its figures.

    `rejected` counts refused or failed requests by reason (the lower-case ErrorCode name, or 'busy'); `served`
    counts handled requests by handler name; `bytes_in` / `bytes_out` count payload bytes.

    Strangers: a peer is a stranger until ``vouch(peer_id)`` is called for it (the owner does so once it validated
    work of the peer: a trained gradient or micro-batch, an averaging part the aggregate kept; never for a reply,
    which anyone can send). Strangers get ``stranger_streams`` streams and
    ``stranger_inflight_bytes`` of buffer each, all together at most ``strangers_inflight_bytes``. Every request must
    arrive at ``min_bytes_per_s`` on average after ``rate_grace_s``, or its stream is cut. A stranger that used up its
    refusals is banned (``flood``, protocol/gate.py): its streams are held unread by our end of p2pd's streams
    (protocol/inbound.py) until the ban ends.
    """

    def __init__(self, p2p: P2P, limits: RpcLimits | None = None, *, count: Counting | None = None) -> None:
        self.p2p = p2p
        self.count = count
        self.limits = limits or RpcLimits()
        self.rejected: Counter[str] = Counter()
        self.served: Counter[str] = Counter()
        self.bytes_in = 0
        self.bytes_out = 0
        self._budgets = PeerBudgets(self.limits.per_peer_bytes_per_s, self.limits.burst_bytes)
        self._ledger = InflightLedger(self.limits)
        self._names: list[str] = []
        self._known: OrderedDict[str, None] = OrderedDict()
        self._policies: dict[str, _Policy] = {}
        self._last_internal_log = -INTERNAL_LOG_EVERY_S
        self.cut_slow = 0  # requests cut for arriving too slowly (also counted under rejected['timeout'])
        #: optional admission check of the authenticated sender (closed runs); False refuses with UNAUTHORIZED
        self.gate: Callable[[str], Awaitable[bool]] | None = None
        # what a stream's sender may cost, judged before anything of the stream is read: refusal budgets of strangers
        # (once spent, the streams are not read or answered), bans of those that used theirs up, streams per peer
        self.strangers = StrangerGate(self.limits, is_known=self.is_known, rejected=self.rejected)
        self.flood = self.strangers.flood
        # our own end of p2pd's streams: it asks the gate about each stream before a reader or a task exists for it
        self._inbound = InboundListener(p2p, early=self.strangers.early, released=self.flood.release)
        # kept streams waiting for their next request (see _serve): per peer, and their tasks (cancelled at shutdown)
        self._kept: Counter[str] = Counter()
        self._kept_waits: set[asyncio.Task[Any]] = set()

    @property
    def _inflight(self) -> int:
        return self._ledger.total

    def vouch(self, peer_id: str) -> None:
        """Treat ``peer_id`` as a known peer from now on (it did useful work for us): the full per-peer budgets."""
        self._known.pop(peer_id, None)
        self._known[peer_id] = None
        self.flood.unban(peer_id)
        while len(self._known) > MAX_KNOWN_PEERS:
            self._known.popitem(last=False)

    def revoke(self, peer_id: str) -> None:
        """``peer_id`` was caught doing bad work (fabricated gradients, work refused again and again): a stranger
        again, with a stranger's budgets and bans, until its validated work vouches for it anew."""
        self._known.pop(peer_id, None)

    def is_known(self, peer_id: str) -> bool:
        return peer_id in self._known

    def known_peers(self) -> list[str]:
        """The known peers, most recently vouched for last."""
        return list(self._known)

    def restrict(self, name: str, *, kinds: tuple[type[Message], ...] | None = None,
                 max_message_bytes: int | None = None) -> None:
        """Limit handler ``name``: requests of another message kind are refused as BAD_REQUEST before the handler
        runs, and requests larger than ``max_message_bytes`` are refused before they are read (e.g. a forward's
        size follows from the run's shapes). May be called before or after the handler is added."""
        policy = self._policies.setdefault(name, _Policy())
        if kinds is not None:
            policy.kinds = tuple(kinds)
        if max_message_bytes is not None:
            if max_message_bytes <= 0:
                raise ValueError(f"max_message_bytes must be positive, got {max_message_bytes}")
            policy.max_message_bytes = min(max_message_bytes, self.limits.max_message_bytes)

    async def add_handler(self, name: str, fn: Handler) -> None:
        """Serve `fn` under `name`; `fn(msg, peer_id)` returns the reply (an Error or Busy message is fine too)."""

        async def serve(proto: str, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._serve(name, fn, peer, reader, writer)

        await self._inbound.add(PROTOCOL_PREFIX + name, serve)
        self._names.append(name)

    async def shutdown(self) -> None:
        """Stop serving every handler this server added (streams in progress finish on their own; held streams of
        banned strangers are closed)."""
        await self._inbound.close()
        self._names.clear()
        for task in list(self._kept_waits):
            task.cancel()

    def _refusal(self, e: Exception) -> tuple[str, Message]:
        """The ``rejected`` reason and the reply for a request refused with ``e``."""
        if isinstance(e, _Saturated):
            return "busy", Busy(retry_after_s=self.limits.busy_retry_s)
        if isinstance(e, ProtocolError):
            code = error_code_for(e)
            return code.name.lower(), Error(code, str(e)[:4000])
        if isinstance(e, TimeoutError):
            return "timeout", Error(ErrorCode.TIMEOUT, str(e)[:4000])
        if isinstance(e, _NotAdmitted):
            return "unauthorized", Error(ErrorCode.UNAUTHORIZED, str(e)[:4000])
        return "wrong_kind", Error(ErrorCode.BAD_REQUEST, str(e)[:4000])

    async def _serve(
        self, name: str, fn: Handler, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Serve the stream's request, and while the caller asks to keep the stream (KEEP on its request) and the
        server agrees (KEEP on the reply), the next ones: a stream that carried a large message has a grown
        flow-control window, which a fresh one does not (``RpcLimits.keep_min_bytes``). Kept only for known peers,
        at most ``kept_streams_per_peer`` idle per peer and ``max_kept_streams`` in all, each for ``keep_idle_s``."""
        try:
            first: bytes | None = None
            while await self._serve_one(name, fn, peer, reader, writer, first):
                first = await self._next_request(peer, reader)
                if first is None:
                    return
        finally:
            writer.close()

    def _may_keep(self, peer: str) -> bool:
        lim = self.limits
        return self.is_known(peer) and self._kept[peer] < lim.kept_streams_per_peer and \
            sum(self._kept.values()) < lim.max_kept_streams

    async def _next_request(self, peer: str, reader: asyncio.StreamReader) -> bytes | None:
        """The first frame header of the next request on a kept stream, or None (idle too long, the caller hung up,
        or the peer is no longer known). The wait counts as a kept stream, not as a stream in flight."""
        task = asyncio.current_task()
        if task is not None:
            self._kept_waits.add(task)
        self._kept[peer] += 1
        try:
            async with asyncio.timeout(self.limits.keep_idle_s):
                head = await reader.readexactly(HEADER.size)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            return None
        finally:
            self._kept[peer] -= 1
            if self._kept[peer] <= 0:
                del self._kept[peer]
            if task is not None:
                self._kept_waits.discard(task)
        if not self.is_known(peer):  # revoked meanwhile: a stranger's request opens a stream of its own
            return None
        self.strangers.early(peer)  # counts the stream in flight, as the listener did for the first request
        return head

    async def _serve_one(
        self, name: str, fn: Handler, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
        first: bytes | None,
    ) -> bool:
        """One request of the stream (``first``: its first frame header, already read); whether the stream is kept
        for another."""
        limits = self.limits
        known = self.is_known(peer)  # (the stream passed the gate: self.strangers.early)
        policy = self._policies.get(name) or _Policy()
        max_message = policy.max_message_bytes or limits.max_message_bytes
        buffered = stranger_buffered = 0
        # a stranger may always have one whole request of this handler in flight (or it could never start working)
        allowance = None if known else max(limits.stranger_inflight_bytes, max_message)
        start = asyncio.get_running_loop().time()

        def admit(n: int) -> None:  # called per chunk, as the bytes arrive: announcing a size reserves nothing
            nonlocal buffered, stranger_buffered
            try:
                self._ledger.charge(peer, n, allowance=allowance)
            except OverflowError as e:
                raise _Saturated(str(e)) from None
            buffered += n
            if not known:
                stranger_buffered += n
            self._budgets.take(peer, n)

        def deadline(received: int) -> float:  # the minimum rate: a stalled or trickling stream is cut
            return start + limits.rate_grace_s + received / limits.min_bytes_per_s

        refused = False
        asked: list[bool] = []  # whether the request's last frame carried KEEP

        try:
            try:
                if self.gate is not None and not await self.gate(peer):
                    raise _NotAdmitted(f"peer {peer} is not admitted to this run")
                if self.strangers.over(peer):  # it had its share of streams open when one of these arrived
                    raise _TooManyStreams(f"peer {peer} already had its share of streams open")
                try:
                    async with asyncio.timeout(limits.read_timeout_s):
                        data = await read_message(
                            reader, max_frame_bytes=min(limits.max_frame_bytes, max_message),
                            max_message_bytes=max_message, admit=admit, deadline=deadline, kept=asked, first=first,
                        )  # fmt: skip
                except TimeoutError:
                    self.cut_slow += 1
                    raise TimeoutError(f"request not received in time (at least {limits.min_bytes_per_s:.0f} B/s "
                                       f"after {limits.rate_grace_s} s, at most {limits.read_timeout_s} s)") from None
                self.bytes_in += len(data)
                if self.count is not None:
                    self.count("bytes_in", len(data))
                msg = await _unpack(data)
                del data
                if policy.kinds is not None and not isinstance(msg, policy.kinds):
                    raise _WrongKind(f"{name} takes {'/'.join(k.__name__ for k in policy.kinds)}, "
                                     f"not {type(msg).__name__}")
                handler_deadline = asyncio.timeout(limits.handler_timeout_s)
                try:
                    async with handler_deadline:
                        reply = await fn(msg, peer)
                except TimeoutError:
                    if not handler_deadline.expired():
                        raise  # the handler's own timeout: an internal failure, reported as TIMEOUT all the same
                    raise TimeoutError(f"handler {name} took longer than {limits.handler_timeout_s} s") from None
                if not isinstance(reply, Message):
                    raise TypeError(f"handler {name} returned {type(reply).__name__}, not a protocol Message")
                self.served[name] += 1
            finally:
                self.strangers.done(peer)
                self._ledger.release(peer, buffered, stranger_bytes=stranger_buffered)
        except (_Saturated, ProtocolError, TimeoutError, _NotAdmitted, _WrongKind) as e:
            reason, reply = self._refusal(e)
            self.rejected[reason] += 1
            logger.debug("refused %s from %s (%s): %s", name, peer, reason, e)
            refused = not isinstance(e, _TooManyStreams)  # that one was charged at the gate
        except Exception as e:
            self.rejected["internal"] += 1
            now = time.monotonic()
            if now - self._last_internal_log >= INTERNAL_LOG_EVERY_S:  # rate-limited: requests are a stranger's
                self._last_internal_log = now
                logger.warning("handler %s failed on a request from %s (%d failures so far; next report in %.0f s "
                               "at the earliest)", name, peer, self.rejected["internal"], INTERNAL_LOG_EVERY_S,
                               exc_info=True)
            else:
                logger.debug("handler %s failed on a request from %s: %r", name, peer, e)
            reply = Error(ErrorCode.INTERNAL, f"{type(e).__name__} in handler {name}"[:4000])
        if refused and not known:  # what a stranger may cost us in refusals before its streams go unread
            self.strangers.refused(peer)
        # kept only when the whole request was read (asked is filled at its last frame) and the peer is known
        keep = bool(asked and asked[0]) and self._may_keep(peer)
        try:
            payload = await _pack(reply)
            async with asyncio.timeout(limits.write_timeout_s):
                await write_message(writer, payload, frame_bytes=limits.send_frame_bytes, keep=keep)
                self.bytes_out += len(payload)
                if self.count is not None:
                    self.count("bytes_out", len(payload))
                # Never half-close: p2pd turns our half-close into a full close of the libp2p stream, its copy of
                # the caller's direction then fails and it *resets* the stream, and a reset that overtakes the
                # reply inside the caller's p2pd discards the reply (docs/protocol.md, "Lost replies"). The end
                # flag of the reply's last frame tells the caller the reply is complete; the caller hangs up.
            if keep:
                return True
            # A refused sender may still be writing its request. Closing now would reset the stream and could
            # destroy our reply in flight, so discard what arrives until the caller hangs up (bounded in time and
            # bytes; a caller reading our reply hangs up at once).
            with contextlib.suppress(TimeoutError, ConnectionError):
                async with asyncio.timeout(limits.linger_s):
                    discarded = 0
                    while discarded < limits.max_frame_bytes and (chunk := await reader.read(65536)):
                        discarded += len(chunk)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.rejected["reply_failed"] += 1
            logger.debug("could not reply to %s on %s: %s", peer, name, e)
        return False


class _StreamPool:
    """A caller's kept streams, per (peer, handler): reused for the next large request while they idled for less
    than half the server's ``keep_idle_s`` (the server closes them after it). Bounded per key and in all."""

    PER_KEY = 2
    TOTAL = 64

    def __init__(self) -> None:
        self.idle: OrderedDict[tuple[str, str], list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]]] = \
            OrderedDict()

    def take(self, key: tuple[str, str],
             max_idle_s: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        entries = self.idle.get(key)
        now = time.monotonic()
        while entries:
            reader, writer, since = entries.pop()
            if now - since < max_idle_s and not writer.is_closing() and not reader.at_eof():
                return reader, writer
            writer.close()
        self.idle.pop(key, None)
        return None

    def give(self, key: tuple[str, str], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        entries = self.idle.setdefault(key, [])
        self.idle.move_to_end(key)
        entries.append((reader, writer, time.monotonic()))
        while len(entries) > self.PER_KEY:
            entries.pop(0)[1].close()
        while sum(len(v) for v in self.idle.values()) > self.TOTAL:
            oldest = next(iter(self.idle))
            for _, w, _ in self.idle.pop(oldest):
                w.close()


_POOLS: weakref.WeakKeyDictionary[P2P, _StreamPool] = weakref.WeakKeyDictionary()


def _pool_of(p2p: P2P) -> _StreamPool:
    pool = _POOLS.get(p2p)
    if pool is None:
        pool = _POOLS[p2p] = _StreamPool()
    return pool


def _consume(task: asyncio.Task[Any]) -> None:
    """Retrieve a finished send task's exception: after the reply arrived, a failed send is expected, not news."""
    if not task.cancelled():
        task.exception()


async def call(
    p2p: P2P,
    peer_id: PeerID | str,
    name: str,
    msg: Message,
    *,
    timeout: float,
    limits: RpcLimits | None = None,
    count: Counting | None = None,
) -> Message:
    """Send `msg` to handler `name` of `peer_id` and return the reply.

    `count("bytes_out", n)` / `count("bytes_in", n)`, when given, is told of the request's and the reply's size.

    Raises RemoteError for Error replies, TimeoutError after `timeout` seconds in total, StreamNotOpened (a
    PeerUnreachable) when no stream can be opened (nothing was sent), PeerUnreachable when the stream ended before a
    complete reply, FrameTooLarge when `msg` exceeds our own max_message_bytes (nothing is sent), and other
    ProtocolErrors for bad replies. A Busy reply is returned, not raised: the caller decides where to retry.
    """
    limits = limits or RpcLimits()
    if isinstance(peer_id, str):
        peer_id = PeerID.from_base58(peer_id)
    data = await _pack(msg)
    n_frames = max(1, -(-len(data) // limits.send_frame_bytes))
    if len(data) + n_frames * HEADER.size > limits.max_message_bytes:
        raise FrameTooLarge(len(data), limits.max_message_bytes, f"{type(msg).__name__} request")
    # a large request asks to keep its stream: the next one to this peer's handler starts with a grown window
    keep = 0 < limits.keep_min_bytes <= len(data)
    pool, key = (_pool_of(p2p) if keep else None), (str(peer_id), name)
    async with asyncio.timeout(timeout):
        for attempt in range(2):
            stream = pool.take(key, limits.keep_idle_s / 2) if pool is not None and attempt == 0 else None
            reused = stream is not None
            if stream is None:
                try:
                    _, reader, writer = await p2p.call_binary_stream_handler(peer_id, PROTOCOL_PREFIX + name)
                except Exception as e:  # hivemind raises P2PDaemonError/P2PHandlerError/ConnectionError here
                    raise StreamNotOpened(f"cannot open stream {name!r} to {peer_id}: {e}") from e
            else:
                reader, writer = stream
            kept: list[bool] = []
            pooled = False
            try:
                # write and read at once: the server may refuse after the first header and reply while we still send
                sending = asyncio.create_task(write_message(writer, data, frame_bytes=limits.send_frame_bytes,
                                                            keep=keep))
                try:
                    reply_bytes = await read_message(
                        reader, max_frame_bytes=limits.max_frame_bytes, max_message_bytes=limits.max_message_bytes,
                        kept=kept,
                    )  # fmt: skip
                except StreamEnded as e:
                    if reused:  # the server closed the kept stream before it read this request: a fresh one
                        continue
                    raise PeerUnreachable(f"peer {peer_id} closed stream {name!r} without a complete reply: {e}") \
                        from e
                finally:
                    if sending.done():
                        _consume(sending)
                    else:
                        sending.cancel()
                        sending.add_done_callback(_consume)
                if pool is not None and kept and kept[0] and sending.done() and not sending.cancelled() \
                        and sending.exception() is None:
                    pool.give(key, reader, writer)
                    pooled = True
            finally:
                if not pooled:
                    writer.close()
            break
    if count is not None:
        count("bytes_out", len(data))
        count("bytes_in", len(reply_bytes))
    reply = await _unpack(reply_bytes)
    if isinstance(reply, Error):
        raise RemoteError(reply.code, reply.message)
    return reply


class Caller(Protocol):
    """What a client of other peers' handlers needs from the RPC layer: one call (a ``Transport`` is one)."""

    async def call(self, peer_id: str, name: str, msg: Message, *, timeout: float) -> Message: ...


class Transport(Caller, Protocol):
    """What a keyed exchange between peers needs from the RPC layer: ``RpcTransport`` in production, an in-memory
    one in unit tests."""

    async def add_handler(self, name: str, fn: Handler) -> None: ...


class RpcTransport:
    """``Transport`` over this module: handlers on a ``HandlerTable``, calls through ``call`` with its limits."""

    def __init__(self, p2p: P2P, rpc_server: HandlerTable | None, limits: RpcLimits | None = None) -> None:
        self.p2p, self.rpc_server = p2p, rpc_server
        self.limits = limits if limits is not None else getattr(rpc_server, "limits", None) or RpcLimits()
        self.count = getattr(rpc_server, "count", None)  # the server's traffic counter counts our calls too

    async def add_handler(self, name: str, fn: Handler) -> None:
        if self.rpc_server is None:
            raise RuntimeError(f"cannot serve {name!r}: this RpcTransport was made without a HandlerTable (it calls)")
        await self.rpc_server.add_handler(name, fn)

    async def call(self, peer_id: str, name: str, msg: Message, *, timeout: float) -> Message:
        # an answer is not vouched for here: a peer becomes known only through work its owner validated (an accepted
        # averaging part, a trained gradient), never by replying; anyone can reply
        return await call(self.p2p, peer_id, name, msg, timeout=timeout, limits=self.limits, count=self.count)
