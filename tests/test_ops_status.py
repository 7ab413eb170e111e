"""/status, /metrics and `asyncmesh-peer status` against a StatusServer on 127.0.0.1: same figures everywhere."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import threading
from collections.abc import Iterator

import pytest
from rich.console import Console

from peer.cli import status as cmd_status
from peer.errors import UserError
from peer.lifecycle import PeerState
from peer.ops.dashboard import Dashboard, human, human_bytes
from peer.ops.metrics import PeerMetrics
from peer.ops.status_server import (
    StatusServer,
    StatusServerError,
    fetch_status,
    json_safe,
    metric_name,
    prometheus_text,
)


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def busy_metrics(clock: FakeClock) -> PeerMetrics:
    m = PeerMetrics("12D3KooWstatus", 1, clock=clock, stall_s=60)
    m.run_id, m.n_stages = "abc123", 2
    m.observe_state(PeerState.TRAINING)
    for i in range(30):
        clock.t += 0.2
        m.inc("tokens", 300)
        m.inc("bytes_in", 5000)
        m.inc("bytes_out", 7000)
        m.local_step = i + 1
        m.observe_loss(4.0 - i * 0.01)
    m.observe_val(3.9)
    m.observe_round(ok=True, group_size=3, tau=2.0)
    m.inc("rejected:bad_tensor", 2)
    m.inc("rejected:wrong_run")
    m.set_swarm({0: 1, 1: 2})
    m.inflight, m.queued, m.pipeline_delay = 2, 1, 1.0
    return m


@pytest.fixture
def served() -> Iterator[tuple[PeerMetrics, FakeClock, int]]:
    """A status server on its own event loop in a thread (the CLI client under test is blocking)."""
    clock = FakeClock()
    metrics = busy_metrics(clock)
    loop = asyncio.new_event_loop()
    server = StatusServer(metrics, port=0, request_timeout_s=1.0)
    loop.run_until_complete(server.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield metrics, clock, server.port
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def parse_prometheus(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def raw_request(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=3) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def status_args(port: int, **kw: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cmd_status.add_arguments(parser)
    args = parser.parse_args(["--port", str(port)])
    vars(args).update(kw)
    return args


def test_status_json_metrics_and_dashboard_show_the_same_figures(served, capsys) -> None:
    metrics, clock, port = served
    snap = json_safe(metrics.snapshot())  # the fake clock stands still: every view sees this very snapshot
    assert cmd_status.run(status_args(port, json=True)) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == snap
    served_snap = asyncio.run(fetch_status("127.0.0.1", port))
    assert served_snap == snap
    prom = parse_prometheus(raw_request(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").split(b"\r\n\r\n")[1]
                            .decode())
    assert prom["asyncmesh_tokens_per_second"] == pytest.approx(snap["tokens_per_s"])
    assert prom["asyncmesh_tokens_total"] == snap["tokens_total"] == 9000
    assert prom["asyncmesh_local_step"] == snap["local_step"] == 30
    assert prom["asyncmesh_train_loss"] == pytest.approx(snap["train_loss"])
    assert prom["asyncmesh_val_loss"] == pytest.approx(3.9)
    assert prom["asyncmesh_bytes_sent_per_second"] == pytest.approx(snap["bytes_out_per_s"])
    assert prom["asyncmesh_bytes_per_token"] == pytest.approx(snap["bytes_per_token"])
    assert prom["asyncmesh_averaging_rounds_ok_total"] == 1 and prom["asyncmesh_averaging_group_size"] == 3
    assert prom['asyncmesh_state{state="training"}'] == 1 and prom['asyncmesh_state{state="draining"}'] == 0
    assert prom['asyncmesh_rejected_total{reason="bad_tensor"}'] == 2
    assert prom['asyncmesh_rejected_total{reason="wrong_run"}'] == 1
    assert prom['asyncmesh_swarm_peers{stage="1"}'] == 2
    assert prom["asyncmesh_healthy"] == 1
    console = Console(record=True, width=80, color_system=None)
    console.print(Dashboard(snap).render())
    text = console.export_text()
    assert f"step {snap['local_step']}" in text
    assert f"{human(snap['tokens_per_s'])} tok/s" in text
    assert f"train {snap['train_loss']:.3f}" in text
    assert f"out {human_bytes(snap['bytes_out_per_s'], '/s')}" in text
    assert human_bytes(snap["bytes_per_token"]) + "/token" in text


def test_status_exit_codes(served, capsys) -> None:
    metrics, clock, port = served
    assert cmd_status.run(status_args(port)) == cmd_status.EXIT_HEALTHY
    assert "stage 1 training step 30" in capsys.readouterr().out
    clock.t += 120  # no progress for 120 s > stall_s
    assert cmd_status.run(status_args(port)) == cmd_status.EXIT_UNHEALTHY
    assert "UNHEALTHY: no training progress" in capsys.readouterr().out
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert cmd_status.run(status_args(free, json=True)) == cmd_status.EXIT_UNREACHABLE
    out = capsys.readouterr()
    assert json.loads(out.out)["reachable"] is False and f"--metrics-port {free}" in out.err
    with pytest.raises(UserError, match="--port"):
        cmd_status.run(status_args(0))


def test_bad_requests_get_clear_answers_and_never_break_the_server(served) -> None:
    metrics, clock, port = served
    assert raw_request(port, b"GET /nope HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404")
    assert raw_request(port, b"POST /status HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405")
    assert raw_request(port, b"garbage\r\n\r\n").startswith(b"HTTP/1.1 400")
    assert raw_request(port, b"GET /status HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n") == b""  # too long: hang up
    head = raw_request(port, b"HEAD /metrics HTTP/1.1\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and head.endswith(b"\r\n\r\n")
    metrics.pipeline_delay = float("nan")  # a NaN must not make /status invalid JSON
    assert asyncio.run(fetch_status("127.0.0.1", port))["pipeline_delay"] is None
    assert asyncio.run(fetch_status("127.0.0.1", port))["local_step"] == 30


def test_port_in_use_says_what_to_do() -> None:
    async def main() -> None:
        async with StatusServer(PeerMetrics(), port=0) as first:
            with pytest.raises(StatusServerError, match="--metrics-port"):
                await StatusServer(PeerMetrics(), port=first.port).start()

    asyncio.run(main())


def test_prometheus_names_and_format() -> None:
    assert metric_name("bytes_out") == "asyncmesh_bytes_sent_total"
    assert metric_name("bytes_in") == "asyncmesh_bytes_received_total"
    assert metric_name("weird-name.x_total") == "asyncmesh_weird_name_x_total"
    text = prometheus_text(PeerMetrics("p").snapshot())
    assert "asyncmesh_train_loss" not in text  # no loss yet: the series is absent, not 0
    for line in text.splitlines():
        assert line.startswith("# ") or re.fullmatch(r"asyncmesh_[a-z_]+(\{[^}]*\})? \S+", line), line
