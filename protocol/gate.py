"""Bans of flooding strangers, and the streams of banned strangers held unread instead of closed.

Why: a stranger that has used up its budget of refusals (``RpcLimits.stranger_refusals_per_s``) is sending nothing
we will serve. Closing its streams at once is what it wants: an attacker that reopens each stream when it is cut
(tools/redteam.py's ``budget_flood``) then cycles ~1,500 streams per second through our libp2p daemon (~0.2 ms of
its CPU per stream) and our event loop (~0.1 ms per stream), on cores the honest pipeline needs. hivemind's p2pd
1.1.12 has no connection gater and no per-peer stream limit, and its only per-peer lever, disconnecting, does not
help (the stranger's daemon redials at once: the flood ran at 1,670 streams/s with a disconnect per second against
1,470 without). So the cheapest answer left is to stop answering: a banned stranger's streams are neither read nor
answered nor closed, but held until its ban ends (at most ``hold_s``), so a stranger that waits for our answer
waits. A bounded number of streams is held (per stranger and in all, so holding cannot exhaust our file
descriptors); beyond that they are closed at once, which costs what it cost before. Bans double for a stranger that
is banned again soon after its last ban (up to ``max_ban_s``); known peers are never banned (the server does not
ask).

The gate is pure bookkeeping with an injectable clock, so its rules are unit-tested without sockets
(tests/test_protocol_gate.py); ``protocol/rpc.py`` consults it before it reads anything of a stranger's stream.
"""

from __future__ import annotations

import resource
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

from protocol.limits import RpcLimits

__all__ = ["FloodGate"]


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
