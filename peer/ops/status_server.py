"""A tiny HTTP server on the daemon's event loop: ``/status`` (JSON snapshot) and ``/metrics`` (Prometheus text).

Both pages are rendered from one ``PeerMetrics.snapshot()`` per request, so they always agree with each other and
with the dashboard. The server speaks just enough HTTP/1.1 for curl, Prometheus and ``asyncmesh-peer status``: a GET
with at most ``MAX_REQUEST_BYTES`` of request line and headers, answered and closed. It binds to 127.0.0.1 by
default; bind to 0.0.0.0 only behind a firewall or inside a container whose port you publish on purpose.

Usage on the daemon's loop::

    server = StatusServer(metrics, port=config.metrics_port)
    await server.start()          # raises StatusServerError with advice if the port is taken
    ...
    await server.stop()

``prometheus_text(snapshot)`` and ``fetch_status(host, port)`` are usable on their own (the ``swarm`` parent polls its
children with the latter).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from collections.abc import Callable
from typing import Any

from peer.ops.metrics import STATES, PeerMetrics

logger = logging.getLogger(__name__)

DEFAULT_PORT = 9464
MAX_REQUEST_BYTES = 8192
MAX_RESPONSE_BYTES = 16 * 1024 * 1024

# (snapshot key, metric name, help) for the plain gauges
_GAUGES = (
    ("local_step", "asyncmesh_local_step", "Optimiser steps applied by this peer's stage."),
    ("tokens_per_s", "asyncmesh_tokens_per_second", "Training tokens processed per second over the rate window."),
    ("bytes_in_per_s", "asyncmesh_bytes_in_per_second", "Bytes received per second over the rate window."),
    ("bytes_out_per_s", "asyncmesh_bytes_out_per_second", "Bytes sent per second over the rate window."),
    ("bytes_per_token", "asyncmesh_bytes_per_token", "Bytes on the wire (both directions) per training token."),
    ("train_loss", "asyncmesh_train_loss", "Latest training loss seen by this peer."),
    ("val_loss", "asyncmesh_val_loss", "Latest validation loss seen by this peer."),
    ("pipeline_delay", "asyncmesh_pipeline_delay_steps", "Observed staleness of gradients, in local steps."),
    ("avg_tau", "asyncmesh_averaging_tau_steps", "Local steps the last averaging round took."),
    ("avg_fraction_per_step", "asyncmesh_averaging_fraction_per_step",
     "Weights averaged per local step since averaging started (the run asks for averaging.fraction)."),
    ("avg_delay_steps", "asyncmesh_averaging_delay_steps", "Mean local steps between a round's begin and finish."),
    ("avg_group_size", "asyncmesh_averaging_group_size", "Peers in the last successful averaging round."),
    ("inflight", "asyncmesh_inflight_microbatches", "Micro-batches awaiting their backward pass."),
    ("queued", "asyncmesh_queued_microbatches", "Work items queued for the compute thread."),
    ("uptime_s", "asyncmesh_uptime_seconds", "Seconds since the peer process started."),
    ("drain_remaining_s", "asyncmesh_drain_remaining_seconds", "Seconds left of the graceful drain."),
)


class StatusServerError(RuntimeError):
    """The status server could not start (the message says what to change)."""


def _label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(value: float | int) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    return repr(float(value)) if math.isfinite(value) else ("NaN" if math.isnan(value) else
                                                            ("+Inf" if value > 0 else "-Inf"))


def json_safe(value: Any) -> Any:
    """The snapshot with non-finite floats replaced by None, so that it is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def metric_name(counter: str) -> str:
    """Prometheus name of a PeerMetrics counter: ``bytes_out`` -> ``asyncmesh_bytes_out_total``."""
    base = re.sub(r"[^a-zA-Z0-9_]", "_", counter).strip("_") or "unnamed"
    return f"asyncmesh_{base.removesuffix('_total')}_total"


