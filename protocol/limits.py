"""Receiver limits for RPC streams and the per-peer byte budgets that enforce them.

Every number a stranger could use to make us read, buffer or wait lives in `RpcLimits`; `PeerBudgets` is a token
bucket per peer id so one peer cannot take more than its share of our download; `InflightLedger` charges buffered
request bytes per peer as they arrive, with a small allowance for strangers (peers that have not yet done useful work
for us) and a pool all strangers share, so a flood of new identities cannot take the memory the known peers need.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable

from protocol.errors import RateLimited

__all__ = ["RpcLimits", "PeerBudgets", "InflightLedger"]

MiB = 2**20


@dataclasses.dataclass(frozen=True, kw_only=True)
class RpcLimits:
    """Sizes, budgets and timeouts of one RPC endpoint (both sides use them: the server to refuse, the client to
    frame its requests and bound replies). Defaults fit activations of a few MiB and 64 MiB state chunks."""

    #: largest frame body accepted; bigger announcements are refused before their body is read
    max_frame_bytes: int = 4 * MiB
    #: frame body size used when sending (must not exceed the receiver's max_frame_bytes)
    send_frame_bytes: int = 1 * MiB
    #: largest whole message (all frames, headers included) accepted in one request or reply
    max_message_bytes: int = 256 * MiB
    #: sustained bytes per second one peer may send us; beyond it requests get RATE_LIMITED
    per_peer_bytes_per_s: float = 128 * MiB
    #: burst one peer may send at once (None: max_message_bytes, so one maximal message always fits a full bucket)
    per_peer_burst_bytes: int | None = None
    #: concurrent request streams one peer may hold open at this server; more get a Busy reply
    max_streams_per_peer: int = 16
    #: request bytes buffered across all peers at once; beyond it new frames get a Busy reply (bounds our memory)
    max_inflight_bytes: int = 1024 * MiB
    #: seconds a peer has to deliver a whole request once its stream opened
    read_timeout_s: float = 60.0
    #: seconds a handler may run before the caller gets TIMEOUT
    handler_timeout_s: float = 120.0
    #: seconds to write a reply before giving up on the caller
    write_timeout_s: float = 60.0
    #: seconds the server keeps draining a refused request after replying, so the reply is not reset in flight
    linger_s: float = 2.0
    #: retry_after_s sent in Busy replies when the server itself is saturated
    busy_retry_s: float = 1.0
    #: slowest a request may arrive on average, bytes/s, after rate_grace_s (a stream that stalls is cut)
    min_bytes_per_s: float = 32 * 1024
    #: seconds a request stream may go without meeting min_bytes_per_s (latency, slow start)
    rate_grace_s: float = 5.0
    #: request bytes one stranger (a peer not yet vouched for) may have buffered at once
    stranger_inflight_bytes: int = 16 * MiB
    #: request bytes all strangers together may have buffered at once (the rest is kept for known peers)
    strangers_inflight_bytes: int = 256 * MiB
    #: concurrent request streams one stranger may hold open
    stranger_streams: int = 4
    #: refused streams per second one stranger may cause (burst: twice as many); once it has used them up, its next
    #: streams are closed unread and unanswered until the budget refills (requests that succeed cost nothing)
    stranger_refusals_per_s: float = 20.0
    #: refused streams per second all strangers together may cause (burst: as many), likewise
    strangers_refusals_per_s: float = 200.0
    #: a stranger that used up its refusals is banned this long (doubling while it keeps coming back, up to
    #: stranger_max_ban_s); a banned stranger's streams are held unread and unanswered (protocol/gate.py)
    stranger_ban_s: float = 10.0
    stranger_max_ban_s: float = 300.0
    #: longest a banned stranger's stream is held before it is closed (0: closed at once)
    banned_hold_s: float = 60.0
    #: streams of banned strangers held at once (beyond it they are closed at once; also at most 1/8 of the file
    #: descriptors this process may open)
    max_held_streams: int = 512
    #: a request at least this large asks to keep its stream for the next request to the same peer and handler (a
    #: fresh stream's flow-control window starts at 256 KiB and grows per round trip: docs/performance.md, "One
    #: message over the emulated WAN"); 0 (the default here): never. A peer sets it from ``keep_stream_min_bytes``
    #: (256 KiB by default)
    keep_min_bytes: int = 0
    #: seconds a kept stream waits for its next request (the caller reuses it only while it idled for less than half)
    keep_idle_s: float = 30.0
    #: idle kept streams one known peer may hold here (strangers: none), and all peers together
    kept_streams_per_peer: int = 4
    max_kept_streams: int = 256

    def __post_init__(self) -> None:
        for name in ("max_frame_bytes", "send_frame_bytes", "max_message_bytes", "max_streams_per_peer",
                     "max_inflight_bytes", "stranger_inflight_bytes", "strangers_inflight_bytes",
                     "stranger_streams", "max_held_streams", "kept_streams_per_peer", "max_kept_streams"):  # fmt: skip
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"RpcLimits.{name} must be a positive int, got {value!r}")
        for name in ("per_peer_bytes_per_s", "read_timeout_s", "handler_timeout_s", "write_timeout_s",
                     "min_bytes_per_s", "rate_grace_s", "stranger_refusals_per_s", "strangers_refusals_per_s",
                     "stranger_ban_s", "keep_idle_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RpcLimits.{name} must be > 0, got {getattr(self, name)!r}")
        if type(self.keep_min_bytes) is not int or self.keep_min_bytes < 0:
            raise ValueError(f"RpcLimits.keep_min_bytes must be an int >= 0, got {self.keep_min_bytes!r}")
        if self.busy_retry_s < 0 or self.linger_s < 0 or self.banned_hold_s < 0:
            raise ValueError("RpcLimits.busy_retry_s, linger_s and banned_hold_s must be >= 0")
        if self.stranger_max_ban_s < self.stranger_ban_s:
            raise ValueError("RpcLimits.stranger_max_ban_s must be >= stranger_ban_s")
        if self.send_frame_bytes > self.max_frame_bytes:
            raise ValueError("RpcLimits.send_frame_bytes must not exceed max_frame_bytes (peers would refuse frames)")
        if self.max_frame_bytes > self.max_message_bytes:
            raise ValueError("RpcLimits.max_frame_bytes must not exceed max_message_bytes")
        if self.per_peer_burst_bytes is not None and self.per_peer_burst_bytes < self.max_frame_bytes:
            raise ValueError("RpcLimits.per_peer_burst_bytes must be None or >= max_frame_bytes (or no frame fits)")

    @property
    def burst_bytes(self) -> int:
        return self.per_peer_burst_bytes if self.per_peer_burst_bytes is not None else self.max_message_bytes


class PeerBudgets:
    """Token bucket of bytes per peer: `rate` bytes/s refill up to `burst`; `take` raises RateLimited when empty.

    Remembers at most `max_peers` peers (least recently seen are forgotten, which only ever favours them).
    """

    def __init__(
        self, rate: float, burst: int, *, max_peers: int = 4096, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate, self.burst, self.max_peers, self._clock = rate, burst, max_peers, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # peer -> (tokens, last refill time)

    def empty(self, peer: str) -> bool:
        """Whether ``peer`` has less than one token now (nothing is taken)."""
        tokens, last = self._buckets.get(peer, (float(self.burst), self._clock()))
        return min(float(self.burst), tokens + (self._clock() - last) * self.rate) < 1.0

    def spend(self, peer: str, n: int = 1) -> None:
        """Take up to ``n`` tokens, never below zero and never raising (a charge for what already happened)."""
        try:
            self.take(peer, n)
        except RateLimited:
            self._buckets[peer] = (0.0, self._clock())

    def take(self, peer: str, n: int) -> None:
        now = self._clock()
        tokens, last = self._buckets.pop(peer, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        if n > tokens:
            self._buckets[peer] = (tokens, now)
            wait = (n - tokens) / self.rate
            raise RateLimited(f"peer {peer} exceeded its budget of {self.rate:.0f} B/s; retry in {wait:.1f} s")
        self._buckets[peer] = (tokens - n, now)
        while len(self._buckets) > self.max_peers:
            self._buckets.popitem(last=False)


class InflightLedger:
    """Request bytes buffered right now, per peer and in total, charged as they arrive.

    ``charge(peer, n, allowance=...)`` raises ``OverflowError`` naming the exhausted limit: the server's total, a
    stranger's own allowance (None: a known peer, no own limit), or the pool all strangers share. ``release`` returns
    bytes when a request is done with.
    """

    def __init__(self, limits: RpcLimits) -> None:
        self.limits = limits
        self.total = 0
        self.strangers = 0
        self.by_peer: dict[str, int] = {}

    def charge(self, peer: str, n: int, *, allowance: int | None) -> None:
        lim = self.limits
        if self.total + n > lim.max_inflight_bytes:
            raise OverflowError(f"{self.total} request bytes already buffered")
        mine = self.by_peer.get(peer, 0)
        if allowance is not None:
            if mine + n > allowance:
                raise OverflowError(f"a new peer may buffer at most {allowance} bytes")
            if self.strangers + n > lim.strangers_inflight_bytes:
                raise OverflowError(f"new peers already buffer {self.strangers} bytes")
            self.strangers += n
        self.total += n
        self.by_peer[peer] = mine + n

    def release(self, peer: str, n: int, *, stranger_bytes: int) -> None:
        """Give back ``n`` bytes of ``peer``, of which ``stranger_bytes`` were charged while it was a stranger."""
        self.total -= n
        self.strangers -= stranger_bytes
        left = self.by_peer.get(peer, 0) - n
        if left > 0:
            self.by_peer[peer] = left
        else:
            self.by_peer.pop(peer, None)
