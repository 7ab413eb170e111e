"""Bans of flooding strangers, and the streams of banned strangers held unread instead of closed.

Why: a stranger that has used up its budget of refusals (``RpcLimits.stranger_refusals_per_s``) is sending nothing
we will serve. Closing its streams at once is what it wants: an attacker that reopens each stream when it is cut
(tools/redteam.py's ``budget_flood``) then cycles 1,000-2,000 streams per second through our libp2p daemon (~0.2 ms
of its CPU per stream) and our event loop (0.03-0.07 ms per stream), on cores the honest pipeline needs. hivemind's
p2pd 1.1.12 has no connection gater and no per-peer stream limit, and its only per-peer lever, disconnecting, does
not help (the stranger's daemon redials at once: a flood ran at 1,670 streams/s with a disconnect per second and
identity, against 1,470 without). So the cheapest answer left is to stop answering: a banned stranger's streams are
neither read nor answered nor closed, but held until its ban ends (at most ``hold_s``), so a stranger that waits
for our answer waits (24 streams/s instead of 2,200-2,400 in the same benchmark). A bounded number of streams is
held (per stranger and in all, so holding cannot exhaust our file descriptors); beyond that they are closed at once,
which costs what it cost before. Bans double for a stranger that is banned again soon after its last ban (up to
``max_ban_s``); known peers are never banned.

``StrangerGate`` is what an RpcServer asks about every stream before anything of it is read (protocol/inbound.py
calls it): the refusal budgets, the bans and the streams each peer has open. Both are bookkeeping without sockets
(``FloodGate`` with an injectable clock), unit-tested in tests/test_protocol_gate.py.
"""

from __future__ import annotations

import logging
import resource
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

from protocol.limits import PeerBudgets, RpcLimits

__all__ = ["FloodGate", "StrangerGate"]

logger = logging.getLogger(__name__)


