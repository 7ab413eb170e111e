"""`asyncmesh-peer status`: ask a running peer how it is doing, for scripts and container health checks.

It reads the peer's ``/status`` endpoint (served when the peer runs with ``--metrics-port``) and exits 0 when the
peer is healthy, 1 when it answers but is unhealthy (stopped, training without progress, or stuck joining), and 3
when nothing answers. ``--json`` prints the full snapshot, the same figures the dashboard and ``/metrics`` show.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any

from peer.errors import UserError
from peer.ids import short_id
from peer.ops.progress import progress_line

HELP = "Show a running peer's status (exit 0 healthy, 1 unhealthy, 3 unreachable); for scripts and health checks."
EPILOG = """examples:
  asyncmesh-peer status                      # one line: state, stage, step, tokens/s, loss
  asyncmesh-peer status --json | jq .tokens_per_s
  asyncmesh-peer status --port 9465 --quiet  # exit code only (Docker HEALTHCHECK)
"""

EXIT_HEALTHY, EXIT_UNHEALTHY, EXIT_UNREACHABLE = 0, 1, 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from peer.ops.status_server import DEFAULT_PORT

    parser.add_argument("--host", default="127.0.0.1", help="address the peer's status server is bound to")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"the peer's --metrics-port (default {DEFAULT_PORT})")
    parser.add_argument("--json", action="store_true", help="print the full JSON snapshot")
    parser.add_argument("--quiet", action="store_true", help="print nothing; report through the exit code only")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")


def fetch(host: str, port: int, timeout: float) -> dict[str, Any]:
    """GET http://host:port/status; raises OSError (incl. URLError) or ValueError."""
    with urllib.request.urlopen(f"http://{host}:{port}/status", timeout=timeout) as response:
        snap = json.loads(response.read())
    if not isinstance(snap, dict) or "state" not in snap or "healthy" not in snap:
        raise ValueError("the answer is not an asyncmesh status snapshot")
    return snap


def summary(snap: dict[str, Any]) -> str:
    """One line for humans."""
    stage = "?" if snap.get("stage") is None else snap["stage"]
    loss = "-" if snap.get("train_loss") is None else f"{snap['train_loss']:.3f}"
    health = "healthy" if snap["healthy"] else "UNHEALTHY: " + "; ".join(snap.get("health_reasons", []))
    line = (f"{short_id(snap.get('peer_id', ''))} stage {stage} {snap['state']} step {snap.get('local_step', 0)} "
            f"{snap.get('tokens_per_s', 0.0):.0f} tok/s loss {loss} - {health}")
    if snap.get("swarm"):  # the swarm's progress as this peer sees it in the DHT
        from peer.ops.dashboard import duration, human

        line += " · " + progress_line(snap["swarm"], duration, human)
    return line


def run(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be 1-65535, got {args.port}")
    if args.timeout <= 0:
        raise UserError("--timeout must be positive")
    try:
        snap = fetch(args.host, args.port, args.timeout)
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        message = (f"no peer answers on http://{args.host}:{args.port}/status ({reason}); is it running with "
                   f"--metrics-port {args.port}?")
        if args.json and not args.quiet:
            print(json.dumps({"reachable": False, "healthy": False, "error": message}))
        if not args.quiet:
            print(f"asyncmesh-peer status: {message}", file=sys.stderr)
        return EXIT_UNREACHABLE
    if not args.quiet:
        print(json.dumps(snap, indent=2) if args.json else summary(snap))
    return EXIT_HEALTHY if snap["healthy"] else EXIT_UNHEALTHY
