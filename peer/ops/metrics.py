"""What one peer is doing, in numbers: the single place the daemon and the averager write, and everything else reads.

One ``PeerMetrics`` per peer process, mutated on the event loop only (no locks). The daemon's lifecycle reports each
transition (``observe_state``: the state is shown here, not decided); the daemon and its services set gauges
(``stage``, ``local_step``, ``inflight``, ...), count (``inc``, under the names registered in ``peer.ops.names``),
record losses (``observe_loss``/``observe_val``) and warnings (``warn``); the averager reports its rounds
(``start_averaging``, ``observe_round``). Readers (the dashboard, ``/status``, ``/metrics``, ``asyncmesh-peer status``)
only ever call ``snapshot()``, a plain JSON-able dict, so every view shows the same figures; every counter also gets a
rate over the last ``window_s`` seconds.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from peer.lifecycle import PeerState
from peer.ops import names

logger = logging.getLogger(__name__)

# Counters /metrics exposes from 0 (the registry of every name a peer counts under is peer/ops/names.py).
KNOWN_COUNTERS = names.COUNTERS
KNOWN_REJECTIONS = names.REJECTIONS
REJECTED_PREFIX = names.REJECTED_PREFIX
_COUNTER_ALIASES = {"tokens_total": "tokens"}
SNAPSHOT_SCHEMA = 1


class _RateWindow:
    """Sum of increments over the last ``window_s`` seconds, kept in 1-second buckets (O(window) memory)."""

    __slots__ = ("buckets", "window_s")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.buckets: deque[list[float]] = deque()  # [bucket start second, amount]

    def add(self, now: float, n: float) -> None:
        second = math.floor(now)
        if self.buckets and self.buckets[-1][0] == second:
            self.buckets[-1][1] += n
        else:
            self.buckets.append([second, n])
        self._trim(now)

    def total(self, now: float) -> float:
        self._trim(now)
        return sum(amount for _, amount in self.buckets)

    def _trim(self, now: float) -> None:
        while self.buckets and self.buckets[0][0] <= now - self.window_s - 1:
            self.buckets.popleft()


class PeerMetrics:
    """Counters, gauges and short histories of one peer. Cheap to write (O(1)), cheap to snapshot (~50 µs).

    Args:
        peer_id: this peer's libp2p id (base58); may be set later once the DHT is up.
        stage: pipeline stage served, or None before one is chosen.
        window_s: seconds over which rates (tokens/s, bytes/s) are averaged; 10 s smooths per-micro-batch bursts
            while still reacting within a few dashboard refreshes.
        history: number of loss values kept for the sparklines.
        stall_s: a training peer whose step and token count have not moved for this long reports unhealthy.
        warning_ttl_s: a warning not repeated for this long is no longer shown (conditions that still hold repeat
            their warning; 120 s spans several announce and retry periods).
        clock: monotonic time source in seconds (tests pass a fake one).
    """

    def __init__(
        self,
        peer_id: str = "",
        stage: int | None = None,
        *,
        window_s: float = 10.0,
        history: int = 120,
        stall_s: float = 300.0,
        warning_ttl_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window_s <= 0 or history < 2 or stall_s <= 0 or warning_ttl_s <= 0:
            raise ValueError("PeerMetrics needs window_s > 0, history >= 2, stall_s > 0 and warning_ttl_s > 0")
        self.warning_ttl_s = warning_ttl_s
        self.run_name = ""
        self.swarm_progress: dict[str, Any] | None = None  # peer.ops.progress view of the whole swarm
        self.device = ""
        self.peer_id = peer_id
        self.stage = stage
        self.run_id = ""
        self.access = "open"  # the run's access mode: "open" (anyone may join) or "closed" (admitted peers only)
        self.n_stages: int | None = None
        self.maddrs: list[str] = []
        self.memory: dict[str, Any] | None = None  # peer.budget.MemoryBudget.as_dict(): estimates against the limit
        self.spot_checks: dict[str, Any] | None = None  # peer.pipeline.spotcheck figures (distances, trusted hops)
        self.rechecks: dict[str, object] | None = None  # peer.pipeline.recheck figures (cosines, the copy's bytes)
        self.fwdchecks: dict[str, object] | None = None  # peer.pipeline.fwdcheck figures (the same, of forwards)
        self.backup: tuple[int, int, float] | None = None  # the neighbour copy held: stage, step, taken at (Unix s)
        self.train_loss: float | None = None
        self.val_loss: float | None = None
        self.pipeline_delay = 0.0
        self.avg_tau: float | None = None
        self.tokens_by_stage: dict[int, int] = {}
        self.avg_window_s: float | None = None  # the averaging rounds' exchange window (it follows the exchanges)
        self.avg_group_size: int | None = None
        self._avg_base_step: int | None = None  # local step when averaging started (None: this peer does not average)
        self._avg_fraction_sum = 0.0  # sum over applied rounds of the fraction of every tensor they averaged
        self._avg_alone_steps = 0  # local steps made with no partner to average with (not in the per-step fraction)
        self._avg_taus: Counter[int] = Counter()  # tau (local steps) -> applied rounds
        self._pipe_delays: Counter[int] = Counter()  # pipeline staleness (local steps) -> backwards
        self.inflight = 0
        self.queued = 0
        self.drain_deadline: float | None = None
        self.window_s = window_s
        self.stall_s = stall_s
        self._clock = clock
        self._started = clock()
        self._state = PeerState.JOINING
        self._state_since = self._started
        self._local_step = 0
        self._last_progress = self._started
        self._counters: Counter[str] = Counter()
        self._unregistered_seen: set[str] = set()
        self._rates: dict[str, _RateWindow] = {}
        self._train_hist: deque[float] = deque(maxlen=history)
        self._val_hist: deque[float] = deque(maxlen=history)
        self._peers_per_stage: dict[int, int] = {}
        self._warnings: deque[dict[str, Any]] = deque(maxlen=20)

    # ---- gauges with side effects -------------------------------------------------------------------------------
    @property
    def state(self) -> PeerState:
        """The peer's state as its ``Lifecycle`` last reported it."""
        return self._state

    def observe_state(self, state: PeerState, drain_s: float | None = None) -> None:
        """The peer entered ``state`` (a ``peer.lifecycle.StateObserver``); ``drain_s``: a shutdown's drain, shown as
        a countdown of that many seconds. A fresh state gets a fresh stall allowance."""
        state = PeerState(state)
        if state is not self._state:
            self._state, self._state_since = state, self._clock()
            self._last_progress = self._state_since
        if drain_s is not None:
            self.drain_deadline = self._clock() + max(0.0, drain_s)

    @property
    def local_step(self) -> int:
        """Optimiser steps applied by this peer's stage worker."""
        return self._local_step

    @local_step.setter
    def local_step(self, value: int) -> None:
        if value != self._local_step:
            self._last_progress = self._clock()
        self._local_step = int(value)

    def count(self, name: str) -> int:
        """The current value of counter ``name`` (0 before its first increment)."""
        return int(self._counters[name])

    @property
    def tokens_total(self) -> int:
        """Training tokens this peer has processed (the ``tokens`` counter)."""
        return int(self._counters["tokens"])

    @tokens_total.setter
    def tokens_total(self, value: int) -> None:
        self.inc("tokens", int(value) - self.tokens_total)

    # ---- writers ------------------------------------------------------------------------------------------------
    def inc(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name`` (e.g. 'bytes_out', 'rejected:bad_shape'); negative ``n`` is refused."""
        if n < 0:
            raise ValueError(f"counter {name!r} can only grow; got an increment of {n}")
        name = _COUNTER_ALIASES.get(name, name)
        if not names.is_registered(name):
            folded = names.registered(name)  # raises in the tests
            if name not in self._unregistered_seen and len(self._unregistered_seen) < 64:
                self._unregistered_seen.add(name)
                logger.warning("counter name %r is not registered (peer/ops/names.py); counted as %r", name, folded)
            name = folded
        self._counters[name] += n
        # a peer that moves counts each stage's tokens apart (stages are compared by them); none before it has one
        if name == "tokens" and self.stage is not None:
            self.tokens_by_stage[self.stage] = self.tokens_by_stage.get(self.stage, 0) + n
        now = self._clock()
        window = self._rates.get(name)
        if window is None:
            window = self._rates[name] = _RateWindow(self.window_s)
        window.add(now, n)
        if name in ("tokens", "samples") and n:
            self._last_progress = now

    def observe_loss(self, train_loss: float) -> None:
        """Record one training loss (last stage). Non-finite values are counted as 'nonfinite_loss', not stored."""
        if not math.isfinite(train_loss):
            self.inc("nonfinite_loss")
            return
        self.train_loss = float(train_loss)
        self._train_hist.append(self.train_loss)

    def observe_val(self, val_loss: float) -> None:
        """Record one validation loss (last stage, evaluation micro-batches)."""
        if not math.isfinite(val_loss):
            self.inc("nonfinite_loss")
            return
        self.val_loss = float(val_loss)
        self._val_hist.append(self.val_loss)
        self.inc("evaluations")  # the history is bounded: readers count new values with this

    def start_averaging(self, local_step: int) -> None:
        """Averaging starts now, at ``local_step``: avg_fraction_per_step counts steps from here."""
        self._avg_base_step = int(local_step)
        self._avg_alone_steps = 0

    def averaging_alone(self, steps: int) -> None:
        """``steps`` local steps were made with no other replica of the stage to average with: avg_fraction_per_step
        leaves them out (a stage's first replica trains alone until a second one joins; nothing can hold p then)."""
        if steps > 0:
            self._avg_alone_steps += int(steps)

    def observe_round(self, *, ok: bool, group_size: int | None = None, tau: float | None = None,
                      fraction: float | None = None) -> None:
        """Record one finished averaging round: success, how many peers took part, local steps it took (tau), and
        the fraction of every tensor it averaged."""
        self.inc("averaging_rounds_ok" if ok else "averaging_rounds_failed")
        if ok:
            if group_size is not None:
                self.avg_group_size = int(group_size)
            if tau is not None:
                self.avg_tau = float(tau)
                self._avg_taus[int(tau)] += 1
            if fraction is not None:
                self._avg_fraction_sum += float(fraction)

    def observe_pipeline_delay(self, delay: int) -> None:
        """A backward ran ``delay`` local steps after its forward: the moving ``pipeline_delay`` and the run's
        histogram (``pipeline_delay_steps``, ``pipeline_delay_hist``) take it."""
        seen = bool(self._pipe_delays)
        self.pipeline_delay = 0.9 * self.pipeline_delay + 0.1 * delay if seen else float(delay)
        self._pipe_delays[int(delay)] += 1

    def averaging_cadence(self) -> dict[str, Any]:
        """avg_fraction_per_step, avg_delay_steps (mean measured tau) and avg_delay_hist (tau -> rounds); and the
        pipeline's staleness over the run: pipeline_delay_steps (mean) and pipeline_delay_hist (delay -> backwards)."""
        steps = (None if self._avg_base_step is None
                 else self._local_step - self._avg_base_step - self._avg_alone_steps)
        n, m = sum(self._avg_taus.values()), sum(self._pipe_delays.values())
        return {
            "avg_fraction_per_step": (self._avg_fraction_sum / steps) if steps else None,
            "avg_delay_steps": (sum(t * c for t, c in self._avg_taus.items()) / n) if n else None,
            "avg_delay_hist": {str(t): c for t, c in sorted(self._avg_taus.items())},
            "avg_window_s": self.avg_window_s,
            "pipeline_delay_steps": (sum(d * c for d, c in self._pipe_delays.items()) / m) if m else None,
            "pipeline_delay_hist": {str(d): c for d, c in sorted(self._pipe_delays.items())},
        }

    def set_swarm(self, peers_per_stage: dict[int, int]) -> None:
        """Record how many peers the DHT currently shows per stage (the latest fetch replaces the previous one)."""
        self._peers_per_stage = {int(s): int(n) for s, n in peers_per_stage.items()}

    def warn(self, text: str, key: str | None = None) -> None:
        """Show an operator-facing warning; a repeat of the latest one bumps its count instead of adding a line.

        A warning disappears ``warning_ttl_s`` after its last repeat, or at once when ``resolve(key)`` says that the
        condition it names (``key``, e.g. ``no_route:1``) no longer holds.
        """
        now = self._clock()
        if self._warnings and self._warnings[-1]["text"] == text:
            self._warnings[-1]["count"] += 1
            self._warnings[-1]["at"] = now
            return
        self._warnings.append({"text": text, "count": 1, "at": now, "key": key})

    def resolve(self, key: str) -> None:
        """The condition of the warnings raised with ``key`` is over: stop showing them (cheap when there are none)."""
        if any(w.get("key") == key for w in self._warnings):
            self._warnings = deque((w for w in self._warnings if w.get("key") != key), maxlen=self._warnings.maxlen)

    # ---- reader -------------------------------------------------------------------------------------------------
    def rate(self, name: str) -> float:
        """Per-second rate of counter ``name`` over the window (over the uptime while it is shorter)."""
        window = self._rates.get(_COUNTER_ALIASES.get(name, name))
        if window is None:
            return 0.0
        now = self._clock()
        span = min(self.window_s, max(now - self._started, 1e-3))
        return window.total(now) / span

    def health(self) -> tuple[bool, list[str]]:
        """(healthy, reasons): unhealthy when stopped, training with no step or token for ``stall_s``, or stuck
        joining / loading state for longer than ``stall_s``."""
        now = self._clock()
        reasons = []
        if self._state is PeerState.STOPPED:
            reasons.append("peer has stopped")
        if self._state is PeerState.TRAINING and now - self._last_progress > self.stall_s:
            idle = now - self._last_progress
            reasons.append(f"no training progress for {idle:.0f} s (stall limit {self.stall_s:g} s)")
        if self._state in (PeerState.JOINING, PeerState.LOADING_STATE) and now - self._state_since > self.stall_s:
            reasons.append(f"still {self._state} after {now - self._state_since:.0f} s (limit {self.stall_s:g} s); "
                           "check --initial-peers and the network")
        return not reasons, reasons

    def _memory(self) -> dict[str, Any] | None:
        """The memory estimates against the limit, with the estimate of the stage served now."""
        if self.memory is None:
            return None
        per_stage = self.memory.get("stage_bytes") or []
        here = per_stage[self.stage] if self.stage is not None and 0 <= self.stage < len(per_stage) else None
        return {**self.memory, "estimate_bytes": here}

    def snapshot(self) -> dict[str, Any]:
        """Every figure as a JSON-able dict (the schema all views share; see ``SNAPSHOT_SCHEMA``)."""
        now = self._clock()
        counters = dict(self._counters)
        rejected = {k[len(REJECTED_PREFIX):]: v for k, v in counters.items() if k.startswith(REJECTED_PREFIX)}
        rates = {k: self.rate(k) for k in self._rates}
        tokens_per_s = rates.get("tokens", 0.0)
        bytes_in_per_s, bytes_out_per_s = rates.get("bytes_in", 0.0), rates.get("bytes_out", 0.0)
        healthy, reasons = self.health()
        train = list(self._train_hist)
        return {
            "schema": SNAPSHOT_SCHEMA,
            "peer_id": self.peer_id,
            "run_id": self.run_id,
            "access": self.access,
            "run_name": self.run_name,
            "device": self.device,
            "stage": self.stage,
            "n_stages": self.n_stages,
            "maddrs": list(self.maddrs),
            "state": self._state.value,
            "state_for_s": now - self._state_since,
            "uptime_s": now - self._started,
            "drain_remaining_s": (max(0.0, self.drain_deadline - now)
                                  if self._state is PeerState.DRAINING and self.drain_deadline is not None else None),
            "healthy": healthy,
            "health_reasons": reasons,
            "local_step": self._local_step,
            "tokens_total": self.tokens_total,
            "tokens_per_s": tokens_per_s,
            "bytes_in_per_s": bytes_in_per_s,
            "bytes_out_per_s": bytes_out_per_s,
            "bytes_per_token": ((bytes_in_per_s + bytes_out_per_s) / tokens_per_s) if tokens_per_s > 0 else None,
            "train_loss": self.train_loss,
            "train_loss_avg": (sum(train[-20:]) / len(train[-20:])) if train else None,
            "val_loss": self.val_loss,
            "train_loss_history": train,
            "val_loss_history": list(self._val_hist),
            "pipeline_delay": self.pipeline_delay,
            "avg_tau": self.avg_tau,
            "avg_group_size": self.avg_group_size,
            **self.averaging_cadence(),
            "inflight": self.inflight,
            "queued": self.queued,
            "counters": counters,
            "rates": rates,
            "rejected": rejected,
            "peers_per_stage": {str(s): n for s, n in sorted(self._peers_per_stage.items())},
            "swarm": self.swarm_progress,
            "memory": self._memory(),
            "spot_checks": self.spot_checks,
            "rechecks": self.rechecks,
            "fwdchecks": self.fwdchecks,
            "backup": None if self.backup is None else {
                "stage": self.backup[0], "step": self.backup[1], "age_s": max(0.0, time.time() - self.backup[2])},
            "warnings": [{"text": w["text"], "count": w["count"], "age_s": now - w["at"]} for w in self._warnings
                         if now - w["at"] <= self.warning_ttl_s],
        }
