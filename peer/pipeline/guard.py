"""What a stage accepts from strangers on the pipeline: who may send it work, which tensors, which ids, which losses.

Forwards only from announced peers of the previous stage (an unknown one gets Busy, so an honest newcomer is
retried); each micro-batch id trained once; activation and gradient norms within ``norm_factor`` of the median of the
last ``norm_recent`` accepted ones, relearnt only when senders of two distinct ids (or every announced one) all fall
outside; the last stage trains only on a loss not far above its own recent *trained* losses (``loss_ceiling``, fed by
long-known senders, capped per sender, its median rising at most ``loss_rise_slack`` per ``loss_floor_s``), so
plausible-norm garbage is refused before any stage trains on it; and each sender's share of the stage's work is
earned by trained micro-batches (``WorkShare``). Backwards are accepted only from the peer a micro-batch went to
(``Pending.sent_to``). docs/security.md ("What is protected, and how": the pipeline) gives each bound, its
figures and its reason.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from peer.lifecycle import PeerState
from peer.membership.records import PeerRecord

logger = logging.getLogger(__name__)

SENDER_STATES = (PeerState.TRAINING, PeerState.DRAINING)
KNOWN_SENDERS = 4096
"""Senders whose first trained micro-batch is remembered (for ``loss_trust_s``)."""


@dataclass(frozen=True, kw_only=True)
class GuardConfig:
    """Bounds on what strangers may feed a stage."""

    remember_ids: int = 65536
    """Micro-batch ids remembered as already trained (oldest forgotten first)."""
    norm_window: int = 128
    """Accepted norms the bounds are learnt from, per kind (activations, gradients)."""
    norm_warmup: int = 16
    """Norms accepted on the static checks alone before the learnt bounds apply."""
    norm_factor: float = 8.0
    """A norm above median x factor or below median / factor is refused."""
    norm_recent: int = 16
    """The median is of the last this many accepted norms: early in training activations grow several-fold in a few
    dozen micro-batches, and a median over the whole window lags far enough behind for honest ones to fall out."""
    norm_relearn_after: int = 4
    """Refusals of one kind in a row, none accepted meanwhile, after which its learnt norm bound is relearnt."""
    loss_window: int = 64
    """Recent losses (per kind: training, evaluation) an incoming loss is compared with."""
    loss_warmup: int = 8
    """Losses taken before the cross-check applies."""
    loss_tolerance: float = 0.5
    """A loss further than max(tolerance x median, loss_abs_tolerance) from the median is an outlier."""
    loss_abs_tolerance: float = 1.0
    """Absolute floor of the loss tolerance (small medians)."""
    loss_trust_s: float = 30.0
    """A sender's trained losses enter the ceiling's window once its first trained micro-batch is this old."""
    loss_sender_cap: int = 16
    """Most losses of one sender in the ceiling's window (its oldest is dropped for a newer one)."""
    loss_rise_slack: float = 0.1
    """The ceiling's median is held at most this fraction above its lowest of the last ``loss_floor_s`` seconds."""
    loss_floor_s: float = 300.0
    """How long a low median of the ceiling's window holds its median down: the ceiling rises at most
    ``loss_rise_slack`` per this many seconds however the window moves (an honest rise of the loss is followed as
    slowly; one far above it is refused and relearnt, ``loss_relearn_after``)."""
    loss_relearn_after: int = 32
    """Training losses refused in a row (none trained meanwhile) after which the ceiling's window is relearnt."""
    share_initial: int = 2
    """Micro-batches a sender with no trained work yet may hold here at once."""
    share_max: int = 64
    """Most micro-batches one sender may hold here at once, however much it contributed."""
    share_ban_after: int = 8
    """Refusals in a row (with others' work trained meanwhile) after which a sender is refused for ``share_ban_s``."""
    share_ban_s: float = 60.0
    """How long such a sender's forwards are answered Busy (doubles per repeat, up to 16x)."""

    def __post_init__(self) -> None:
        for name in ("remember_ids", "norm_window", "norm_recent", "loss_window", "norm_relearn_after"):
            if getattr(self, name) < 1:
                raise ValueError(f"GuardConfig.{name} must be >= 1")
        if self.norm_factor <= 1.0 or self.loss_tolerance <= 0 or self.loss_abs_tolerance < 0:
            raise ValueError("GuardConfig: norm_factor must be > 1 and loss tolerances positive")
        if self.loss_rise_slack < 0 or self.loss_floor_s < 0 or self.loss_sender_cap < 1:
            raise ValueError("GuardConfig: loss_rise_slack and loss_floor_s must be >= 0, loss_sender_cap >= 1")


