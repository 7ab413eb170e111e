"""The compute thread: the one thread that touches a peer's model, with short control jobs ahead of queued work.

Every forward, backward and optimiser step runs on one dedicated thread (they share the worker's tensors; torch
uses its own threads inside each job). Micro-batches queue up there: on a busy stage a few of them may wait for a
second or more. An averaging round must begin within its exchange window (0.6 of the run's ``period_s``), so its
begin, finish and abort, and the state snapshots and loads of state sync, are *urgent*: they run before any queued
micro-batch (never in the middle of one). Jumping the queue is safe for training: a micro-batch's backward uses the
weights its forward used whatever lands between them (the worker stashes them first), so an urgent job only moves an
averaging or a state load a little earlier, as if the network had been a little faster.

**A device of its own, on a shared test bed** (``DevicePace``). Peers that share a machine's cores fill each other's
idle time: while one waits on the network another computes faster, and peers that compute at the same moments slow
each other. Users run one peer per GPU, where idle time is lost and nobody else's work slows yours, so a bench that
packs 4-8 peers onto 2 cores measures a machine nobody runs (docs/performance.md has a case it flattered the
asynchronous mode in). ``--set compute_pace=F`` makes every job last F times the CPU time its own thread used (it
sleeps the rest): each peer then behaves as a device of its own, 1/F the speed of one core, as long as the machine has
the cores for that (a job that already took longer counts as an overrun: the bed was too small for F).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")
URGENT, NORMAL = 0, 1
_STOP = object()


class DevicePace:
    """Make jobs last ``factor`` x the CPU time of the thread that runs them (module docstring; 0: no pacing).

    The CPU time is the thread's own (``time.thread_time``), so the work must run on that thread: torch with one
    intra-op thread on the CPU (``torch_threads = 1``), never a GPU.
    """

    def __init__(self, factor: float = 0.0) -> None:
        if factor and not (factor >= 1.0 and factor < float("inf")):
            raise ValueError(f"compute_pace must be 0 (off) or a finite factor >= 1, got {factor}")
        self.factor = factor
        self.jobs = self.overruns = 0
        self.cpu_s = self.slept_s = 0.0

    @contextmanager
    def job(self) -> Iterator[None]:
        """Time the body; on the way out (also on an error) sleep until it has lasted factor x its CPU time."""
        if not self.factor:
            yield
            return
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            cpu = time.thread_time() - c0
            rest = self.factor * cpu - (time.perf_counter() - t0)
            self.jobs += 1
            self.cpu_s += cpu
            if rest > 0:
                time.sleep(rest)
                self.slept_s += rest
            elif cpu > 0.001:  # sub-millisecond jobs overrun by scheduling noise alone
                self.overruns += 1

    def stats(self) -> dict[str, float]:
        """For the peer's summary: jobs paced, the share that overran, CPU and sleep seconds."""
        return {"factor": self.factor, "jobs": self.jobs, "overruns": self.overruns,
                "overrun_share": round(self.overruns / self.jobs, 4) if self.jobs else 0.0,
                "cpu_s": round(self.cpu_s, 3), "slept_s": round(self.slept_s, 3)}


class ComputeThread:
    """One worker thread with two priorities (FIFO within each).

    Args:
        name: the thread's name (shows in py-spy and tracebacks).
        pace: a ``DevicePace`` every job runs under (test beds only; the default paces nothing).
    """

    def __init__(self, name: str = "compute", *, pace: DevicePace | None = None) -> None:
        self.pace = pace if pace is not None else DevicePace()
        self._jobs: queue.PriorityQueue[tuple[int, int, Any]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    async def run(self, fn: Callable[..., T], *args: Any, urgent: bool = False) -> T:
        """Run ``fn(*args)`` on the thread; ``urgent`` jobs go before every queued normal one."""
        return await asyncio.wrap_future(self.submit(fn, *args, urgent=urgent))

    def submit(self, fn: Callable[..., T], *args: Any, urgent: bool = False) -> concurrent.futures.Future[T]:
        if self._closed:
            raise RuntimeError("the compute thread has been shut down")
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((URGENT if urgent else NORMAL, next(self._seq), (fut, fn, args)))
        return fut

    def pending(self) -> int:
        """Jobs waiting (not counting the one running)."""
        return self._jobs.qsize()

    def shutdown(self, *, wait: bool = True, cancel_futures: bool = False) -> None:
        """Stop taking jobs; with ``cancel_futures`` the queued ones are cancelled, else they run first."""
        self._closed = True
        if cancel_futures:
            while True:
                try:
                    _, _, job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not _STOP:
                    job[0].cancel()
        self._jobs.put((NORMAL + 1, next(self._seq), _STOP))
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _work(self) -> None:
        while True:
            _, _, job = self._jobs.get()
            if job is _STOP:
                return
            fut, fn, args = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                with self.pace.job():
                    result = fn(*args)
            except BaseException as e:  # handed to the awaiting coroutine, as an executor does
                fut.set_exception(e)
            else:
                fut.set_result(result)
