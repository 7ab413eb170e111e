"""The compute time of a stage's micro-batches, and the throughput the peer announces from it.

A stage's throughput is what routing weighs and what a joining peer compares stages by, so it is measured where it
is spent: on the compute thread, queue waits excluded, as the median forward + backward seconds of the last
``THROUGHPUT_WINDOW`` micro-batches (a median: one descheduled micro-batch must not move it; docs/design.md, step 3).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from peer.seams import Compute

T = TypeVar("T")

THROUGHPUT_WINDOW = 32  # micro-batches whose compute time the announced throughput is the median of


class ComputeMeter:
    """Times the compute of one stage's micro-batches.

    Args:
        compute: ``await compute(fn, *args)`` runs ``fn`` on the compute thread.
        cost: the stage's work units per micro-batch (its share of the model's compute).
        is_last: whether this is the last stage, whose forward computes the loss and the backward in the same call
            (a forward timed there is a whole micro-batch).
    """

    def __init__(self, compute: Compute, *, cost: float, is_last: bool) -> None:
        self.compute, self.cost, self.is_last = compute, cost, is_last
        self.compute_s_per_mb = 0.0  # median forward+backward seconds of one micro-batch over the last few
        self._recent_s: deque[float] = deque(maxlen=THROUGHPUT_WINDOW)
        self._fwd_s: dict[int, float] = {}
        self.on_first_measure: Callable[[], object] | None = None
        """Called once, when the first micro-batch has been timed: the announced throughput stops being a guess."""

    def throughput(self) -> float:
        """Announced work units per second: micro-batches/s of compute times this stage's cost."""
        return self.cost / self.compute_s_per_mb if self.compute_s_per_mb > 0 else 0.0

    async def timed(self, mb_id: int, backward: bool, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the compute thread, timing it there, and return its result."""
        def run() -> tuple[T, float]:
            t0 = time.perf_counter()
            out = fn(*args)
            return out, time.perf_counter() - t0
        out: T
        out, seconds = await self.compute(run)
        self.record(mb_id, seconds, backward=backward)
        return out

    def record(self, mb_id: int, seconds: float, *, backward: bool) -> None:
        """``seconds`` of compute of micro-batch ``mb_id``: a forward is kept until its backward completes it."""
        if not backward:
            self._fwd_s[mb_id] = seconds
            if not self.is_last:
                return
        total = seconds + self._fwd_s.pop(mb_id, 0.0)
        first = not self.compute_s_per_mb
        self._recent_s.append(total)
        self.compute_s_per_mb = statistics.median(self._recent_s)
        if first and self.on_first_measure is not None:
            self.on_first_measure()

    def forget(self, mb_id: int) -> None:
        """Micro-batch ``mb_id`` was dropped: its forward's time counts for nothing."""
        self._fwd_s.pop(mb_id, None)