class _Window:
    """The last ``size`` accepted values (and who sent each) and their median; the refusals since the last accept."""

    def __init__(self, size: int) -> None:
        self.values: deque[float] = deque(maxlen=size)
        self.senders: deque[str | None] = deque(maxlen=size)
        self.refused_in_a_row = 0
        self.refusers: Counter[str | None] = Counter()

    def median(self, last: int | None = None) -> float | None:
        """The median of the last ``last`` values (all of them when None)."""
        if not self.values:
            return None
        values = list(self.values)
        return statistics.median(values[-last:] if last else values)

    def add(self, value: float, sender: str | None = None, cap: int | None = None) -> None:
        """Append ``value``; with ``cap``, first drop ``sender``'s oldest value when it already holds ``cap``."""
        if cap is not None and sender is not None and self.senders.count(sender) >= cap:
            i = self.senders.index(sender)
            del self.values[i], self.senders[i]
        self.values.append(value)
        self.senders.append(sender)
        self.refused_in_a_row = 0
        self.refusers.clear()

    def refuse(self, sender: str | None) -> None:
        self.refused_in_a_row += 1
        self.refusers[sender] += 1

    def distinct_refusers(self) -> int:
        """Senders refused at least twice since the last accepted value (one stray refusal of an honest sender
        beside an attacker's flood does not count)."""
        return sum(1 for n in self.refusers.values() if n >= 2)

    def clear(self) -> None:
        self.values.clear()
        self.senders.clear()
        self.refused_in_a_row = 0
        self.refusers.clear()


