"""Choosing the next hop: weighted random over what *we* measured of each peer, with bans.

A peer of the next stage is drawn with probability proportional to 1 / (expected time to be served):
``latency + service x (1 + outstanding / OUTSTANDING_SCALE)``, from our moving averages of its request round trips
and of the time from sending it a micro-batch to its gradient coming back, and the micro-batches it holds unanswered.
Measured, so a peer cannot buy traffic by announcing a high throughput: until a peer is measured its service time is
the median measured of the others, or, while nobody is, ``(queue + 1) / rate`` from its announcement with ``rate`` at
most ``ANNOUNCED_CAP`` times the median announced (SWARM's stochastic wiring, bounded). Load follows capacity, and a
slow or far peer still gets some traffic so its estimate stays fresh. A failing peer is banned with exponential
backoff, a Busy one skipped for the time it asked, and a black hole (``black_holes``: micro-batches unanswered for
``BLACKHOLE_RTTS`` of its own round trips, ``BLACKHOLE_UNMEASURED_S`` while it never answered) for the longest ban.
A hop that never answered holds at most ``UNANSWERED_MAX_OUTSTANDING`` of our micro-batches while another can take
them: otherwise a black hole collects every slot in flight one by one and stalls the stage for the whole wait. Its
ban starts at ``BLACKHOLE_NEWCOMER_BAN_S`` and doubles per verdict until it answers: an honest newcomer's first round
trip can outlast the wait, and one micro-batch per verdict is all a real black hole gets.

A hop's round trip covers every stage after it, and a hop whose own next stage died holds our micro-batches too, for
no fault of its own. So the black-hole wait grows with the stages after the hop (``BLACKHOLE_STAGE_S`` each: theirs
is judged, dropped and told upstream first), a hop whose call failed forfeits what it held at once (``lost``: a dead
peer answers nothing), and a stage can ask whether its next stage is ``down`` (every announced peer of it banned for
failing, none merely busy) to refuse work it could not send on instead of holding it.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from peer.lifecycle import PeerState
from peer.membership.records import PeerRecord

DEFAULT_LATENCY_S = 0.05
LATENCY_EMA = 0.2
SERVICE_EMA = 0.2
OUTSTANDING_SCALE = 4.0
ANNOUNCED_CAP = 2.0
BLACKHOLE_MIN_ITEMS = 3
BLACKHOLE_RTTS = 3.0
BLACKHOLE_MIN_S = 2.0  # floor of the black-hole wait once round trips are measured
BLACKHOLE_UNMEASURED_S = 10.0  # the wait while no round trip at all was measured (first micro-batches are slow)
BLACKHOLE_NEWCOMER_BAN_S = 5.0  # first ban of a hop that never answered and held its one micro-batch too long
BLACKHOLE_STAGE_S = 3.0  # added to the wait per stage after the hop: a later stage's own judgment (the floor plus the
# daemon's 1-s expiry tick) and its drop notice arrive first
UNANSWERED_MAX_OUTSTANDING = 1  # micro-batches a hop that never answered may hold while another hop can take them
MAX_OUTSTANDING = 4096
MAX_PENALISED = 4096  # banned peers absent from the swarm whose ban is remembered (forget)


class NoRouteError(RuntimeError):
    """No peer of the wanted stage is known and unbanned."""


@dataclass
class HopStats:
    """What we observed of one remote peer."""

    latency_s: float = DEFAULT_LATENCY_S
    failures: int = 0
    banned_until: float = 0.0
    service_s: float | None = None
    """Moving average of send -> gradient back, seconds (None until measured)."""
    outstanding: dict[int, float] = field(default_factory=dict)
    """Micro-batches it accepted and has not answered: id -> when sent."""
    busy_until: float = 0.0
    """It said Busy: skipped until then, without counting as failed."""
    penalty_until: float = 0.0
    """Caught returning fabricated work: out of our routing until then, restart or not."""
    tokens_seen: int = 0
    """The training tokens its record counted when we last looked (fewer later: it restarted)."""
    holes: int = 0
    """Black-hole verdicts since it last answered (the ban of a hop that never answered doubles with them)."""
    forfeit: list[int] = field(default_factory=list)
    """Micro-batches it held when it restarted: dropped at the next ``lost``."""
    sending: int = 0
    """Sends to it not yet acknowledged (several micro-batches may choose it during one round trip)."""
    last_return: float = 0.0
    restarts: int = 0
    """Views of its record that showed a restart (what it was told before may be forgotten)."""

    def until(self) -> float:
        """When it may be chosen again (bans, penalties and Busy skips)."""
        return max(self.banned_until, self.penalty_until, self.busy_until)

    def banned(self, now: float) -> bool:
        """Whether it is banned or penalised at ``now`` (a Busy skip is not a ban)."""
        return max(self.banned_until, self.penalty_until) > now


def _training(records: Iterable[PeerRecord], stage: int) -> Iterator[PeerRecord]:
    """The records of ``stage``'s peers that take micro-batches."""
    return (r for r in records if r.stage == stage and r.state == PeerState.TRAINING)


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

    def _measured_median(self) -> float | None:
        measured = [st.service_s for st in self.stats.values() if st.service_s is not None]
        return statistics.median(measured) if measured else None

    def weight(self, record: PeerRecord, *, announced_median: float | None = None,
               measured_median: float | None = None) -> float:
        """1 / expected seconds until this peer has served one more micro-batch (medians: see the module doc)."""
        st = self.stats.get(record.peer_id) or HopStats()
        service = st.service_s if st.service_s is not None else measured_median
        if service is None:
            rate = record.throughput / self.costs[record.stage] if record.throughput > 0 else 1.0
            if announced_median is not None and announced_median > 0:
                rate = min(rate, ANNOUNCED_CAP * announced_median)
            service = (record.queue + 1) / rate
        return 1.0 / (st.latency_s + service * (1.0 + len(st.outstanding) / OUTSTANDING_SCALE))

    def candidates(self, records: Iterable[PeerRecord], stage: int, *,
                   exclude: Iterable[str] = ()) -> list[PeerRecord]:
        now, excluded = self.clock(), set(exclude)
        return [r for r in _training(records, stage) if r.peer_id not in excluded
                and self._stats(r.peer_id).until() <= now]

    def down(self, records: Iterable[PeerRecord], stage: int) -> bool:
        """Whether no training peer of ``stage`` can take work for a while: none is announced, or every one is banned
        for failing or swallowing work (one that only said Busy will take work soon)."""
        now = self.clock()
        return not any(r.peer_id not in self.stats or not self.stats[r.peer_id].banned(now)
                       for r in _training(records, stage))

    def choose(self, records: Iterable[PeerRecord], stage: int, *, exclude: Iterable[str] = (),
               cap: Callable[[list[str], list[float]], list[float]] | None = None) -> PeerRecord:
        """Weighted random choice among unbanned training peers of ``stage``; raises NoRouteError if none.
        ``cap(peer_ids, weights)`` may lower weights (the share of hops not yet trusted: peer.pipeline.spotcheck)."""
        cands = self.candidates(records, stage, exclude=exclude)
        if not cands:
            raise NoRouteError(f"no reachable peer serves stage {stage}")
        cands = [r for r in cands if not self.unanswered_full(r.peer_id)] or cands
        rates = [r.throughput / self.costs[r.stage] for r in cands if r.throughput > 0]
        announced = statistics.median(rates) if rates else None
        measured = self._measured_median()
        weights = [self.weight(r, announced_median=announced, measured_median=measured) for r in cands]
        if cap is not None:
            weights = cap([r.peer_id for r in cands], weights)
        return self.rng.choices(cands, weights=weights, k=1)[0]

    def unanswered_full(self, peer_id: str) -> bool:
        """Whether ``peer_id`` never answered us and already holds (or is being sent) all the micro-batches such a
        hop may."""
        st = self.stats.get(peer_id)
        return st is not None and st.service_s is None and \
            len(st.outstanding) + st.sending >= UNANSWERED_MAX_OUTSTANDING

    @contextlib.contextmanager
    def sending(self, peer_id: str) -> Iterator[None]:
        """Around a send to ``peer_id``: it counts as held until acknowledged (``unanswered_full``)."""
        st = self._stats(peer_id)
        st.sending += 1
        try:
            yield
        finally:
            st.sending -= 1

    def sent(self, peer_id: str, mb_id: int) -> None:
        """``peer_id`` accepted micro-batch ``mb_id``: its gradient is now owed."""
        st = self._stats(peer_id)
        if len(st.outstanding) < MAX_OUTSTANDING:
            st.outstanding[mb_id] = self.clock()

    def returned(self, peer_id: str, mb_id: int) -> None:
        """``peer_id`` answered micro-batch ``mb_id`` (a gradient, or a drop notice): one round trip measured."""
        st = self._stats(peer_id)
        t = st.outstanding.pop(mb_id, None)
        now = self.clock()
        st.last_return = now
        st.holes = 0
        if t is not None:
            rtt = max(now - t, 0.0)
            st.service_s = rtt if st.service_s is None else (1 - SERVICE_EMA) * st.service_s + SERVICE_EMA * rtt

    def cancel(self, peer_id: str, mb_id: int) -> None:
        """We gave up on micro-batch ``mb_id`` (timeout, drop): ``peer_id`` no longer owes it."""
        st = self.stats.get(peer_id)
        if st is not None:
            st.outstanding.pop(mb_id, None)

    def _wait(self, st: HopStats, measured: float | None, later_stages: int) -> float:
        """How long ``st``'s peer may hold a micro-batch before it is judged (see ``black_holes``)."""
        if st.service_s is not None:
            wait = max(BLACKHOLE_RTTS * st.service_s, BLACKHOLE_MIN_S)
        else:  # never answered yet: its first round trips are slow (a deep pipeline warming up on a busy host), so it
            # is not judged by how fast the others answer
            wait = max(BLACKHOLE_RTTS * (measured or 0.0), BLACKHOLE_UNMEASURED_S)
        return wait + BLACKHOLE_STAGE_S * max(later_stages, 0)

    def lost(self, *, later_stages: int = 0, silent: bool = True) -> list[tuple[str, list[int]]]:
        """Peers that will not answer what they hold, with those micro-batches, forfeited (a gradient that comes back
        after all is ignored as late); the caller drops them and tells upstream. A peer is in the list when its last
        call failed (it is already banned for that), when it restarted (``observe``), or when it answered nothing
        for one ``BLACKHOLE_MIN_S`` longer than its black-hole wait while holding fewer micro-batches than that rule
        needs (banned as for a failure: with backoff, not for the longest ban, as a dead peer restarted under its
        identity must be routed to again soon; ``silent=False`` leaves that rule out)."""
        now, measured = self.clock(), self._measured_median()
        found = []
        for pid, st in self.stats.items():
            held = st.forfeit
            st.forfeit = []
            if st.failures > 0:
                held += list(st.outstanding)
            elif silent and st.service_s is not None and st.outstanding:
                quiet_s = self._wait(st, measured, later_stages) + BLACKHOLE_MIN_S
                if all(now - t > quiet_s and t > st.last_return for t in st.outstanding.values()):
                    held += list(st.outstanding)
                    self.failure(pid)
            for mb in held:
                st.outstanding.pop(mb, None)
            if held:
                found.append((pid, held))
        return found

    def black_holes(self, *, later_stages: int = 0) -> list[tuple[str, list[int]]]:
        """Peers that accepted work and answered none of it for several expected round trips: banned for the
        longest ban; returned with the micro-batches they hold, which the caller drops (and re-sends upstream).
        ``later_stages``: the stages after the hop; each adds ``BLACKHOLE_STAGE_S`` to the wait, so that a later
        stage judges its own next hop, drops and tells upstream first."""
        now, measured = self.clock(), self._measured_median()
        found = []
        for pid, st in self.stats.items():
            # a hop that never answered holds one micro-batch while others serve (UNANSWERED_MAX_OUTSTANDING), so that
            # one is enough to judge it by
            need = BLACKHOLE_MIN_ITEMS if st.service_s is not None else 1
            if len(st.outstanding) < need:
                continue
            wait = self._wait(st, measured, later_stages)
            overdue = [mb for mb, t in st.outstanding.items() if now - t > wait and t > st.last_return]
            if len(overdue) >= need:
                st.failures += 1
                st.holes += 1
                if st.service_s is None:  # one micro-batch of a hop that never answered: an honest newcomer's first
                    # round trip can be that slow, and the cap makes a real black hole cheap, so the ban starts short
                    # and doubles per verdict until the hop answers
                    ban = min(BLACKHOLE_NEWCOMER_BAN_S * 2 ** min(st.holes - 1, 16), self.ban_max_s)
                else:
                    ban = self.ban_max_s
                st.banned_until = now + ban
                for mb in overdue:
                    del st.outstanding[mb]
                found.append((pid, overdue))
        return found

    def observe(self, records: Iterable[PeerRecord]) -> None:
        """Look at the swarm's records: a peer that restarted (its record says it is joining or loading its state
        again, or counts fewer tokens than before) holds nothing of ours any more, and is judged afresh, as a
        newcomer: its bans for failing or swallowing work end (not those for fabricated work), it is measured again
        and capped at one micro-batch until it answers (``unanswered_full``), as a new identity would be."""
        for r in records:
            st = self.stats.get(r.peer_id)
            if st is None:
                continue
            restarted = r.state in (PeerState.JOINING, PeerState.LOADING_STATE) or r.tokens < st.tokens_seen
            st.tokens_seen = r.tokens
            st.restarts += restarted
            if restarted and (st.service_s is not None or st.outstanding or st.banned_until or st.failures):
                st.forfeit += list(st.outstanding)
                st.outstanding.clear()
                st.banned_until, st.failures, st.service_s = 0.0, 0, None

    def success(self, peer_id: str, latency_s: float) -> None:
        st = self._stats(peer_id)
        st.latency_s = (1 - LATENCY_EMA) * st.latency_s + LATENCY_EMA * max(latency_s, 0.0)
        st.failures = 0

    def failure(self, peer_id: str) -> float:
        """Ban a peer that failed; returns the ban in seconds (doubling per consecutive failure)."""
        st = self._stats(peer_id)
        st.failures += 1
        doubling: int = 2 ** (st.failures - 1)  # failures >= 1 here: an int
        ban = min(self.ban_base_s * doubling, self.ban_max_s)
        st.banned_until = self.clock() + ban
        return ban

    def restarts(self, peer_id: str) -> int:
        """How many views of ``peer_id``'s record showed it restarting (``observe``)."""
        st = self.stats.get(peer_id)
        return 0 if st is None else st.restarts

    def penalised(self, peer_id: str, seconds: float) -> bool:
        """Whether ``ban`` keeps ``peer_id`` out for at least ``seconds`` more."""
        st = self.stats.get(peer_id)
        return st is not None and st.penalty_until > self.clock() + seconds

    def ban(self, peer_id: str, seconds: float) -> None:
        """Keep ``peer_id`` out of our routing for ``seconds`` (caught returning fabricated work; a restart does not
        end it)."""
        st = self._stats(peer_id)
        st.failures += 1
        st.penalty_until = max(st.penalty_until, self.clock() + seconds)

    def busy(self, peer_id: str, retry_after_s: float) -> None:
        """A peer said Busy: skip it for the time it asked (bounded), without counting a failure."""
        st = self._stats(peer_id)
        st.busy_until = self.clock() + min(max(retry_after_s, 0.0), self.ban_max_s)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop stats of peers no longer in the swarm (bounded memory), except a ``ban`` still running: a peer banned
        for fabricated work must not clear it by letting its record lapse for a moment (at most ``MAX_PENALISED``
        such absent peers are kept, those whose ban ends last)."""
        alive, now = set(keep), self.clock()
        gone = [p for p in self.stats if p not in alive]
        for pid in gone:
            if self.stats[pid].penalty_until <= now:
                del self.stats[pid]
        kept = sorted((p for p in gone if p in self.stats), key=lambda p: self.stats[p].penalty_until)
        for pid in kept[:max(0, len(kept) - MAX_PENALISED)]:
            del self.stats[pid]
