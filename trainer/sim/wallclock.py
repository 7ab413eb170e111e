"""Wall-clock model: how long a pipeline x data-parallel mesh takes per sample, by discrete-event simulation.

The convergence simulator (``trainer/sim/simulator.py``) counts samples and optimiser steps, not seconds. This module
turns a mesh (compute time per stage, link latency and bandwidth, payload sizes) into simulated time for the two
schedules we compare:

* **sync** — GPipe with ``M`` micro-batches and a flush per step: every stage runs its ``M`` forwards, the last stage
  then starts the backwards, and when a stage has run its last backward it all-reduces its gradients over the
  data-parallel link (ring all-reduce, fp32) and steps. The next step starts when every stage has stepped. With zero
  link time one step takes ``(M + K - 1) * (f + b)``; every hop adds its latency and transfer time on the critical
  path, ``2 (K - 1)`` of them per step.
* **async** — PipeDream 1F1B with an in-flight window ``W``: stage 0 starts a new micro-batch whenever fewer than
  ``W`` are between their first forward and their last backward; every stage runs a ready backward before a ready
  forward and steps after each backward. Throughput is bounded by the slowest stage, and by ``W / RTT`` when the
  window is smaller than round-trip time x rate. Sparse averaging rounds (``p`` of the stage's weights, in
  ``avg_bytes_per_param`` bytes each) start after every step and queue on the stage's data-parallel link in the
  background; a stage stalls only when more than ``max_pending_rounds`` rounds are still in flight, i.e. when the
  averaging traffic is bandwidth-bound.

Events are real: a heap of timestamped events drives per-stage compute servers and per-link FIFO channels
(serialisation at the link's bandwidth, then propagation latency); nothing is read off a closed formula. All
replicas are identical and run in lock-step, so one pipeline is simulated and the ring all-reduce over ``R``
replicas is played as its ``2 (R - 1)`` chained transfers of ``bytes / R`` on the stage's data-parallel link.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypedDict

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class MeshTiming:
    """Compute and network costs of one pipeline replica; all times in seconds, sizes in bytes."""

    fwd_s: tuple[float, ...]
    """Forward time of one micro-batch on each stage (one entry per stage)."""
    bwd_s: tuple[float, ...]
    """Backward time of one micro-batch on each stage, including the optimiser step that follows it."""
    stage_params: tuple[int, ...]
    """Parameters held by each stage (sizes the all-reduce and the averaging payload)."""
    activation_bytes: float
    """Bytes of one micro-batch's activations on a pipeline hop (after compression); gradients are the same size."""
    n_replicas: int = 2
    """Data-parallel replicas of every stage."""
    link_latency_s: float = 0.0
    """One-way latency of every pipeline link."""
    link_bandwidth: float = math.inf
    """Bytes per second of every pipeline link, per direction."""
    dp_latency_s: float | None = None
    """One-way latency of the data-parallel links; None uses link_latency_s."""
    dp_bandwidth: float | None = None
    """Bytes per second of each stage's data-parallel link; None uses link_bandwidth."""

    def __post_init__(self) -> None:
        k = len(self.fwd_s)
        if k < 1 or len(self.bwd_s) != k or len(self.stage_params) != k:
            raise ValueError("fwd_s, bwd_s and stage_params need one entry per stage (and at least one stage)")
        if min(self.fwd_s + self.bwd_s) < 0 or min(self.stage_params) < 0 or self.activation_bytes < 0:
            raise ValueError("compute times, parameter counts and activation_bytes must be >= 0")
        if self.n_replicas < 1:
            raise ValueError(f"n_replicas must be >= 1, got {self.n_replicas}")
        if self.link_latency_s < 0 or (self.dp_latency_s or 0.0) < 0:
            raise ValueError("latencies must be >= 0")
        if self.link_bandwidth <= 0 or (self.dp_bandwidth is not None and self.dp_bandwidth <= 0):
            raise ValueError("bandwidths must be > 0 bytes/s (use math.inf for an ideal link)")

    @property
    def n_stages(self) -> int:
        return len(self.fwd_s)

    @property
    def dp_lat(self) -> float:
        return self.link_latency_s if self.dp_latency_s is None else self.dp_latency_s

    @property
    def dp_bw(self) -> float:
        return self.link_bandwidth if self.dp_bandwidth is None else self.dp_bandwidth


@dataclass(frozen=True)
class ScheduleResult:
    """Simulated time of one schedule."""

    seconds_per_microbatch: float
    """Steady-state wall-clock per micro-batch of one replica (the whole mesh processes R of them in that time)."""
    total_s: float
    """Simulated time of the whole run, fill and drain included."""
    microbatches: int
    """Micro-batches per replica that the run processed."""
    stall_s: float = 0.0
    """Time stages spent blocked on averaging traffic (async only)."""
    detail: dict[str, float] = field(default_factory=dict)


