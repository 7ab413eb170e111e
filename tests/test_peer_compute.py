"""The compute thread: one thread, urgent jobs (averaging, state) before queued micro-batches, nothing lost."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from peer.compute import ComputeThread, DevicePace


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


def _spin(seconds: float) -> float:
    """Burn this thread's CPU for about ``seconds``; returns the CPU time used."""
    c0 = time.thread_time()
    while time.thread_time() - c0 < seconds:
        pass
    return time.thread_time() - c0


def test_a_paced_job_lasts_its_factor_times_its_own_cpu_time_and_sleeping_costs_none():
    compute = ComputeThread("test", pace=DevicePace(4.0))
    try:
        async def timed(fn, *args):
            t0 = time.perf_counter()
            await compute.run(fn, *args)
            return time.perf_counter() - t0

        busy = asyncio.run(timed(_spin, 0.05))
        assert 0.2 <= busy < 0.35  # 4 x 0.05 s of CPU, the rest slept
        idle = asyncio.run(timed(time.sleep, 0.1))
        assert idle < 0.15  # waiting is not computing: no pad for a job that used no CPU
        with pytest.raises(ValueError, match="bad input"):
            asyncio.run(compute.run(lambda: (_spin(0.02), int("bad input"))))  # paced on the way out too
        stats = compute.pace.stats()
        assert stats["jobs"] == 3 and stats["factor"] == 4.0
        assert stats["slept_s"] >= 0.15 + 0.06 - 0.02 and 0.07 <= stats["cpu_s"] < 0.12
    finally:
        compute.shutdown()


def test_a_job_that_already_took_longer_than_its_pace_counts_as_an_overrun():
    pace = DevicePace(1.0)  # a factor of 1 leaves no slack: any wait inside a job overruns
    with pace.job():
        _spin(0.01)
        time.sleep(0.05)
    assert pace.stats()["overruns"] == 1 and pace.stats()["slept_s"] == 0.0
    off = DevicePace()
    with off.job():
        _spin(0.005)
    assert off.stats()["jobs"] == 0  # off: nothing timed, nothing slept


@pytest.mark.parametrize("factor", [0.5, -1.0, float("inf"), float("nan")])
def test_a_pace_below_one_or_not_finite_is_refused(factor):
    with pytest.raises(ValueError, match="compute_pace must be 0"):
        DevicePace(factor)


def test_the_peer_config_asks_for_one_cpu_thread_before_it_paces():
    from peer.config import PeerConfig

    assert PeerConfig(compute_pace=4, torch_threads=1).compute_pace == 4
    for bad in ({"torch_threads": 0}, {"torch_threads": 2}, {"torch_threads": 1, "device": "cuda"}):
        with pytest.raises(ValueError, match="needs --torch-threads 1 and --device cpu"):
            PeerConfig(compute_pace=4, **bad)
