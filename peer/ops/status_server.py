"""A tiny HTTP server on the daemon's event loop: ``/status`` (JSON snapshot) and ``/metrics`` (Prometheus text).

Both pages are rendered from ``PeerMetrics.snapshot()`` at request time, so they agree with each other and with the
dashboard; ``/metrics`` is written by prometheus_client (``peer/ops/prom.py``). The server speaks just enough
HTTP/1.1 for curl, Prometheus and ``asyncmesh-peer status``: a GET of at most ``MAX_REQUEST_BYTES``, answered and
closed. It binds to 127.0.0.1 by default (``--metrics-host``); bind to 0.0.0.0 only behind a firewall or inside a
container whose port you publish on purpose. ``await StatusServer(metrics, port=...).start()`` raises
StatusServerError with advice when the port is taken; ``fetch_status(host, port)`` is the client (the ``swarm``
parent polls its children with it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Callable
from typing import Any

from peer.ops.metrics import PeerMetrics
from peer.ops.prom import CONTENT_TYPE, metric_name, peer_registry, prometheus_text, render

__all__ = ["DEFAULT_PORT", "StatusServer", "StatusServerError", "fetch_status", "json_safe", "metric_name",
           "prometheus_text"]

logger = logging.getLogger(__name__)

DEFAULT_PORT = 9464
MAX_REQUEST_BYTES = 8192
MAX_RESPONSE_BYTES = 16 * 1024 * 1024

class StatusServerError(RuntimeError):
    """The status server could not start (the message says what to change)."""


def json_safe(value: Any) -> Any:
    """The snapshot with non-finite floats replaced by None, so that it is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


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
        self._registry = peer_registry(self._snapshot)
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
                    await self._reply(writer, 200, CONTENT_TYPE, render(self._registry),
                                      head_only=parts[0] == "HEAD")
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
    status: dict[str, Any] = json.loads(body)
    return status
