"""The compute thread: the one thread that touches a peer's model, with short control jobs ahead of queued work.

Every forward, backward and optimiser step runs on one dedicated thread (they share the worker's tensors; torch
uses its own threads inside each job). Micro-batches queue up there: on a busy stage a few of them may wait for a
second or more. An averaging round must begin within its exchange window (0.6 of the run's ``period_s``), so its
begin, finish and abort, and the state snapshots and loads of state sync, are *urgent*: they run before any queued
micro-batch (never in the middle of one). Jumping the queue is safe for training: a micro-batch's backward uses the
weights its forward used whatever lands between them (the worker stashes them first), so an urgent job only moves an
averaging or a state load a little earlier, as if the network had been a little faster.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
URGENT, NORMAL = 0, 1
_STOP = object()


class ComputeThread:
    """One worker thread with two priorities (FIFO within each).

    Args:
        name: the thread's name (shows in py-spy and tracebacks).
    """

    def __init__(self, name: str = "compute") -> None:
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
                result = fn(*args)
            except BaseException as e:  # handed to the awaiting coroutine, as an executor does
                fut.set_exception(e)
            else:
                fut.set_result(result)
