"""The swarm's progress as a whole: run name, tokens trained, step against ``total_steps``, ETA, validation trend.

Built from per-peer figures read over time, either DHT records (``monitor``, and every peer for its own dashboard and
``/status``) or ``/status`` snapshots (the ``swarm`` parent). Each token enters the pipeline once, at stage 0, so
the swarm's tokens and step are those of the stage-0 peers: tokens are summed over every stage-0 peer seen so far
(the largest figure each announced, so one that left still counts; one that left before we started watching is not
known), the step is the highest state version among them (replicas average towards one model). The ETA divides the
steps left by the step rate over the last ``window_s`` seconds. The validation trend compares the mean of the latest
three validation losses with the three before.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from peer.lifecycle import PeerState

if TYPE_CHECKING:
    from peer.membership.records import PeerRecord

COUNTED = (PeerState.TRAINING, PeerState.DRAINING)


class PeerFigures(NamedTuple):
    """What progress needs of one training peer."""

    peer_id: str
    stage: int
    step: int
    tokens: int
    val_loss: float | None


def from_records(records: Iterable[PeerRecord]) -> list[PeerFigures]:
    """Figures of the training (or draining: their figures still hold) peers among DHT records (``PeerRecord``)."""
    return [PeerFigures(r.peer_id, r.stage, r.version, getattr(r, "tokens", 0), getattr(r, "val_loss", None))
            for r in records if r.state in COUNTED]


def trend(values: list[float], n: int = 3) -> str | None:
    """'falling', 'rising' or 'flat' (within 0.5 %) from the mean of the last ``n`` against the ``n`` before."""
    if len(values) < 2 * n:
        return None
    new, old = sum(values[-n:]) / n, sum(values[-2 * n:-n]) / n
    if abs(new - old) <= 0.005 * abs(old):
        return "flat"
    return "falling" if new < old else "rising"


class SwarmProgress:
    """Accumulates per-peer figures into the swarm's progress.

    Args:
        run_name: shown with the figures.
        total_steps: the run's ``optim.total_steps`` (the step the schedule ends at).
        window_s: seconds of step history the rate (and so the ETA) is computed over.
        history: validation losses kept for the trend and sparkline.
        clock: monotonic time in seconds (tests pass a fake one).
    """

    def __init__(self, *, run_name: str, total_steps: int, window_s: float = 120.0, history: int = 60,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if total_steps < 0 or window_s <= 0 or history < 2:
            raise ValueError("SwarmProgress needs total_steps >= 0, window_s > 0 and history >= 2")
        self.run_name, self.total_steps, self.window_s, self._clock = run_name, total_steps, window_s, clock
        self._tokens: dict[str, int] = {}
        self._steps: deque[tuple[float, int]] = deque()
        self._val: deque[float] = deque(maxlen=history)
        self._last_val: float | None = None
        self.step = 0

    def update(self, peers: Iterable[PeerFigures]) -> dict[str, Any]:
        """Take one read of the swarm; returns ``view()``."""
        now = self._clock()
        first = [p for p in peers if p.stage == 0]
        for p in first:
            self._tokens[p.peer_id] = max(self._tokens.get(p.peer_id, 0), p.tokens)
        if first:
            self.step = max(p.step for p in first)
            self._steps.append((now, self.step))
        while len(self._steps) > 2 and self._steps[0][0] < now - self.window_s:
            self._steps.popleft()
        vals = [p.val_loss for p in first if p.val_loss is not None]
        if vals:
            val = sum(vals) / len(vals)
            if val != self._last_val:  # a new evaluation somewhere (peers repeat the last one until the next)
                self._val.append(val)
                self._last_val = val
        return self.view()

    def steps_per_s(self) -> float | None:
        if len(self._steps) < 2:
            return None
        (t0, s0), (t1, s1) = self._steps[0], self._steps[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 >= s0 else None

    def view(self) -> dict[str, Any]:
        rate = self.steps_per_s()
        left = max(0, self.total_steps - self.step)
        return {
            "run_name": self.run_name,
            "tokens": sum(self._tokens.values()),
            "step": self.step,
            "total_steps": self.total_steps,
            "fraction": min(1.0, self.step / self.total_steps) if self.total_steps else None,
            "steps_per_s": rate,
            "eta_s": (0.0 if left == 0 else (left / rate if rate else None)),
            "val_loss": self._val[-1] if self._val else None,
            "val_loss_history": list(self._val),
            "val_trend": trend(list(self._val)),
        }


def progress_line(p: dict[str, Any] | None, duration: Callable[[float | None], str],
                  human: Callable[..., str]) -> str:
    """One line of a progress view: 'run X · step 120/2000 (6%) · ETA 5m00s · 1.2M tokens · val 4.31 falling'."""
    if not p:
        return "swarm progress not known yet"
    frac = "" if p.get("fraction") is None else f" ({p['fraction']:.0%})"
    eta = "-" if p.get("eta_s") is None else duration(p["eta_s"])
    val = "-" if p.get("val_loss") is None else f"{p['val_loss']:.3f}"
    trend_text = f" {p['val_trend']}" if p.get("val_trend") else ""
    return (f"run {p.get('run_name') or '?'} · step {p.get('step', 0)}/{p.get('total_steps', '?')}{frac} · ETA {eta}"
            f" · {human(p.get('tokens', 0))} tokens · val {val}{trend_text}")