class PipelineGuard:
    """Per-stage checks of incoming pipeline work. ``count(name)`` is told of every refusal (metrics)."""

    def __init__(self, *, stage: int, swarm: Callable[[], dict[str, PeerRecord]], count: Callable[[str], None],
                 config: GuardConfig | None = None, warn: Callable[[str, str], None] | None = None,
                 pinned: bool = False) -> None:
        self.stage, self.swarm, self.count, self.warn = stage, swarm, count, warn
        self.pinned = pinned
        """Sync mode: each pipeline is pinned to one replica per stage (``Hops.next_hops``)."""
        self._refused_logged_at = -math.inf
        self.config = config or GuardConfig()
        self._trained: OrderedDict[int, None] = OrderedDict()
        self._norms = {"activations": _Window(self.config.norm_window), "gradients": _Window(self.config.norm_window)}
        self._losses = {False: _Window(self.config.loss_window), True: _Window(self.config.loss_window)}
        self.share = WorkShare(self.config, count)
        # sender -> when its first work was trained, least recently trained first
        self._first_trained: OrderedDict[str, float] = OrderedDict()
        # (when, median) of the ceiling's window, medians increasing: its head is the lowest of the last loss_floor_s
        self._floor: deque[tuple[float, float]] = deque()
        self.clock: Callable[[], float] = time.monotonic

    def _distinct_needed(self, kind: str, neighbour: int) -> int:
        """Distinct senders whose refusals may reset a learnt bound: two, or all of the neighbour stage's announced
        peers when it has fewer (a stage of one sender must recover from its restart too). Gradients on a pinned
        route (sync mode) need one: they come only from the one replica this pipeline sends to (``Pending.sent_to``),
        so two could never be met, and one honest jump of their norms (that replica loaded its partners' state
        after a fork, or trained fast early on) stalled the flush for good. Activations keep the rule of two: any
        announced peer of the previous stage may send them, an attacker among them too."""
        if self.pinned and kind == "gradients":
            return 1
        n = sum(1 for r in self.swarm().values() if r.stage == neighbour and r.state in SENDER_STATES)
        return max(1, min(2, n))

    # ----- who -----------------------------------------------------------------------------------------------------
    def announced_sender(self, peer_id: str) -> bool:
        """Whether ``peer_id`` is announced as a working peer of the previous stage."""
        record = self.swarm().get(peer_id)
        ok = record is not None and record.stage == self.stage - 1 and record.state in SENDER_STATES
        if not ok:
            self.count("rejected:unannounced_sender")
        return ok

    # ----- which ids -----------------------------------------------------------------------------------------------
    def seen(self, mb_id: int) -> bool:
        """Whether micro-batch ``mb_id`` was already accepted here (a replay or a retry): counted."""
        if mb_id in self._trained:
            self.count("rejected:replayed_microbatch")
            return True
        return False

    def accept_id(self, mb_id: int) -> None:
        self._trained[mb_id] = None
        while len(self._trained) > self.config.remember_ids:
            self._trained.popitem(last=False)

    # ----- which tensors -------------------------------------------------------------------------------------------
    def norm_ok(self, kind: str, t: torch.Tensor, sender: str | None = None) -> bool:
        """Check ``t``'s norm, sent by ``sender``, against the learnt bounds of ``kind`` ('activations' or
        'gradients'); learn from it when accepted."""
        norm = float(torch.linalg.vector_norm(t.float()))
        window = self._norms[kind]
        median = window.median(self.config.norm_recent)
        if len(window.values) >= self.config.norm_warmup and median is not None and median > 0:
            f = self.config.norm_factor
            if not (median / f <= norm <= median * f) or not math.isfinite(norm):
                self.count(f"rejected:{kind}_norm")
                window.refuse(sender)
                neighbour = self.stage - 1 if kind == "activations" else self.stage + 1
                if window.refused_in_a_row >= self.config.norm_relearn_after \
                        and window.distinct_refusers() >= self._distinct_needed(kind, neighbour):
                    self._relearn(kind, median, norm)
                return False
        if not math.isfinite(norm):  # the static checks of the warm-up still hold
            self.count(f"rejected:{kind}_norm")
            return False
        window.add(norm, sender)
        return True

    def learning(self, kind: str) -> bool:
        """Whether the bound of ``kind`` is still being learnt (warm-up: only the static checks apply)."""
        return len(self._norms[kind].values) < self.config.norm_warmup

    def _relearn(self, kind: str, median: float, norm: float) -> None:
        """Forget the learnt bound of ``kind``: nothing within it arrived for ``norm_relearn_after`` tries. Without
        this, a stage whose neighbour restarted from its init refused that neighbour's work for good (refused norms
        never enter the window) and the neighbour's router banned it longer and longer."""
        self._norms[kind].clear()
        self.count(f"relearnt:{kind}_norm")
        logger.warning("the last %d %s were all refused (norm %.3g against a learnt median of %.3g): the neighbour "
                       "stage's weights moved (restarted from its init?); forgetting the bound and learning it again",
                       self.config.norm_relearn_after, kind, norm, median)
        if self.warn is not None:
            self.warn(f"{kind} norms moved away from the learnt bound (a neighbour stage restarted?); relearning it",
                      f"norm_relearn:{kind}")

    # ----- which losses --------------------------------------------------------------------------------------------
    def _loss_bounds(self, is_eval: bool) -> tuple[float, float] | None:
        """(median, tolerance) of recent losses of a kind, or None during the warm-up."""
        window = self._losses[is_eval]
        median = window.median()
        if median is None or len(window.values) < self.config.loss_warmup:
            return None
        return median, max(self.config.loss_tolerance * median, self.config.loss_abs_tolerance)

    def loss_ok(self, loss: float, *, is_eval: bool) -> bool:
        """Whether ``loss`` agrees with recent losses of its kind; an outlier is counted. Every loss enters the
        window (its median is what an attacker would have to move, and it follows honest drift)."""
        bounds = self._loss_bounds(is_eval)
        ok = bounds is None or abs(loss - bounds[0]) <= bounds[1]
        self._losses[is_eval].add(loss)
        if not ok:
            self.count("flagged:loss_outlier")
        return ok

    def loss_ceiling(self) -> float | None:
        """Last stage: the highest training loss it will train on now (None: no bound yet). Read on the event loop
        and handed to the compute thread, which refuses above it before any backward."""
        bounds = self._loss_bounds(False)
        if bounds is None:
            return None
        median = self._held(bounds[0], self.clock())
        if median < bounds[0]:
            self.count("flagged:loss_ceiling_held")  # per micro-batch judged under the held ceiling
        return median + max(self.config.loss_tolerance * median, self.config.loss_abs_tolerance)

    def _held(self, median: float, now: float) -> float:
        """``median`` of the ceiling's window, held at most ``loss_rise_slack`` above its lowest of late."""
        floor = self._lowest_median(now)
        return median if floor is None else min(median, floor * (1.0 + self.config.loss_rise_slack))

    def _lowest_median(self, now: float) -> float | None:
        """The lowest median of the ceiling's window over the last ``loss_floor_s`` seconds (None: none)."""
        while self._floor and now - self._floor[0][0] > self.config.loss_floor_s:
            self._floor.popleft()
        return self._floor[0][1] if self._floor else None

    def _note_median(self, now: float) -> None:
        """Remember the training window's median as held (once the window holds a quarter of its size) for
        ``_lowest_median``: a sliding minimum, at most one entry per second. The held value, not the window's: else
        the hold would end at once after ``loss_floor_s`` under a sender keeping the window's median high."""
        window = self._losses[False]
        if len(window.values) < max(self.config.loss_warmup, self.config.loss_window // 4):
            return
        median = self._held(statistics.median(window.values), now)
        while self._floor and self._floor[-1][1] >= median:
            self._floor.pop()
        if not self._floor or now - self._floor[-1][0] >= 1.0:
            self._floor.append((now, median))

    def loss_verdict(self, sender: str | None, loss: float, *, refused: Exception | None = None) -> None:
        """Last stage: a training loss it computed enters the window, and the sender's share learns whether the
        micro-batch was trained on (``refused``: why not). Work thrown away on purpose is said out loud: on the
        dashboard, and in the log at most once a minute."""
        window = self._losses[False]
        if sender is not None:
            if refused is None:
                self.share.trained(sender)
            else:
                self.share.refused(sender)
        if refused is None:
            now = self.clock()
            key = sender or ""
            first = self._first_trained.setdefault(key, now)
            self._first_trained.move_to_end(key)  # bounded by forgetting the sender trained least recently, so
            while len(self._first_trained) > KNOWN_SENDERS:  # a crowd of one-off identities cannot make the
                self._first_trained.popitem(last=False)  # steady senders newcomers again
            if now - first >= self.config.loss_trust_s:
                window.add(loss, sender, cap=self.config.loss_sender_cap)
            elif len(window.values) < self.config.loss_warmup:  # a newcomer helps warm up, never alone
                window.add(loss, sender, cap=max(1, self.config.loss_warmup // 2))
            self._note_median(now)
            return
        window.refuse(sender)
        if window.refused_in_a_row >= self.config.loss_relearn_after \
                and window.distinct_refusers() >= self._distinct_needed("losses", self.stage - 1):
            window.clear()
            self._floor.clear()
            self.count("relearnt:loss_ceiling")
            logger.warning("the last %d training losses were all refused: this stage's weights moved away from its "
                           "senders' (restarted?); forgetting the loss ceiling and learning it again",
                           self.config.loss_relearn_after)
        self.count("rejected:loss_above_ceiling")
        if self.warn is not None:
            self.warn("not training on micro-batches whose loss is far above this stage's recent losses (garbage "
                      "from a sender, or this stage's weights moved away from its senders'); their samples are "
                      "skipped (samples_refused)", "loss_refused")
        now = time.monotonic()
        if now - self._refused_logged_at >= 60.0:
            self._refused_logged_at = now
            logger.warning("refused to train on a micro-batch from %s: %s (further refusals this minute are only "
                           "counted: rejected:loss_above_ceiling)", (sender or "?")[-8:], refused)


@dataclass
class _Share:
    allowance: float
    streak: int = 0  # refusals in a row
    streak_mark: int = 0  # the stage's count of trained micro-batches when the streak began
    bans: int = 0
    banned_until: float = 0.0
    trained: int = 0
    refused: int = 0


class WorkShare:
    """How many micro-batches each sender may hold at a stage, earned by work of its that was trained (see the
    module docstring). ``count(name)`` is told of refusals and bans."""

    def __init__(self, config: GuardConfig, count: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.count, self.clock = config, count, clock
        self.on_ban: Callable[[str], None] | None = None
        """Told of each sender banned here (the stage makes it a stranger again)."""
        self._peers: dict[str, _Share] = {}
        self._trained_total = 0

    def _get(self, peer_id: str) -> _Share:
        share = self._peers.get(peer_id)
        if share is None:
            if len(self._peers) >= 4096:  # bounded: forget the sender with the least history
                del self._peers[min(self._peers, key=lambda p: self._peers[p].trained + self._peers[p].refused)]
            share = self._peers[peer_id] = _Share(allowance=float(self.config.share_initial))
        return share

    def admits(self, peer_id: str, holding: int) -> bool:
        """Whether ``peer_id``, holding ``holding`` micro-batches here, may hand us one more (else Busy)."""
        share = self._get(peer_id)
        if share.banned_until > self.clock():
            self.count("rejected:share_banned")
            return False
        if holding >= int(share.allowance):
            self.count("rejected:share_exceeded")
            return False
        return True

    def trained(self, peer_id: str) -> None:
        """A micro-batch ``peer_id`` sent us was trained (its gradient came back / its loss passed)."""
        share = self._get(peer_id)
        share.trained += 1
        share.streak = 0
        share.allowance = min(share.allowance + 1.0, float(self.config.share_max))
        self._trained_total += 1

    def refused(self, peer_id: str, *, measured_here: bool = True) -> None:
        """A micro-batch ``peer_id`` sent us was refused: by our own loss check, or (``measured_here`` False) by a
        later stage, whose word halves the allowance but never bans (a lying downstream peer must not get honest
        senders banned)."""
        share = self._get(peer_id)
        share.refused += 1
        share.allowance = max(1.0, share.allowance / 2)
        if share.streak == 0:
            share.streak_mark = self._trained_total
        share.streak += 1
        others_trained = self._trained_total > share.streak_mark  # it was refused while others were trained
        if measured_here and share.streak >= self.config.share_ban_after and others_trained:
            share.bans += 1
            share.banned_until = self.clock() + self.config.share_ban_s * min(2 ** (share.bans - 1), 16)
            share.streak = 0
            self.count("share_bans")
            if self.on_ban is not None:
                self.on_ban(peer_id)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per sender: allowance, trained, refused (for /status and tests)."""
        return {p: {"allowance": s.allowance, "trained": s.trained, "refused": s.refused}
                for p, s in self._peers.items()}
