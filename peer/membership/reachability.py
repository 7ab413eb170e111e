"""Reachability self-check: can other peers open a connection to the addresses this peer announces?

A peer behind NAT or a closed firewall can still dial out, so it joins the DHT and *looks* healthy, but nobody can
send it micro-batches. The check asks a peer it already knows (an initial peer) to open a plain TCP connection to
each announced address and to say whether one succeeded: a real dial-back from outside, not a reuse of the
connection we opened. The helper answers at most once per ``min_interval_s`` per requester and dials at most
``MAX_ADDRS`` addresses per request, so it is a poor tool for scanning other hosts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from peer.ids import short_id
from protocol.errors import ErrorCode, RemoteError
from protocol.messages import PROTOCOL_VERSION, Ack, Error, Hello, Message

logger = logging.getLogger(__name__)

REACH_RPC = "reach"
MAX_ADDRS = 4


def tcp_targets(maddrs: list[str]) -> list[tuple[str, int]]:
    """(host, port) of the /ip4|ip6/.../tcp/... addresses among ``maddrs`` (others cannot be dialled plainly)."""
    out = []
    for m in maddrs:
        parts = str(m).strip("/").split("/")
        if len(parts) >= 4 and parts[0] in ("ip4", "ip6") and parts[2] == "tcp" and parts[3].isdigit():
            out.append((parts[1], int(parts[3])))
    return out[:MAX_ADDRS]


def is_public_unroutable(host: str) -> bool:
    """Addresses nobody outside this machine can dial (0.0.0.0, loopback)."""
    return host in ("0.0.0.0", "::") or host.startswith("127.") or host == "::1"


class ReachabilityHelper:
    """Answers other peers' dial-back requests (registered on the RpcServer as ``reach``)."""

    def __init__(self, *, run_id: str, timeout_s: float, min_interval_s: float = 30.0) -> None:
        self.run_id, self.timeout_s, self.min_interval_s = run_id, timeout_s, min_interval_s
        self._last: dict[str, float] = {}

    async def handle(self, msg: Message, peer_id: str) -> Message:
        if getattr(msg, "run_id", None) != self.run_id:
            return Error(code=ErrorCode.WRONG_RUN, message=f"this peer trains run {self.run_id}")
        now = time.monotonic()
        if now - self._last.get(peer_id, -1e9) < self.min_interval_s:
            return Error(code=ErrorCode.RATE_LIMITED, message="one reachability check per 30 s")
        self._last[peer_id] = now
        if len(self._last) > 10_000:
            self._last.clear()
        targets = tcp_targets(list(msg.capabilities))
        if not targets:
            return Error(code=ErrorCode.BAD_REQUEST, message="no /ip4|ip6/HOST/tcp/PORT address to dial")
        failures = []
        for host, port in targets:
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout=self.timeout_s)
                writer.close()
                return Ack()
            except (OSError, TimeoutError) as e:
                failures.append(f"{host}:{port} ({type(e).__name__})")
        return Error(code=ErrorCode.TIMEOUT, message="could not connect to " + ", ".join(failures))


async def check_reachable(*, call: Callable[[str, str, Message, float], Awaitable[Message]], helpers: list[str],
                          run_id: str, stage: int, my_id: str, maddrs: list[str],
                          timeout_s: float) -> tuple[bool | None, str]:
    """Ask up to two helpers to dial us back. Returns (True/False, message) or (None, why it could not be checked)."""
    plain = sorted({f"/{m.strip('/').split('/p2p/')[0]}" for m in maddrs if tcp_targets([m])})  # no /p2p/ suffix
    targets = [m for m in plain if not is_public_unroutable(tcp_targets([m])[0][0])] or plain
    if not helpers:
        return None, "no other peer to dial us back yet (first peer of the swarm)"
    if not targets:
        return None, f"no TCP address among {maddrs} to check"
    msg = Hello(protocol_version=PROTOCOL_VERSION, run_id=run_id, stage=stage, peer_id=my_id,
                capabilities=[t[:64] for t in targets[:MAX_ADDRS]])
    last = "no helper answered"
    for helper in helpers[:2]:
        try:
            reply = await call(helper, REACH_RPC, msg, timeout=timeout_s + 5)
        except RemoteError as e:
            last = str(e)
            if "could not connect" in last:
                return False, (f"other peers cannot connect to this peer at {', '.join(targets)}: {last}. Open the "
                               "TCP port in your firewall or forward it on your router, and pass the public address "
                               "with --announce-maddrs /ip4/PUBLIC_IP/tcp/PORT (and --host-maddrs with that port).")
            continue
        except Exception as e:  # a helper that fails says nothing about us
            last = f"{short_id(helper)}: {e!r}"
            continue
        if isinstance(reply, Ack):
            return True, f"reachable at {', '.join(targets)}"
    return None, f"reachability could not be checked: {last}"
