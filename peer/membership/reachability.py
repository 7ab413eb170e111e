"""Reachability self-check: can other peers open a connection to the addresses this peer announces?

A peer behind NAT or a closed firewall can still dial out, so it joins the DHT and *looks* healthy, but nobody can
send it micro-batches. The check asks a peer it already knows (an initial peer) to open a plain TCP connection to
each announced address and to say whether one succeeded: a real dial-back from outside, not a reuse of the
connection we opened. The helper answers at most once per ``min_interval_s`` per requester, dials at most
``MAX_ADDRS`` addresses per request, and only the requester's own address as libp2p observed it on the connection the
request came over (any port: probing one's own host tells nothing new). A requester seen from an address it does not
announce (behind NAT, or announcing its private address) is dialled at that observed address on the ports it
announces: the answer says whether a port forward exists, and a "could not connect" marks a peer behind NAT, which
``--relay auto`` then serves through a relay (``peer.membership.relay``). Loopback, private and link-local addresses
are dialled only when the swarm itself is local (every address it announces is one), so the helper is no port-probe
oracle into its own machine or network.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

from peer.ids import short_id
from protocol.errors import ErrorCode, RemoteError
from protocol.messages import PROTOCOL_VERSION, Ack, Error, Hello, Message

if TYPE_CHECKING:
    from hivemind.p2p import P2P

    from peer.seams import Send

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


def is_private(host: str) -> bool:
    """Loopback, private, link-local, unspecified or otherwise non-public addresses (and anything not an IP)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return True
    return not ip.is_global or ip.is_multicast


def swarm_is_local(maddrs: Iterable[str]) -> bool:
    """Whether every TCP address among ``maddrs`` (all the swarm announces) is loopback or private: a lab swarm."""
    hosts = [h for m in maddrs for h, _ in tcp_targets([m])]
    return bool(hosts) and all(is_private(h) for h in hosts)


async def observed_hosts(p2p: P2P, peer_id: str) -> set[str]:
    """The IP addresses libp2p sees ``peer_id`` connected from (the remote ends of our connections to it)."""
    hosts: set[str] = set()
    for info in await p2p.list_peers():
        if info.peer_id.to_base58() == peer_id:
            hosts.update(h for a in info.addrs for h, _ in tcp_targets([str(a)]))
    return hosts


class ReachabilityHelper:
    """Answers other peers' dial-back requests (registered on the RpcServer as ``reach``).

    ``observed(peer_id)`` returns the hosts the requester is connected from; ``local_swarm()`` says whether the swarm
    is a local one (then loopback and private addresses may be dialled).
    """

    def __init__(self, *, run_id: str, timeout_s: float, observed: Callable[[str], Awaitable[set[str]]],
                 local_swarm: Callable[[], bool], min_interval_s: float = 30.0) -> None:
        self.run_id, self.timeout_s, self.min_interval_s = run_id, timeout_s, min_interval_s
        self.observed, self.local_swarm = observed, local_swarm
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
        if not isinstance(msg, Hello):
            return Error(code=ErrorCode.BAD_REQUEST, message="reachability: expected a Hello naming addresses to dial")
        targets = tcp_targets(list(msg.capabilities))
        if not targets:
            return Error(code=ErrorCode.BAD_REQUEST, message="no /ip4|ip6/HOST/tcp/PORT address to dial")
        own = await self.observed(peer_id)
        local = self.local_swarm()
        allowed = [(h, p) for h, p in targets if h in own and (local or not is_private(h))]
        if not allowed and not any(h in own for h, _ in targets):  # seen from elsewhere: NAT, or a port forward
            ports = sorted({p for _, p in targets})
            allowed = [(h, p) for h in sorted(own) if local or not is_private(h) for p in ports][:MAX_ADDRS]
        if not allowed:
            return Error(code=ErrorCode.BAD_REQUEST,
                         message="only the requester's own observed public address is dialled back")
        targets = allowed
        failures = []
        for host, port in targets:
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout=self.timeout_s)
                writer.close()
                return Ack()
            except (OSError, TimeoutError) as e:
                failures.append(f"{host}:{port} ({type(e).__name__})")
        return Error(code=ErrorCode.TIMEOUT, message="could not connect to " + ", ".join(failures))


async def check_reachable(*, call: Send, helpers: list[str],
                          run_id: str, stage: int, my_id: str, maddrs: list[str],
                          timeout_s: float) -> tuple[bool | None, str]:
    """Ask up to two helpers to dial us back. Returns (True/False, message) or (None, why it could not be checked)."""
    plain = sorted({f"/{m.strip('/').split('/p2p/')[0]}" for m in maddrs  # no /p2p/ suffix, no relayed address
                    if tcp_targets([m]) and "/p2p-circuit" not in m})
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
                               "with --announce-maddrs /ip4/PUBLIC_IP/tcp/PORT (and --host-maddrs with that port); "
                               "otherwise --relay auto (the default) serves through a relay.")
            continue
        except Exception as e:  # a helper that fails says nothing about us
            last = f"{short_id(helper)}: {e!r}"
            continue
        if isinstance(reply, Ack):
            return True, f"reachable at {', '.join(targets)}"
    return None, f"reachability could not be checked: {last}"
