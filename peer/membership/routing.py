"""Choosing the next hop: weighted random over announced throughput, observed latency and queue depth, with bans.

Every sender picks a peer of the next stage at random with probability proportional to 1 / (expected time to be
served): ``latency + (queue + 1) / rate``, where ``rate`` is the peer's announced micro-batches per second and
``latency`` our moving average of its round trips (SWARM's stochastic wiring). Load spreads in proportion to
capacity, and a slow or far peer still gets some traffic so its estimate stays fresh. A peer that fails is banned
with exponential backoff; a peer that answers Busy is skipped for the time it asked for.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from peer.membership.records import PeerRecord

DEFAULT_LATENCY_S = 0.05
LATENCY_EMA = 0.2


class NoRouteError(RuntimeError):
    """No peer of the wanted stage is known and unbanned."""


@dataclass
class HopStats:
    """What we observed of one remote peer."""

    latency_s: float = DEFAULT_LATENCY_S
    failures: int = 0
    banned_until: float = 0.0


class Router:
    """Per-peer observations and the weighted choice. Lives on the event loop; not thread-safe."""

    def __init__(self, costs: list[float], *, ban_base_s: float = 2.0, ban_max_s: float = 60.0,
                 rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.costs = costs
        self.ban_base_s, self.ban_max_s = ban_base_s, ban_max_s
        self.rng = rng or random.Random()
        self.clock = clock
        self.stats: dict[str, HopStats] = {}

    def _stats(self, peer_id: str) -> HopStats:
        return self.stats.setdefault(peer_id, HopStats())

    def weight(self, record: PeerRecord) -> float:
        """1 / expected seconds until this peer has served one more micro-batch."""
        st = self.stats.get(record.peer_id) or HopStats()
        rate = record.throughput / self.costs[record.stage] if record.throughput > 0 else 1.0
        return 1.0 / (st.latency_s + (record.queue + 1) / rate)

    def candidates(self, records: Iterable[PeerRecord], stage: int, *,
                   exclude: Iterable[str] = ()) -> list[PeerRecord]:
        now, excluded = self.clock(), set(exclude)
        return [r for r in records if r.stage == stage and r.state == "training" and r.peer_id not in excluded
                and self._stats(r.peer_id).banned_until <= now]

    def choose(self, records: Iterable[PeerRecord], stage: int, *, exclude: Iterable[str] = ()) -> PeerRecord:
        """Weighted random choice among unbanned training peers of ``stage``; raises NoRouteError if none."""
        cands = self.candidates(records, stage, exclude=exclude)
        if not cands:
            raise NoRouteError(f"no reachable peer serves stage {stage}")
        weights = [self.weight(r) for r in cands]
        return self.rng.choices(cands, weights=weights, k=1)[0]

    def success(self, peer_id: str, latency_s: float) -> None:
        st = self._stats(peer_id)
        st.latency_s = (1 - LATENCY_EMA) * st.latency_s + LATENCY_EMA * max(latency_s, 0.0)
        st.failures = 0

    def failure(self, peer_id: str) -> float:
        """Ban a peer that failed; returns the ban in seconds (doubling per consecutive failure)."""
        st = self._stats(peer_id)
        st.failures += 1
        ban = min(self.ban_base_s * 2 ** (st.failures - 1), self.ban_max_s)
        st.banned_until = self.clock() + ban
        return ban

    def busy(self, peer_id: str, retry_after_s: float) -> None:
        """A peer said Busy: skip it for the time it asked (bounded), without counting a failure."""
        st = self._stats(peer_id)
        st.banned_until = self.clock() + min(max(retry_after_s, 0.0), self.ban_max_s)

    def is_banned(self, peer_id: str) -> bool:
        return self._stats(peer_id).banned_until > self.clock()

    def forget(self, keep: Iterable[str]) -> None:
        """Drop stats of peers no longer in the swarm (bounded memory)."""
        alive = set(keep)
        for pid in [p for p in self.stats if p not in alive]:
            del self.stats[pid]
