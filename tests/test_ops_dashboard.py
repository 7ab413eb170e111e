"""The dashboard, driven by a PeerMetrics we write into by hand and rendered into a recorded 80-column console."""

from __future__ import annotations

import asyncio
import re
import time

import pytest
from rich.console import Console

from peer.lifecycle import PeerState
from peer.ops.dashboard import Dashboard, human, human_bytes, short_id, sparkline, swarm_tokens_per_s
from peer.ops.metrics import PeerMetrics


class FakeClock:
    def __init__(self) -> None:
        self.t = 500.0

    def __call__(self) -> float:
        return self.t


def render(dash: Dashboard) -> str:
    console = Console(record=True, width=80, color_system=None)
    console.print(dash.render())
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    return text


def driven_metrics(clock: FakeClock, steps: int) -> PeerMetrics:
    m = PeerMetrics("12D3KooWQxYfV9m2rN4tZk8pLbH3sJ7cA1dE5gU6wXyZ", 2, clock=clock)
    m.n_stages = 3
    m.observe_state(PeerState.TRAINING)
    for i in range(steps):
        clock.t += 0.25
        m.inc("tokens", 256)
        m.inc("bytes_in", 4096)
        m.inc("bytes_out", 1024)
        m.local_step = i + 1
        m.observe_loss(5.0 - 0.01 * i)
    return m


def test_formatting_helpers() -> None:
    assert human(1234.0) == "1.2k" and human(5_000_000) == "5.0M" and human(12) == "12" and human(None) == "-"
    assert human_bytes(1500, "/s") == "1.5 kB/s" and human_bytes(12) == "12 B"
    assert sparkline([3, 2, 1]) == "█▅▁" and sparkline([1, 1]) == "▁▁" and sparkline([]) == ""
    assert len(sparkline(list(range(100)), 10)) == 10
    assert short_id("12D3KooWabcdefghijk") == "…defghijk" and short_id("") == "?"


def test_single_peer_panel_shows_every_field_and_values_move() -> None:
    clock = FakeClock()
    m = driven_metrics(clock, 40)
    m.pipeline_delay, m.inflight, m.queued = 2.0, 3, 1
    m.observe_val(4.75)
    m.observe_round(ok=True, group_size=2, tau=5.0)
    m.inc("microbatches_dropped")
    m.inc("retries", 2)
    m.inc("rejected:bad_tensor", 4)
    m.set_swarm({0: 1, 1: 1, 2: 2})
    m.warn("averaging found no partner")
    dash = Dashboard(m)
    first = render(dash)
    for expected in ("stage 2/3", "training", "step 40", "1.0k tok/s", "train 4.610", "val 4.750",
                     "pipeline 2.0 steps", "averaging τ 5.0 steps", "in flight 3", "queued 1", "dropped 1",
                     "retries 2", "in 16.4 kB/s", "out 4.1 kB/s", "20 B/token", "rounds 1 ok / 0 failed",
                     "group 2", "stage 2: 2 (me)", "bad_tensor 4", "averaging found no partner"):
        assert expected in first, expected
    for _ in range(40):  # twice as fast now
        clock.t += 0.125
        m.inc("tokens", 256)
        m.local_step += 1
    second = render(dash)
    assert "step 80" in second
    tps = [float(re.search(r"· ([\d.]+)k tok/s", t).group(1)) for t in (first, second)]
    assert tps[1] > tps[0]


def test_draining_shows_a_countdown() -> None:
    clock = FakeClock()
    m = driven_metrics(clock, 4)
    m.inflight = 2
    m.observe_state(PeerState.DRAINING, 30.0)
    clock.t += 12
    text = render(Dashboard(m))
    assert "draining" in text and "18 s left · 2 in flight" in text


def test_swarm_table_lists_peers_marks_unreachable_and_sums_the_last_stage() -> None:
    clock = FakeClock()
    snaps = []
    for stage in (0, 1, 1):
        m = driven_metrics(clock, 8)
        m.stage, m.peer_id = stage, f"12D3KooWpeer{stage}x{len(snaps)}"
        snaps.append(m.snapshot())
    snaps.append({"name": "peer 4", "error": "connection refused"})
    assert swarm_tokens_per_s(snaps) == pytest.approx(snaps[0]["tokens_per_s"]) and snaps[0]["tokens_per_s"] > 0
    dash = Dashboard([])
    dash.update(snaps)
    text = render(dash)
    for s in snaps[:3]:
        assert s["peer_id"][-8:] in text
    assert "3/4 peers up" in text and "stages 0:1 1:2" in text
    assert "peer 4: not answering (connection refused)" in text


def test_run_refreshes_on_the_loop_and_stops() -> None:
    clock = FakeClock()
    m = driven_metrics(clock, 2)
    console = Console(record=True, width=80, force_terminal=True)
    dash = Dashboard(m, console=console, refresh_hz=50, linger_s=0)

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(dash.run(stop))
        await asyncio.sleep(0.1)
        m.local_step = 777
        await asyncio.sleep(0.1)
        stop.set()
        await asyncio.wait_for(task, 2)

    asyncio.run(main())
    assert "step 777" in console.export_text()
    assert dash.render_s < 0.05  # cheap enough to draw on the training loop


def test_run_keeps_drawing_the_drain_after_stop_until_the_peer_stops() -> None:
    m = PeerMetrics("12D3KooWdrain", 0)
    m.observe_state(PeerState.TRAINING)
    console = Console(record=True, width=80, force_terminal=True)
    dash = Dashboard(m, console=console, refresh_hz=50, linger_s=5)

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(dash.run(stop))
        await asyncio.sleep(0.05)
        stop.set()  # what the daemon's signal handler does first
        await asyncio.sleep(0.05)
        m.observe_state(PeerState.DRAINING, 10.0)  # then its shutdown
        await asyncio.sleep(0.2)
        assert not task.done()
        m.observe_state(PeerState.STOPPED)
        await asyncio.wait_for(task, 2)

    asyncio.run(main())
    text = console.export_text()
    assert "draining" in text and "s left" in text and "stopped" in text


def test_run_stops_lingering_after_the_drain_deadline() -> None:
    m = PeerMetrics("p", 0)
    m.observe_state(PeerState.TRAINING)
    dash = Dashboard(m, console=Console(record=True, width=80), refresh_hz=50, linger_s=0.2)

    async def main() -> float:
        stop = asyncio.Event()
        stop.set()
        m.observe_state(PeerState.DRAINING, 0.3)  # a peer stuck in its drain
        t0 = time.monotonic()
        await asyncio.wait_for(dash.run(stop), 3)
        return time.monotonic() - t0

    assert 0.45 <= asyncio.run(main()) < 2.0
    swarm = Dashboard([], console=Console(record=True, width=80), refresh_hz=50)

    async def swarm_main() -> None:
        stop = asyncio.Event()
        stop.set()
        await asyncio.wait_for(swarm.run(stop), 1)  # a list source ends as soon as stop is set

    asyncio.run(swarm_main())


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="refresh_hz"):
        Dashboard([], refresh_hz=0)
    with pytest.raises(ValueError, match="linger_s"):
        Dashboard([], linger_s=-1)