class EventLoop:
    """A minimal discrete-event core: callbacks ordered by (time, insertion order)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, when: float, fn: Callable[[], None]) -> None:
        assert when >= self.now - 1e-12, "events cannot be scheduled in the past"
        heapq.heappush(self._heap, (when, next(self._seq), fn))

    def run(self) -> float:
        while self._heap:
            self.now, _, fn = heapq.heappop(self._heap)
            fn()
        return self.now


class Link:
    """A FIFO channel: a message is serialised at ``bandwidth`` after the previous one, then travels ``latency``."""

    def __init__(self, loop: EventLoop, latency_s: float, bandwidth: float) -> None:
        self.loop, self.latency_s, self.bandwidth = loop, latency_s, bandwidth
        self._free_at = 0.0

    def send(self, nbytes: float, on_arrival: Callable[[], None]) -> None:
        start = max(self.loop.now, self._free_at)
        tx = 0.0 if math.isinf(self.bandwidth) else nbytes / self.bandwidth
        self._free_at = start + tx
        self.loop.at(start + tx + self.latency_s, on_arrival)


class Stage:
    """One device: runs queued tasks one at a time, picking by a priority policy whenever it is idle."""

    def __init__(self, loop: EventLoop, backward_first: bool) -> None:
        self.loop, self.backward_first = loop, backward_first
        self.fwd: deque[tuple[float, Callable[[], None]]] = deque()
        self.bwd: deque[tuple[float, Callable[[], None]]] = deque()
        self.busy = False
        self.gate: Callable[[], bool] = lambda: True  # may a backward start now? (async averaging back-pressure)
        self.busy_s = 0.0

    def submit(self, kind: str, duration: float, on_done: Callable[[], None]) -> None:
        (self.fwd if kind == "f" else self.bwd).append((duration, on_done))
        self.kick()

    def kick(self) -> None:
        if self.busy:
            return
        can_b = bool(self.bwd) and self.gate()
        order = (("b", can_b), ("f", bool(self.fwd))) if self.backward_first else (("f", bool(self.fwd)), ("b", can_b))
        for kind, ready in order:
            if ready:
                duration, on_done = (self.bwd if kind == "b" else self.fwd).popleft()
                self.busy = True
                self.busy_s += duration
                self.loop.at(self.loop.now + duration, functools.partial(self._finish, on_done))
                return

    def _finish(self, on_done: Callable[[], None]) -> None:
        self.busy = False
        on_done()
        self.kick()


def _ring_allreduce(loop: EventLoop, link: Link, nbytes: float, n: int, on_done: Callable[[], None]) -> None:
    """Play a ring all-reduce of ``nbytes`` over ``n`` peers: 2 (n - 1) chained transfers of nbytes / n each."""
    steps = 2 * (n - 1)
    if steps == 0 or nbytes == 0:
        loop.at(loop.now, on_done)
        return

    def step(i: int) -> None:
        if i == steps:
            on_done()
        else:
            link.send(nbytes / n, lambda: step(i + 1))

    step(0)


class _StepCounts(TypedDict):
    """One synchronous step's progress: forwards through the last stage, backwards done per stage."""

    fwd_last: int
    bwd: list[int]


def _steady_slope(times: list[float]) -> float:
    """Seconds per completion in steady state: least-squares slope over the middle half (fill and drain ignored).

    Completions can come in periodic bursts (e.g. 3, 3, 9 when one stage is slow); a least-squares fit averages
    such a pattern out far better than the difference of two end points.
    """
    lo, hi = len(times) // 4, (3 * len(times)) // 4
    xs, ys = range(lo, hi), times[lo:hi]
    mx, my = sum(xs) / len(ys), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def simulate_sync(mesh: MeshTiming, *, micro_batches: int, steps: int = 4,
                  grad_bytes_per_param: float = 4.0) -> ScheduleResult:
    """GPipe with ``micro_batches`` per step, flush per step, fp32 gradient all-reduce over the replicas."""
    if micro_batches < 1 or steps < 1:
        raise ValueError("micro_batches and steps must be >= 1")
    loop, k, m = EventLoop(), mesh.n_stages, micro_batches
    stages = [Stage(loop, backward_first=False) for _ in range(k)]
    down = [Link(loop, mesh.link_latency_s, mesh.link_bandwidth) for _ in range(k - 1)]
    up = [Link(loop, mesh.link_latency_s, mesh.link_bandwidth) for _ in range(k - 1)]
    dp = [Link(loop, mesh.dp_lat, mesh.dp_bw) for _ in range(k)]
    step_ends: list[float] = []
    state = {"step": 0, "stages_done": 0}

    def start_step() -> None:
        state["stages_done"] = 0
        counts = _StepCounts(fwd_last=0, bwd=[0] * k)
        for mb in range(m):
            forward(0, mb, counts)

    def forward(s: int, mb: int, counts: _StepCounts) -> None:
        def done() -> None:
            if s + 1 < k:
                down[s].send(mesh.activation_bytes, lambda: forward(s + 1, mb, counts))
                return
            counts["fwd_last"] += 1
            if counts["fwd_last"] == m:  # GPipe: the last stage starts backwards once every forward is through
                for j in range(m):
                    backward(k - 1, j, counts)
        stages[s].submit("f", mesh.fwd_s[s], done)

    def backward(s: int, mb: int, counts: _StepCounts) -> None:
        def done() -> None:
            counts["bwd"][s] += 1
            if s > 0:
                up[s - 1].send(mesh.activation_bytes, lambda: backward(s - 1, mb, counts))
            if counts["bwd"][s] == m:
                _ring_allreduce(loop, dp[s], mesh.stage_params[s] * grad_bytes_per_param, mesh.n_replicas, stage_done)
        stages[s].submit("b", mesh.bwd_s[s], done)

    def stage_done() -> None:
        state["stages_done"] += 1
        if state["stages_done"] == k:  # flush: every stage has reduced its gradients and stepped
            step_ends.append(loop.now)
            state["step"] += 1
            if state["step"] < steps:
                start_step()

    loop.at(0.0, start_step)
    total = loop.run()
    per_step = step_ends[-1] - step_ends[-2] if steps > 1 else step_ends[0]
    return ScheduleResult(per_step / m, total, steps * m, detail={"step_s": per_step})