class FloodGate:
    """Per-identity bans with escalation, and the hold slots for a banned identity's streams.

    Args:
        ban_s: the first ban of an identity; each ban that starts within ``2 * max_ban_s`` of the end of the last one
            doubles, up to ``max_ban_s``; an identity quiet for longer starts again at ``ban_s``.
        hold_s: longest time one stream of a banned identity is held (never past its ban's end).
        max_held: streams held at once over all identities; ``max_held_per_peer`` of one identity.
        max_peers: identities remembered (the least recently banned are forgotten first, which only favours them).
    """

    def __init__(self, *, ban_s: float, max_ban_s: float, hold_s: float, max_held: int, max_held_per_peer: int,
                 max_peers: int = 4096, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < ban_s <= max_ban_s:
            raise ValueError(f"need 0 < ban_s <= max_ban_s, got {ban_s!r}, {max_ban_s!r}")
        if hold_s < 0 or max_held < 0 or max_held_per_peer < 0:
            raise ValueError("hold_s, max_held and max_held_per_peer must be >= 0")
        self.ban_s, self.max_ban_s, self.hold_s = ban_s, max_ban_s, hold_s
        self.max_held, self.max_held_per_peer, self.max_peers = max_held, max_held_per_peer, max_peers
        self._clock = clock
        self._bans: OrderedDict[str, tuple[float, float]] = OrderedDict()  # peer -> (banned until, last duration)
        self._held: Counter[str] = Counter()
        self.held = 0  # streams held right now
        self.bans = 0  # bans imposed so far

    @classmethod
    def from_limits(cls, limits: RpcLimits) -> FloodGate:
        """The gate of an RpcServer: ``limits``' ban and hold settings, at most 1/8 of our file descriptors held."""
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        held = limits.max_held_streams if nofile == resource.RLIM_INFINITY else min(limits.max_held_streams,
                                                                                      nofile // 8)
        return cls(ban_s=limits.stranger_ban_s, max_ban_s=limits.stranger_max_ban_s, hold_s=limits.banned_hold_s,
                   max_held=held, max_held_per_peer=limits.max_streams_per_peer)

    def banned_for(self, peer: str) -> float:
        """Seconds left of ``peer``'s ban (0.0: not banned)."""
        entry = self._bans.get(peer)
        return max(0.0, entry[0] - self._clock()) if entry is not None else 0.0

    def ban(self, peer: str) -> float:
        """Ban ``peer`` (it used up its refusals) and return the ban's length in seconds."""
        now = self._clock()
        until, last = self._bans.pop(peer, (float("-inf"), 0.0))
        if until > now:  # already banned: unchanged
            self._bans[peer] = (until, last)
            return until - now
        recent = last > 0 and now - until <= 2 * self.max_ban_s
        duration = min(self.max_ban_s, 2 * last) if recent else self.ban_s
        self._bans[peer] = (now + duration, duration)
        self.bans += 1
        while len(self._bans) > self.max_peers:
            self._bans.popitem(last=False)
        return duration

    def unban(self, peer: str) -> None:
        """Forget ``peer``'s bans (it became a known peer)."""
        self._bans.pop(peer, None)

    def hold(self, peer: str) -> float:
        """Take a hold slot for one stream of banned ``peer``: the seconds to hold it, or 0.0 when there is no slot
        (or no ban) and the stream is to be closed at once. Every positive answer must be paired with ``release``."""
        left = min(self.banned_for(peer), self.hold_s)
        if left <= 0 or self.held >= self.max_held or self._held[peer] >= self.max_held_per_peer:
            return 0.0
        self._held[peer] += 1
        self.held += 1
        return left

    def release(self, peer: str) -> None:
        """Give back the hold slot of one of ``peer``'s streams."""
        self.held -= 1
        self._held[peer] -= 1
        if self._held[peer] <= 0:
            del self._held[peer]


class StrangerGate:
    """What the sender of a stream may cost us, decided before anything of the stream is read.

    ``early(peer)`` is the verdict: None serves the stream, 0.0 closes it unread, > 0 holds it unread that many
    seconds (a stranger that used up its refusals is banned, and held while the ban lasts). A served stream counts
    as open until ``done(peer)``; one that arrived while the peer had its share open (``stranger_streams``, or
    ``max_streams_per_peer`` for a known peer) is to be answered Busy: ``over(peer)`` says so once per such stream,
    and a stranger was charged that refusal as it arrived, so a burst is judged as it arrives, not once its tasks
    ran. ``refused(peer)`` charges a stranger a refusal found later (too large, malformed, too slow...).
    """

    def __init__(self, limits: RpcLimits, *, is_known: Callable[[str], bool], rejected: Counter[str]) -> None:
        self.limits, self.is_known, self.rejected = limits, is_known, rejected
        per_s, all_per_s = limits.stranger_refusals_per_s, limits.strangers_refusals_per_s
        self.refusals = PeerBudgets(per_s, max(1, int(2 * per_s)))  # per stranger
        self.all_refusals = PeerBudgets(all_per_s, max(1, int(all_per_s)))  # all strangers together, under ""
        self.flood = FloodGate.from_limits(limits)
        self.streams: Counter[str] = Counter()  # streams past the gate and not yet done, per peer
        self._over: Counter[str] = Counter()  # of those, how many arrived over the peer's share

    def early(self, peer: str) -> float | None:
        if self.is_known(peer):
            self._count(peer, known=True)
            return None
        flood = self.flood
        if flood.banned_for(peer) or self.refusals.empty(peer):
            if not flood.banned_for(peer):
                logger.debug("banning %s for %.0f s: it used up its refusals", peer, flood.ban(peer))
            self.rejected["banned"] += 1
            return flood.hold(peer)  # 0.0 when no hold slot is free: closed at once
        if self.all_refusals.empty(""):  # strangers together keep being refused: no read, no reply until they slow;
            self.rejected["flood"] += 1  # and that counts as a refusal of this one, or a flooder among many identities
            self.refusals.spend(peer)  # would never use up its own and never be banned
            return 0.0
        self._count(peer, known=False)
        return None

    def _count(self, peer: str, *, known: bool) -> None:
        lim = self.limits
        if self.streams[peer] >= (lim.max_streams_per_peer if known else min(lim.stranger_streams,
                                                                               lim.max_streams_per_peer)):
            self._over[peer] += 1
            if not known:
                self.refused(peer)
        self.streams[peer] += 1

    def over(self, peer: str) -> bool:
        """Whether this stream of ``peer`` is to be answered Busy (it had its share of streams open)."""
        if not self._over[peer]:
            return False
        self._over[peer] -= 1
        return True

    def refused(self, peer: str) -> None:
        """Charge stranger ``peer`` one refusal, and all strangers together one."""
        self.refusals.spend(peer)
        self.all_refusals.spend("")

    def done(self, peer: str) -> None:
        """One of ``peer``'s streams that passed the gate is done with."""
        self.streams[peer] -= 1
        if self.streams[peer] <= 0:
            del self.streams[peer]
            self._over.pop(peer, None)