def prometheus_text(snap: dict[str, Any]) -> str:
    """Render a snapshot in the Prometheus text exposition format (version 0.0.4)."""
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[tuple[str, Any]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{labels} {_num(value)}" for labels, value in samples)

    info = {"peer_id": snap["peer_id"], "run_id": snap["run_id"],
            "stage": "" if snap["stage"] is None else snap["stage"]}
    family("asyncmesh_peer_info", "gauge", "Identity of this peer (value always 1).",
           [("{" + ",".join(f'{k}="{_label(v)}"' for k, v in info.items()) + "}", 1)])
    family("asyncmesh_state", "gauge", "1 for the state the peer is in, 0 for the others.",
           [(f'{{state="{s}"}}', int(snap["state"] == s)) for s in STATES])
    family("asyncmesh_healthy", "gauge", "1 when the peer is healthy (what `asyncmesh-peer status` checks).",
           [("", int(snap["healthy"]))])
    for key, name, help_text in _GAUGES:
        if snap.get(key) is not None:
            family(name, "gauge", help_text, [("", snap[key])])
    family("asyncmesh_tokens_total", "counter", "Training tokens processed by this peer.",
           [("", snap["tokens_total"])])
    for counter, value in sorted(snap["counters"].items()):
        if counter == "tokens" or counter.startswith("rejected:"):
            continue
        family(metric_name(counter), "counter", f"Count of {counter.replace('_', ' ')}.", [("", value)])
    if snap["rejected"]:
        family("asyncmesh_rejected_total", "counter", "Inputs from the network refused, by reason.",
               [(f'{{reason="{_label(r)}"}}', n) for r, n in sorted(snap["rejected"].items())])
    if snap["peers_per_stage"]:
        family("asyncmesh_swarm_peers", "gauge", "Peers the DHT shows per stage.",
               [(f'{{stage="{_label(s)}"}}', n) for s, n in snap["peers_per_stage"].items()])
    family("asyncmesh_warnings", "gauge", "Operator warnings currently shown.", [("", len(snap["warnings"]))])
    return "\n".join(lines) + "\n"


class StatusServer:
    """Serves ``/status`` and ``/metrics`` for one peer.

    Args:
        source: the peer's PeerMetrics, or any zero-argument callable returning a snapshot dict.
        host: interface to bind; 127.0.0.1 keeps it private to the machine.
        port: TCP port; 0 picks a free one (read ``.port`` after ``start()``).
        request_timeout_s: a client must send its request within this many seconds or is disconnected.
    """

    def __init__(self, source: PeerMetrics | Callable[[], dict[str, Any]], *, host: str = "127.0.0.1",
                 port: int = DEFAULT_PORT, request_timeout_s: float = 5.0) -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"status port must be 0-65535, got {port}")
        if request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be positive")
        self._snapshot = source.snapshot if isinstance(source, PeerMetrics) else source
        self.host, self.port, self.request_timeout_s = host, port, request_timeout_s
        self._server: asyncio.AbstractServer | None = None
        self.errors = 0

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._handle, self.host, self.port,
                                                      limit=MAX_REQUEST_BYTES, reuse_address=True)
        except OSError as e:
            raise StatusServerError(
                f"cannot serve status on {self.host}:{self.port} ({e.strerror or e}); another peer on this machine "
                f"may use it: pass --metrics-port with a free port (0 picks one)") from e
        self.port = self._server.sockets[0].getsockname()[1]
        logger.info("status on http://%s:%d/status, Prometheus metrics on /metrics", self.host, self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> StatusServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.request_timeout_s)
            request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
            parts = request_line.split()
            if len(parts) != 3 or not parts[2].startswith("HTTP/"):
                await self._reply(writer, 400, "text/plain", "malformed request line\n")
            elif parts[0] not in ("GET", "HEAD"):
                await self._reply(writer, 405, "text/plain", "only GET is supported\n")
            else:
                path = parts[1].split("?", 1)[0]
                if path == "/status":
                    body = json.dumps(json_safe(self._snapshot()), allow_nan=False)
                    await self._reply(writer, 200, "application/json", body, head_only=parts[0] == "HEAD")
                elif path == "/metrics":
                    await self._reply(writer, 200, "text/plain; version=0.0.4; charset=utf-8",
                                      prometheus_text(self._snapshot()), head_only=parts[0] == "HEAD")
                else:
                    await self._reply(writer, 404, "text/plain", "not found: try /status or /metrics\n")
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            self.errors += 1  # slow, truncated or oversized request: just hang up
        except Exception as e:  # a bug in rendering must not take the daemon down
            self.errors += 1
            logger.warning("status request failed: %r", e)
            await self._reply(writer, 500, "text/plain", "internal error\n")
        finally:
            writer.close()

    @staticmethod
    async def _reply(writer: asyncio.StreamWriter, code: int, ctype: str, body: str, *,
                     head_only: bool = False) -> None:
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
                  500: "Internal Server Error"}[code]
        data = body.encode()
        writer.write(f"HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(data)}\r\n"
                     f"Connection: close\r\n\r\n".encode() + (b"" if head_only else data))
        try:
            await writer.drain()
        except ConnectionError:
            pass


async def fetch_status(host: str, port: int, *, timeout: float = 2.0, path: str = "/status") -> dict[str, Any]:
    """GET a peer's ``/status`` snapshot. Raises OSError / TimeoutError / ValueError when it cannot."""

    async def _get() -> bytes:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            await writer.drain()
            chunks, size = [], 0
            while chunk := await reader.read(65536):
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_RESPONSE_BYTES:
                    raise ValueError(f"{host}:{port}{path} sent more than {MAX_RESPONSE_BYTES} bytes")
            return b"".join(chunks)
        finally:
            writer.close()

    raw = await asyncio.wait_for(_get(), timeout)
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].decode("latin-1")
    if " 200 " not in status_line + " ":
        raise ValueError(f"{host}:{port}{path} answered {status_line!r}")
    return json.loads(body)