def simulate_async(mesh: MeshTiming, *, inflight: int, microbatches: int | None = None, avg_fraction: float = 0.0,
                   avg_bytes_per_param: float = 1.0, max_pending_rounds: int = 10) -> ScheduleResult:
    """PipeDream 1F1B with an in-flight window, a step after every backward, and background sparse averaging.

    ``avg_fraction`` 0 disables averaging. ``max_pending_rounds`` is how many averaging rounds a stage tolerates in
    flight (tau in the convergence simulator) before it waits for one to finish. ``microbatches`` defaults to
    ``max(400, 10 * inflight)`` so the measured middle half lies well past the fill of a wide window.
    """
    if microbatches is None:
        microbatches = max(400, 10 * inflight)
    if inflight < 1 or microbatches < 4:
        raise ValueError("inflight must be >= 1 and microbatches >= 4")
    if not 0.0 <= avg_fraction <= 1.0 or max_pending_rounds < 0:
        raise ValueError("avg_fraction must be in [0, 1] and max_pending_rounds >= 0")
    loop, k = EventLoop(), mesh.n_stages
    stages = [Stage(loop, backward_first=True) for _ in range(k)]
    down = [Link(loop, mesh.link_latency_s, mesh.link_bandwidth) for _ in range(k - 1)]
    up = [Link(loop, mesh.link_latency_s, mesh.link_bandwidth) for _ in range(k - 1)]
    dp = [Link(loop, mesh.dp_lat, mesh.dp_bw) for _ in range(k)]
    pending = [0] * k
    blocked_since: list[float | None] = [None] * k
    stall = [0.0] * k
    done_at: list[float] = []
    state = {"issued": 0, "inflight": 0}
    averaging = avg_fraction > 0 and mesh.n_replicas > 1

    for s in range(k):
        def gate(s: int = s) -> bool:
            ok = not averaging or pending[s] <= max_pending_rounds
            if not ok and blocked_since[s] is None:
                blocked_since[s] = loop.now
            return ok
        stages[s].gate = gate

    def inject() -> None:
        while state["inflight"] < inflight and state["issued"] < microbatches:
            state["issued"] += 1
            state["inflight"] += 1
            forward(0)

    def forward(s: int) -> None:
        def done() -> None:
            if s + 1 < k:
                down[s].send(mesh.activation_bytes, lambda: forward(s + 1))
            else:
                backward(s)
        stages[s].submit("f", mesh.fwd_s[s], done)

    def backward(s: int) -> None:
        def done() -> None:
            if averaging:
                pending[s] += 1
                nbytes = avg_fraction * mesh.stage_params[s] * avg_bytes_per_param
                _ring_allreduce(loop, dp[s], nbytes, mesh.n_replicas, lambda: round_done(s))
            if s > 0:
                up[s - 1].send(mesh.activation_bytes, lambda: backward(s - 1))
            else:
                done_at.append(loop.now)
                state["inflight"] -= 1
                inject()
        stages[s].submit("b", mesh.bwd_s[s], done)

    def round_done(s: int) -> None:
        pending[s] -= 1
        since = blocked_since[s]
        if since is not None:
            stall[s] += loop.now - since
            blocked_since[s] = None
        stages[s].kick()

    loop.at(0.0, inject)
    total = loop.run()
    per_mb = _steady_slope(done_at)
    busiest = max(st.busy_s for st in stages)
    return ScheduleResult(per_mb, total, microbatches, stall_s=max(stall),
                          detail={"utilisation": busiest / total if total else 1.0})
