"""Data-parallel averaging over the network: AsyncMesh sparse rounds in the background (``AveragingLoop``).

Rounds follow a shared wall clock (tick t is unix time ``t * period_s``, ``rounds_per_tick`` (J) slots a tick, slot j
starting j / J of a period after it, and the round number picks the partition, so replicas stepping at different
speeds agree on it without a message); a replica opens one round per ``round_steps`` local steps it owes. A round
exchanges the partition's values pairwise with the stage's announced peers (``peer.averaging.exchange``), combines
the validated parts robustly under a quorum (``peer.averaging.aggregate``) and applies the run's rule on the compute
thread. docs/design.md ("Data-parallel axis") gives the cadence, the quorum, who may take part and why not
hivemind's averager; ``--mode sync``'s blocking average is ``peer.averaging.sync``.

Interface for the daemon::

    loop = AveragingLoop(p2p=p2p, rpc_server=rpc_server, dht=dht, run=run, stage=stage,
                         worker_call=worker_call, metrics=metrics, config=NetAveragingConfig())
    await loop.start(); ...; await loop.stop()        # worker_call(fn) runs fn(worker) on the compute thread
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import torch

from peer.averaging.aggregate import quorum_of, robust_combine
from peer.averaging.behaviour import HONEST, AveragingBehaviour
from peer.averaging.config import NetAveragingConfig
from peer.averaging.exchange import (
    PartExchange,
    Refused,
    Slot,
    exchange_all,
    relative_distance_check,
)
from peer.lifecycle import PeerState
from peer.membership.records import fetch_swarm
from peer.seams import WorkerCall
from protocol.errors import ErrorCode
from protocol.rpc import HandlerTable, RpcTransport, Transport
from trainer.averaging import Placed
from trainer.config import RunConfig
from trainer.rules import rule_of, wagma_group, wagma_is_global, wagma_phase

if TYPE_CHECKING:
    from hivemind import DHT
    from hivemind.p2p import P2P

    from peer.membership.records import PeerRecord
    from peer.ops.metrics import PeerMetrics
    from trainer.worker import StageWorker

logger = logging.getLogger(__name__)
CADENCE_MIN_ROUNDS = 5  # rounds before the per-step fraction is compared with the run's
CADENCE_TOLERANCE = 0.5  # a per-step fraction below this share of the run's is reported (rounds open on ticks, so
# the tick's rounding alone costs up to one period per round)

AVG_RPC = "avg_part"
WINDOW_EMA = 0.2  # weight of the latest round in the exchange window's moving average
TAKEN_MEMORY = 256  # rounds remembered as taken, so that a late part cannot open one a second time


def round_start(key: int, period_s: float, per_tick: int = 1) -> float:
    """Unix time at which round ``key`` starts: slot j of tick t (key t x per_tick + j) starts j / per_tick of a period
    after the tick, so a tick's rounds are spread over it (with per_tick = 1, key and tick are one)."""
    return key * period_s / per_tick


def round_deadline(key: int, period_s: float, config: NetAveragingConfig, run_timeout_s: float,
                   window_s: float | None = None, per_tick: int = 1) -> float:
    """Unix time at which round ``key`` stops collecting parts (``window_s``: the measured window, see
    ``AveragingLoop.window_s``; None: the shortest, collect_fraction x period_s)."""
    window = config.collect_fraction * period_s if window_s is None else window_s
    return round_start(key, period_s, per_tick) + min(window, run_timeout_s)


def next_round(now: float, period_s: float, per_tick: int = 1) -> int:
    """The first round key that starts at or after ``now``."""
    return math.ceil(now * per_tick / period_s - 1e-9)


def admissible(key: int, now: float, period_s: float, config: NetAveragingConfig,
               run_timeout_s: float, window_s: float | None = None, per_tick: int = 1) -> str | None:
    """None if a part for round ``key`` may open it now, else why not ('stale_round' / 'future_round')."""
    if now >= round_deadline(key, period_s, config, run_timeout_s, window_s, per_tick):
        return "stale_round"
    if now < round_start(key, period_s, per_tick) - config.clock_skew_s:
        return "future_round"
    return None


