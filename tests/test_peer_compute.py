"""The compute thread: one thread, urgent jobs (averaging, state) before queued micro-batches, nothing lost."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from peer.compute import ComputeThread


def test_urgent_jobs_run_before_queued_ones_but_never_interrupt_the_running_one():
    compute, order, gate = ComputeThread("test"), [], threading.Event()

    async def main() -> None:
        running = asyncio.ensure_future(compute.run(lambda: (gate.wait(5), order.append("running"))))
        await asyncio.sleep(0.05)  # the first job holds the thread
        queued = [asyncio.ensure_future(compute.run(order.append, f"mb{i}")) for i in range(3)]
        await asyncio.sleep(0.01)
        urgent = asyncio.ensure_future(compute.run(order.append, "begin", urgent=True))
        await asyncio.sleep(0.01)
        gate.set()
        await asyncio.gather(running, urgent, *queued)

    try:
        asyncio.run(main())
    finally:
        compute.shutdown()
    assert order == ["running", "begin", "mb0", "mb1", "mb2"]


def test_results_exceptions_and_the_one_thread():
    compute = ComputeThread("test")
    try:
        async def names_of_threads() -> list[str]:
            jobs = (compute.run(lambda: threading.current_thread().name, urgent=i % 2 == 0) for i in range(6))
            return await asyncio.wait_for(asyncio.gather(*jobs), 5)

        names = asyncio.run(names_of_threads())
        assert set(names) == {"test"}

        def boom() -> None:
            raise ValueError("bad input")

        with pytest.raises(ValueError, match="bad input"):
            asyncio.run(compute.run(boom))
        assert asyncio.run(compute.run(sum, [1, 2, 3])) == 6  # the thread survived the exception
    finally:
        compute.shutdown()


def test_a_job_whose_caller_gave_up_is_skipped_and_shutdown_cancels_what_is_queued():
    compute, ran, gate = ComputeThread("test"), [], threading.Event()

    async def main() -> None:
        blocker = asyncio.ensure_future(compute.run(gate.wait, 5))
        await asyncio.sleep(0.05)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(compute.run(ran.append, "late", urgent=True), 0.05)
        gate.set()
        await blocker
        await compute.run(ran.append, "after")

    asyncio.run(main())
    assert ran == ["after"]  # the timed-out begin never ran on the worker
    gate2 = threading.Event()
    fut_block = compute.submit(gate2.wait, 5)
    queued = compute.submit(ran.append, "never")
    time.sleep(0.05)
    gate2.set()
    compute.shutdown(wait=True, cancel_futures=True)
    assert fut_block.result(1) is True and queued.cancelled() and ran == ["after"]
    with pytest.raises(RuntimeError):
        compute.submit(ran.append, "closed")
