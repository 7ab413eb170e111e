"""Start-up phases of a peer seen from outside, and the progress watch that decides when a starting peer is stuck.

A peer's start-up has phases of very different lengths on a loaded machine (importing torch alone can take a minute
when a dozen peers start on two cores), so a fixed start-up timeout either fails slow-but-healthy peers or waits too
long for stuck ones. ``StartupWatch`` instead times out a peer only when it shows *no progress* for ``stall_s``:
progress is a new phase, a changed ``/status`` (peer id, stage, step, tokens, counters), a longer log, or, before the
status endpoint answers (imports print nothing), CPU time spent by the process.

``phase(entry)`` names what a ``swarm`` row shows: ``waiting`` (not started yet), ``starting`` (process up, no
``/status`` yet), ``joining DHT``, ``choosing stage``, ``loading state``, ``training``, ``draining``, ``stopped``,
``exited``, ``failed``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

PHASES = ("waiting", "starting", "joining DHT", "choosing stage", "loading state", "training", "draining", "stopped",
          "exited", "failed")
SHORT_PHASE = {"waiting": "wait", "starting": "start", "joining DHT": "dht", "choosing stage": "choose",
               "loading state": "load", "training": "train", "draining": "drain", "stopped": "stop",
               "exited": "exit", "failed": "failed"}
STARTING = ("waiting", "starting", "joining DHT", "choosing stage", "loading state")
CPU_PROGRESS_S = 0.1  # CPU seconds that count as progress before /status answers (an idle process spends ~0)


def phase(entry: dict[str, Any]) -> str:
    """The start-up phase of a ``/status`` snapshot, or of a ``{"name", "phase"}`` row for a peer with no status."""
    if "phase" in entry:
        return str(entry["phase"])
    if "error" in entry:
        return "exited" if entry["error"] == "exited" else "starting"
    state = entry.get("state")
    if state == "joining":  # the peer id is known once the DHT is up; until then it is still joining it
        return "choosing stage" if entry.get("peer_id") else "joining DHT"
    return {"loading_state": "loading state"}.get(str(state), str(state))


def progress_marker(entry: dict[str, Any]) -> tuple:
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
        self.phase = "starting"
        self._marker: tuple | None = None
        self._log_bytes = -1
        self._cpu_s: float | None = None

    def observe(self, entry: dict[str, Any], *, log_bytes: int, cpu_s: float | None) -> None:
        """Record what the peer shows now; any change since the last call is progress."""
        now = self._clock()
        self.phase = phase(entry)
        marker = progress_marker(entry)
        moved = marker != self._marker or log_bytes != self._log_bytes
        if self.phase == "starting" and cpu_s is not None:
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