def rounds_to_open(owed_steps: float, round_steps: int, per_tick: int) -> int:
    """Rounds a replica that owes ``owed_steps`` local steps of averaging opens at a tick (at most ``per_tick``)."""
    return max(0, min(per_tick, math.floor(owed_steps / round_steps + 1e-9)))


def wagma_partners(me: str, view: list[str], phase: int, group_size: int) -> list[str]:
    """WAGMA's rotating group over whoever is reachable: replicas are the sorted peer ids (ours included), and
    ``phase`` (trainer.rules.wagma_phase of the round) uses digit field ``phase mod L`` of their index
    (trainer.rules.wagma_group); peers with the same view compute the same disjoint groups, and the groups rotate so
    information mixes in L phases."""
    members = sorted({*view, me})
    group = wagma_group(members.index(me), phase, len(members), group_size)
    return [members[i] for i in group if members[i] != me]


def same_stage_peers(records: dict[str, PeerRecord], stage: int, me: str) -> list[str]:
    """Peer ids of the training peers of ``stage`` other than ``me``, sorted (from fetch_swarm's records)."""
    return sorted(pid for pid, rec in records.items()
                  if rec.stage == stage and rec.state == PeerState.TRAINING and pid != me)


class AveragingLoop:
    """Background AsyncMesh sparse averaging of one stage's replicas; see the module docstring.

    Args:
        p2p: hivemind P2P of this peer. rpc_server: protocol.rpc.RpcServer the handler is added to.
        dht: hivemind DHT (read with membership.records.fetch_swarm each round).
        run: the run; its averaging section picks rule, timeout and codec (compression.averaging).
        stage: the stage this peer serves.
        worker_call: async fn(f) running f(worker) on the compute thread and returning its result.
        metrics: PeerMetrics; rounds, tau, group size and rejected parts are recorded there.
        config: NetAveragingConfig. transport, clock, fetch_peers, me, local_step: test seams (default:
            protocol.rpc over p2p, time.time, the DHT's records of this stage, p2p's peer id, metrics.local_step).
        behaviour: how this peer takes part in a round (peer.averaging.behaviour): honest unless a test or the red
            team hands another one in.
        prepare: fn(round_no) drawing a round's partition ahead on a worker thread (StageWorker.averaging_prepare),
            so that the compute thread's part of the begin is only the gather.
        place: fn(mean) checking a round's aggregate (decoded on the host) finite and moving it onto the stage's device
            on a worker thread (StageWorker.averaging_place), so that the compute thread's finish pays neither.
    """

    def __init__(self, *, p2p: P2P | None, rpc_server: HandlerTable | None, dht: DHT | None, run: RunConfig,
                 stage: int, worker_call: WorkerCall, metrics: PeerMetrics, config: NetAveragingConfig | None = None,
                 transport: Transport | None = None, clock: Callable[[], float] = time.time,
                 fetch_peers: Callable[[], Awaitable[list[str]]] | None = None, me: str | None = None,
                 local_step: Callable[[], int] | None = None, behaviour: AveragingBehaviour | None = None,
                 prepare: Callable[[int], None] | None = None,
                 place: Callable[[list[torch.Tensor]], Placed] | None = None) -> None:
        self.run, self.stage, self.worker_call, self.metrics = run, stage, worker_call, metrics
        self.prepare = prepare
        self.place = place
        self.rule = rule_of(run.averaging)
        self.config = config or NetAveragingConfig()
        self.period_s, self.per_tick = run.averaging.period_s, run.averaging.rounds_per_tick
        self.local_step = local_step or (lambda: metrics.local_step)
        self._owed = 0.0  # local steps of averaging owed at local step _owed_at (see owed())
        self._owed_at: int | None = None  # None: no round taken yet, one is owed at once
        self.dht, self.clock = dht, clock
        self.vouch: Callable[[str], None] | None = getattr(rpc_server, "vouch", None)  # parts kept: validated work
        if me is None:
            if p2p is None:
                raise ValueError("AveragingLoop needs me (this peer's id) when it has no p2p to read it from")
            me = p2p.peer_id.to_base58()
        self.me: str = me
        self.fetch_peers = fetch_peers or self._fetch_peers_from_dht
        self.behaviour = behaviour or HONEST
        self.exchange = PartExchange(
            transport=transport or RpcTransport(p2p, rpc_server), name=AVG_RPC, run_id=run.run_id, stage=stage,
            me=self.me, codec=run.compression.averaging, metrics=metrics, clock=clock, admit=self._admit,
            check=self.behaviour.check(relative_distance_check(self.config.max_rel_distance,
                                                               self.config.max_rms_distance)),
            member=self._is_member, keep_offers=self.behaviour.keeps_offers)
        self.peers: list[str] = []
        self._view_read_at = -math.inf  # clock() of the last on-demand re-read of the view
        self._heard: dict[str, float] = {}  # partner -> clock() of its last valid part (live partners set the quorum)
        self._born = clock()  # until quorum_startup_s after it, every announced partner counts for the quorum
        self._view_task: asyncio.Task[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._drivers: dict[int, asyncio.Task[None]] = {}
        self._taken: dict[int, None] = {}  # keys of the rounds this peer opened, oldest first (never re-opened)
        self._alone_at: int | None = None  # local step at the last slot that found no other replica in the view
        self._stopped = False
        # the exchange window: starts at collect_fraction x period_s and follows what rounds really take
        self._base_window = self.config.collect_fraction * self.period_s
        self._max_window = max(self._base_window, min(self.config.max_window_periods * self.period_s,
                                                      run.averaging.timeout_s))
        self.window_s = min(self._base_window, run.averaging.timeout_s)
        self._need_s: float | None = None  # EMA of the seconds a round took to collect every partner's part

    @property
    def enabled(self) -> bool:
        return self.rule.averages

    async def start(self) -> None:
        """Register the handler and start the round loop (nothing to do when the run's rule is 'none')."""
        if not self.enabled:
            logger.info("averaging.rule is 'none': replicas of stage %d will not average", self.stage)
            return
        await self.exchange.register()
        self.metrics.start_averaging(self.local_step())
        self._task = asyncio.create_task(self._loop(), name=f"averaging-stage{self.stage}")

    async def stop(self) -> None:
        """Stop the loop and refuse new rounds; rounds in flight are aborted (weights untouched)."""
        self._stopped = True
        # cancel until done: on Python 3.11 asyncio.wait_for can swallow a cancellation that races its completion
        while tasks := [t for t in [self._task, *self._drivers.values()] if t is not None and not t.done()]:
            for t in tasks:
                t.cancel()
            await asyncio.wait(tasks, timeout=1.0)
        self._task = None

    async def _fetch_peers_from_dht(self) -> list[str]:
        records = await fetch_swarm(self.dht, self.run.run_id, timeout=self.config.swarm_timeout_s)
        return same_stage_peers(records, self.stage, self.me)

    async def _is_member(self, peer: str) -> bool:
        """Whether ``peer`` is an announced training peer of our stage; re-reads the view (rate-limited) if not."""
        if peer in self.peers:
            return True
        if self._view_task is None and self.clock() - self._view_read_at >= self.config.member_refresh_s:
            self._view_read_at = self.clock()
            self._view_task = asyncio.create_task(self._reread_view())
        if self._view_task is not None:
            await asyncio.shield(self._view_task)
        return peer in self.peers

    async def _reread_view(self) -> None:
        try:
            self.peers = await asyncio.wait_for(self.fetch_peers(), self.config.swarm_timeout_s)
        except Exception as e:  # keep the old view; the sender is asked again next time
            logger.debug("re-reading the stage's peers failed: %r", e)
        finally:
            self._view_task = None

    def _check_cadence(self) -> None:
        """Say so when the round clock, not round_steps, sets the pace: a peer that makes more than rounds_per_tick x
        round_steps local steps per tick cannot open the rounds it owes and averages less per step than the run file
        says (it is told on the dashboard, with what to change)."""
        want, avg = self.run.averaging.fraction, self.run.averaging
        got = self.metrics.averaging_cadence()["avg_fraction_per_step"]
        rounds = self.metrics.count("averaging_rounds_ok")
        if not self.rule.whole and got is not None and rounds >= CADENCE_MIN_ROUNDS and got < CADENCE_TOLERANCE * want:
            self.metrics.warn(f"averaging under half the run's {want:g} of the weights per local step: this peer "
                              f"makes more than averaging.rounds_per_tick x round_steps = {avg.rounds_per_tick} x "
                              f"{avg.round_steps} steps per {self.period_s:g}-s tick; the run should raise "
                              "rounds_per_tick (or shorten period_s)", key="avg_cadence")
        else:
            self.metrics.resolve("avg_cadence")

    def _tick(self, key: int) -> int:
        return key // self.per_tick

    def _start(self, key: int) -> float:
        return round_start(key, self.period_s, self.per_tick)

    def _deadline(self, key: int) -> float:
        return round_deadline(key, self.period_s, self.config, self.run.averaging.timeout_s, self.window_s,
                              self.per_tick)

    def observe_exchange(self, elapsed_s: float, *, complete: bool, starved: bool) -> None:
        """Adapt the exchange window to a finished exchange: ``elapsed_s`` from the window's start until every partner
        answered (``complete``); ``starved``: the window ended with the round below its quorum, so it was too short
        (its real need is at least twice what it had). An incomplete round that reached its quorum says nothing new.
        The window is twice the moving average of the need, within [collect_fraction x period_s, max]: it follows the
        payload and the links (a slow link or a large part takes longer), and a fast swarm keeps the short window."""
        if complete:
            sample = elapsed_s
        elif starved:
            sample = self.window_s
        else:
            return
        self._need_s = sample if self._need_s is None else (1 - WINDOW_EMA) * self._need_s + WINDOW_EMA * sample
        if starved:  # grow at once: every round below its quorum is lost averaging
            self._need_s = max(self._need_s, sample)
        self.window_s = min(max(2.0 * self._need_s, self._base_window), self._max_window)
        self.metrics.avg_window_s = self.window_s

    def owed(self) -> float:
        """Local steps of averaging this peer owes: steps made since its rounds last paid for them (one round pays
        round_steps), at most (rounds_per_tick + 1) x round_steps; round_steps before its first round."""
        s = self.run.averaging.round_steps
        if self._owed_at is None:
            return float(s)
        return min(self._owed + self.local_step() - self._owed_at, float((self.per_tick + 1) * s))

    def due(self) -> bool:
        """True when this peer owes at least one round (round_steps local steps of averaging)."""
        return rounds_to_open(self.owed(), self.run.averaging.round_steps, self.per_tick) > 0

    def _pay(self, sign: int = 1) -> None:
        """A round taken (sign 1) or failed, so owed again (sign -1)."""
        s = self.run.averaging.round_steps
        owed, self._owed_at = self.owed() - sign * s, self.local_step()
        self._owed = min(max(owed, -float(s)), float((self.per_tick + 1) * s))

    async def _loop(self) -> None:
        # the view is read in the background: a slow DHT must neither delay a tick nor eat a round's exchange window
        views = asyncio.create_task(self._read_views(), name=f"averaging-view-stage{self.stage}")
        try:
            last: int | None = None
            while not self._stopped:
                key = next_round(self.clock(), self.period_s, self.per_tick)
                if last is not None and key > last + 1:
                    # the event loop woke too late for these slots: their rounds are not opened (a burst of rounds
                    # begun together would take the same weights), counted so that a lost cadence is seen
                    self.metrics.inc("avg_slots_missed", key - last - 1)
                await asyncio.sleep(max(0.0, self._start(key) - self.clock()))
                self.open_slot(key)
                last = key
        finally:
            views.cancel()

    async def _read_views(self) -> None:
        """Re-read the stage's peers from the DHT every ``view_refresh_s`` (a failed read keeps the last view)."""
        while not self._stopped:
            started = time.monotonic()
            try:
                self.peers = await asyncio.wait_for(self.fetch_peers(), self.config.swarm_timeout_s)
            except Exception as e:  # a DHT hiccup: the next read tries again
                logger.debug("reading the stage's peers failed: %r", e)
            await asyncio.sleep(max(0.0, self.config.view_refresh_s - (time.monotonic() - started)))

    def open_slot(self, key: int) -> bool:
        """At the start of round ``key``: open it if this peer owes a round and has partners; whether it did.

        The loop calls this once per slot, at the slot's own start (``round_start``), so a tick's rounds are spread
        over the tick as its steps are: rounds opened together at the tick's start would begin from the same weights
        and, on a stage cut in fewer partitions than rounds_per_tick (whole-tensor rounds), average the same values
        several times over while counting each as new."""
        if key in self._taken:  # a partner's early part opened it already
            return False
        step = self.local_step()
        if not [p for p in self.peers if p != self.me]:  # alone: these steps leave the per-step fraction
            if self._alone_at is not None:
                self.metrics.averaging_alone(step - self._alone_at)
            self._alone_at = step
            return False
        self._alone_at = None
        if not self.due() or not self.partners(key):
            return False
        self._ensure_round(key)
        return True

    def open_due(self, tick: int) -> list[int]:
        """Open the rounds this peer owes among the slots of ``tick`` at once (slots 0, 1, ..., at most
        rounds_per_tick); returns their keys. The loop opens each slot at its own start (``open_slot``)."""
        opened = []
        for key in range(tick * self.per_tick, (tick + 1) * self.per_tick):
            if key in self._taken:
                continue
            if not self.open_slot(key):
                break
            opened.append(key)
        return opened

    def partners(self, round_no: int) -> list[str]:
        """Whom we average with in ``round_no``: every known same-stage peer, or under the 'wagma' rule our
        rotating group among them (every ``wagma_global_every``-th round: everyone, which bounds staleness)."""
        cfg = self.run.averaging
        view = [p for p in self.peers if p != self.me]
        phase = wagma_phase(round_no, self.per_tick)
        if not self.rule.groups or wagma_is_global(phase, cfg.wagma_global_every):
            return view
        return wagma_partners(self.me, view, phase, cfg.wagma_group_size)

    def _admit(self, round_no: int, peer: str) -> Slot:
        if self._stopped:
            raise Refused(ErrorCode.NOT_READY, "stopped", "this peer has stopped averaging")
        if self.rule.groups and peer in self.peers and peer not in self.partners(round_no):
            raise Refused(ErrorCode.NOT_READY, "not_in_group", f"not in our WAGMA group of round {round_no}")
        tick = self._tick(round_no)
        # each peer measures its own window: a part is admitted while any peer's may still be open (its bound), and
        # the round it opens here collects from now on (_ensure_round)
        reason = admissible(round_no, self.clock(), self.period_s, self.config, self.run.averaging.timeout_s,
                            self._max_window, self.per_tick)
        if reason is not None:
            current = math.floor(self.clock() / self.period_s)
            if reason == "stale_round" and tick == current:
                raise Refused(ErrorCode.NOT_READY, "stale_round",
                              f"round {round_no} closed: its exchange window has ended")
            raise Refused(ErrorCode.BAD_REQUEST if reason == "future_round" else ErrorCode.NOT_READY, reason,
                          f"{reason} (round {round_no} of tick {tick}; ours is tick {current}: check that the peers' "
                          "clocks are synced)")
        return self._ensure_round(round_no)

    def _ensure_round(self, round_no: int) -> Slot:
        slot = self.exchange.slots.get(round_no)
        if slot is None:
            if round_no in self._taken:  # a late part of a round this peer already finished or gave up
                raise Refused(ErrorCode.NOT_READY, "round_over", f"round {round_no} is over here")
            self._taken[round_no] = None
            while len(self._taken) > TAKEN_MEMORY:
                del self._taken[next(iter(self._taken))]
            self._pay()
            # a round opened late (a partner's part, from a peer whose window is longer than ours) still collects
            # for a short window from now, within the longest window any peer may use
            late = min(self.clock() + self._base_window, self._start(round_no) + self._max_window)
            slot = self.exchange.open(round_no, max(self._deadline(round_no), late))
            task = asyncio.create_task(self._drive(slot), name=f"averaging-round-{round_no}")
            self._drivers[round_no] = task
            task.add_done_callback(lambda _t: self._drivers.pop(round_no, None))  # round_no: this call's, unchanged
        return slot

    async def _drive(self, slot: Slot) -> None:
        r, begun = slot.key, False
        # what the round took is measured from its start here: a round a partner's part opened late (its window is
        # longer than ours) must not lengthen ours by its lateness
        opened = max(self.clock(), self._start(r))
        try:
            timeout = max(0.1, min(self.config.worker_timeout_s, slot.deadline - self.clock()))
            if self.prepare is not None:
                await asyncio.wait_for(asyncio.to_thread(self.prepare, r), timeout)
            begun = True  # from here an abort is due whatever happens: the begin may still run on the compute thread
            values, step0 = await asyncio.wait_for(
                self.worker_call(lambda w: (w.averaging_begin(r), w.local_step)), timeout)
            peers = self.partners(r)
            values = await self.behaviour.part(self.exchange, slot, values, peers,
                                               self._start(r))
            await self.exchange.publish(slot, values)
            start = max(self.clock(), self._start(r))
            # smaller ids are waited for only a share of the run's short window: partners that did not open this
            # round call only once our part pulls them in, so waiting on a grown window would only delay it
            grace = self.config.initiator_grace * min(slot.deadline - start, self._base_window)
            await exchange_all(self.exchange, slot, self.me, peers, start, grace, self.config.call_timeout_s)
            self.exchange.close(r)
            need = self._round_quorum(slot, peers)
            complete = all(p in slot.contributions for p in peers)
            starved = not complete and len(slot.contributions) + 1 < need
            self.observe_exchange(self.clock() - opened, complete=complete,
                                  starved=starved)
            if not slot.contributions or self._below_quorum(len(slot.contributions), need):
                logger.debug("round %d: %d of %d partners' parts arrived; aborted", r, len(slot.contributions),
                             len(peers))
                await self._abort(r)
                begun = False
                self.metrics.observe_round(ok=False)
                self._pay(-1)
                return
            # the full quorum counts partners we measured (a valid part lately), never bare records, so records
            # that never answer cannot turn an honest round into a clipped minority one
            measured = len(self._counted(peers))
            mean, group, clipped = await self._combine(slot, asked=measured, quorum=need)
            finish = self._finisher(r, mean, clipped)
            begun = False  # finish either applies or (validation failed) leaves the snapshot, which abort clears
            step1 = await asyncio.wait_for(self.worker_call(finish), self.config.worker_timeout_s)
            tau = step1 - step0
            self.metrics.observe_round(ok=True, group_size=group, tau=tau,
                                       fraction=self.rule.round_fraction(self.run.averaging))
            logger.debug("round %d: averaged with %d peers, tau %d", r, group - 1, tau)
            self._check_cadence()
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            logger.warning("averaging round %d skipped: the compute thread did not answer within the round's window "
                           "(if this repeats, lengthen the run's averaging.period_s: it must span several compute "
                           "steps)", r)
            self.metrics.observe_round(ok=False)
            self._pay(-1)
            begun = True
        except Exception as e:  # the round fails; training goes on
            logger.warning("averaging round %d failed: %s: %s", r, type(e).__name__, e)
            self.metrics.observe_round(ok=False)
            self._pay(-1)
            begun = True
        finally:
            self.exchange.close(r)
            if begun:
                await self._abort(r)

    def quorum(self, live: int) -> int:
        """Contributions (ours included) a round needs when ``live`` of the partners asked sent a valid part in the
        last ``quorum_recent_s``: 2b + 1, b = the liars the robust aggregate tolerates among them and us
        (``trimmed_count``: 1 of 3-4, 2 of 5-8, 0 of 2), so that liars who always answer cannot be more than b of a
        round that the others did not all reach in time. Peers that are announced but never answer do not count."""
        if self.run.averaging.aggregator == "mean":
            return 2
        return quorum_of(live, self.run.averaging.trim)

    def _round_quorum(self, slot: Slot, peers: list[str]) -> int:
        now = self.clock()
        for p in slot.contributions:
            self._heard[p] = now
        self._heard = {p: t for p, t in self._heard.items() if now - t <= self.config.quorum_recent_s}  # bounded
        return self.quorum(len(self._counted(peers)))

    def _counted(self, peers: list[str]) -> list[str]:
        """The partners the quorum counts: those heard from lately, or every announced one while the loop is young
        (``quorum_startup_s``: no partner has been heard yet, and liars answer first)."""
        if self.clock() - self._born < self.config.quorum_startup_s:
            return list(peers)
        return [p for p in peers if p in self._heard]

    def _below_quorum(self, arrived: int, need: int) -> bool:
        """Fewer parts than the round's quorum: not applied (the module docstring, "A round"), counted as
        ``avg_below_quorum``."""
        if arrived + 1 >= need:
            return False
        self.metrics.inc("avg_below_quorum")
        return True

    async def _combine(self, slot: Slot, *, asked: int,
                       quorum: int) -> tuple[list[torch.Tensor] | Placed, int, bool]:
        """The round's robust aggregate (peer.averaging.aggregate), the contributions it kept, ours included, and
        whether its pull on our values was clipped."""
        own = slot.own_values
        assert own is not None  # a round is combined only after our part was published
        def combine() -> tuple[list[torch.Tensor] | Placed, list[str], bool]:
            mean, dropped, clipped = robust_combine(
                self.me, own, slot.contributions, self.run.averaging, outlier_factor=self.config.outlier_factor,
                outlier_rms=self.config.outlier_rms, lone_bound=self.config.lone_bound, asked=asked, quorum=quorum)
            # checked and onto the stage's device here, on a worker thread: the compute thread's finish does neither
            return (mean if self.place is None else self.place(mean)), dropped, clipped

        mean, dropped, clipped = await asyncio.get_running_loop().run_in_executor(None, combine)
        for peer in dropped:
            if peer == self.me:
                self.metrics.inc("avg_self_outlier")
                logger.info("round %d: our own slice was far from the robust centre of %d parts: it takes the "
                            "others' aggregate", slot.key, len(slot.contributions) + 1)
                continue
            self.metrics.inc("rejected:avg_outlier")
            logger.debug("round %d: part of %s dropped: far from the robust centre", slot.key, peer)
        # parts kept in a round whose pull was not bounded as a minority round's: validated work of their senders
        if self.vouch is not None and not clipped:
            for peer in slot.contributions:
                if peer not in dropped and peer != self.me:
                    self.vouch(peer)
        if clipped:
            self.metrics.inc("avg_pull_clipped")
            logger.debug("round %d: %d of the stage's contributions pulled farther than half %s of our values' "
                         "norm: clipped", slot.key, len(slot.contributions) + 1, self.config.lone_bound)
        return mean, len(slot.contributions) + 1 - len(dropped), clipped

    def _finisher(self, r: int, mean: list[torch.Tensor] | Placed, bounded: bool) -> Callable[[StageWorker], int]:
        def finish(w: StageWorker) -> int:
            if bounded:
                w.averaging_finish(r, mean, bounded=True)
            else:
                w.averaging_finish(r, mean)
            return w.local_step

        return finish

    async def _abort(self, r: int) -> None:
        try:
            await asyncio.shield(asyncio.wait_for(self.worker_call(lambda w: w.averaging_abort(r)),
                                                  self.config.worker_timeout_s))
        except Exception as e:
            logger.warning("aborting averaging round %d on the worker failed: %r", r, e)
