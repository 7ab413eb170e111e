"""Start-up phases of a peer seen from outside, and the progress watch that decides when a starting peer is stuck.

A peer's start-up has phases of very different lengths on a loaded machine (importing torch alone can take a minute
when a dozen peers start on two cores), so a fixed start-up timeout either fails slow-but-healthy peers or waits too
long for stuck ones. ``StartupWatch`` instead times out a peer only when it shows *no progress* for ``stall_s``:
progress is a new phase, a changed ``/status`` (peer id, stage, step, tokens, counters), a longer log, or, before the
status endpoint answers (imports print nothing), CPU time spent by the process.

``phase(entry)`` names what a ``swarm`` row shows (a ``Phase``): ``waiting`` (not started yet), ``starting`` (process
up, no ``/status`` yet), ``joining DHT``, ``choosing stage``, then the peer's own state in words (``loading state``,
``training``, ``draining``, ``stopped``), ``exited``, ``failed``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import StrEnum
from typing import Any

from peer.lifecycle import PeerState


class Phase(StrEnum):
    """What a launcher shows of one peer process: the process's own phases around the peer's life, the two parts of
    ``PeerState.JOINING`` a snapshot tells apart, and after them the peer's ``PeerState`` in words."""

    WAITING = "waiting"
    STARTING = "starting"
    JOINING_DHT = "joining DHT"
    CHOOSING_STAGE = "choosing stage"
    LOADING_STATE = PeerState.LOADING_STATE.label
    TRAINING = PeerState.TRAINING.label
    DRAINING = PeerState.DRAINING.label
    STOPPED = PeerState.STOPPED.label
    EXITED = "exited"
    FAILED = "failed"

    @property
    def short(self) -> str:
        """The phase in a table's narrow column (a peer state's own short name)."""
        return _SHORT[self]


_SHORT = {Phase.WAITING: "wait", Phase.STARTING: "start", Phase.JOINING_DHT: "dht", Phase.CHOOSING_STAGE: "choose",
          Phase.EXITED: "exit", Phase.FAILED: "failed",
          **{Phase(s.label): s.short for s in PeerState if s is not PeerState.JOINING}}
SHORT_PHASE: dict[str, str] = {p.value: p.short for p in Phase}
STARTING = (Phase.WAITING, Phase.STARTING, Phase.JOINING_DHT, Phase.CHOOSING_STAGE, Phase.LOADING_STATE)
CPU_PROGRESS_S = 0.1  # CPU seconds that count as progress before /status answers (an idle process spends ~0)


def phase(entry: dict[str, Any]) -> str:
    """The start-up phase of a ``/status`` snapshot, or of a ``{"name", "phase"}`` row for a peer with no status (a
    ``Phase``; a state this peer does not know is passed on as it is)."""
    if "phase" in entry:
        return str(entry["phase"])
    if "error" in entry:
        return Phase.EXITED if entry["error"] == "exited" else Phase.STARTING
    state = PeerState.parse(entry.get("state"))
    if state is PeerState.JOINING:  # the peer id is known once the DHT is up; until then it is still joining it
        return Phase.CHOOSING_STAGE if entry.get("peer_id") else Phase.JOINING_DHT
    return Phase(state.label) if state is not None else str(entry.get("state"))


def progress_marker(entry: dict[str, Any]) -> tuple[Any, ...]:
    """What must change in a snapshot for it to count as progress (not ages or rates, which change by themselves)."""
    c = entry.get("counters") or {}
    return (phase(entry), entry.get("peer_id"), entry.get("stage"), entry.get("local_step"),
            entry.get("tokens_total"), tuple(sorted((k, v) for k, v in c.items() if isinstance(v, (int, float)))))


class StartupWatch:
    """Tracks one starting peer and says how long it has shown no progress.

    Args:
        stall_s: seconds without any progress after which the peer counts as stuck.
        clock: monotonic time source in seconds (tests pass a fake one).
    """

    def __init__(self, stall_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if stall_s <= 0:
            raise ValueError(f"stall_s must be positive, got {stall_s}")
        self.stall_s, self._clock = stall_s, clock
        self.last_progress = clock()
        self.phase: str = Phase.STARTING
        self._marker: tuple[Any, ...] | None = None
        self._log_bytes = -1
        self._cpu_s: float | None = None

    def observe(self, entry: dict[str, Any], *, log_bytes: int, cpu_s: float | None) -> None:
        """Record what the peer shows now; any change since the last call is progress."""
        now = self._clock()
        self.phase = phase(entry)
        marker = progress_marker(entry)
        moved = marker != self._marker or log_bytes != self._log_bytes
        if self.phase == Phase.STARTING and cpu_s is not None:
            moved |= self._cpu_s is None or cpu_s - self._cpu_s >= CPU_PROGRESS_S
        if moved:
            self.last_progress = now
            self._marker, self._log_bytes = marker, log_bytes
            if cpu_s is not None:
                self._cpu_s = cpu_s
        elif self._cpu_s is None and cpu_s is not None:
            self._cpu_s = cpu_s

    def idle_s(self) -> float:
        """Seconds since the last progress."""
        return self._clock() - self.last_progress

    def stalled(self) -> bool:
        return self.idle_s() > self.stall_s
