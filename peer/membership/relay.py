"""Peers behind NAT: which libp2p circuit-relay settings this peer's p2pd starts with.

A peer behind NAT can dial out but nobody can dial it; with libp2p's circuit relay v2 it reserves a slot at a public
peer and announces ``/ip4/RELAY/tcp/PORT/p2p/RELAY_ID/p2p-circuit/p2p/OUR_ID``, and the relay forwards the bytes.
``relay`` says whether this peer listens through a relay (``auto``: when the reachability check finds it unreachable,
``needs_relay_restart``), ``relay_service`` whether it relays for others; both are fixed when p2pd starts (the
settings and their limits: docs/docker.md, "Behind NAT"). The relays are a fixed list, reserved at once, not
discovered (the bundled p2pd's discovery waits for 4 candidates or 3 minutes); hivemind 1.1.12 does not pass p2pd's
``-relayDiscovery`` flag, so the flag rides on a reachability mode of our own (``STATIC_RELAYS``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hivemind import DHT
    from hivemind.utils.multiaddr import Multiaddr

logger = logging.getLogger(__name__)



class RelayMode(StrEnum):
    """``--relay`` and ``--relay-service``: when to listen through a relay, and when to relay for others."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


RELAY_MODES = tuple(m.value for m in RelayMode)
STATIC_RELAYS = "asyncmesh-private-static-relays"
"""hivemind ``force_reachability`` value of our own: private reachability (so autorelay reserves a slot at once) and
the fixed relay list only (``-relayDiscovery=0``)."""


def _register_static_relays() -> None:
    """Teach hivemind's P2P.create the STATIC_RELAYS mode (imported here: peer.config imports this module)."""
    from hivemind.p2p import P2P

    P2P.FORCE_REACHABILITY_MAPPING.setdefault(STATIC_RELAYS, {"forceReachabilityPrivate": 1, "relayDiscovery": 0})


def check_modes(relay: str, relay_service: str) -> tuple[RelayMode, RelayMode]:
    """The two modes; ValueError for an unknown one or a peer that would both listen through a relay and relay for
    others."""
    if relay not in RELAY_MODES:
        raise ValueError(f"--relay must be one of {RELAY_MODES}, got {relay!r}")
    if relay_service not in RELAY_MODES:
        raise ValueError(f"--relay-service must be one of {RELAY_MODES}, got {relay_service!r}")
    if relay == RelayMode.ON and relay_service == RelayMode.ON:
        raise ValueError("--relay on and --relay-service on contradict each other: a peer reached through a relay "
                         "cannot relay for others; give the relay service to a public peer")
    return RelayMode(relay), RelayMode(relay_service)


def relay_targets(relays: Sequence[str], initial_peers: Sequence[str]) -> list[str]:
    """The relays to reserve a slot at: ``relays`` if given, else the initial peers (full multiaddrs with /p2p/)."""
    return [m for m in (list(relays) or list(initial_peers)) if "/p2p/" in m]


def p2p_relay_kwargs(*, through_relay: bool, relay_service: RelayMode, relays: Sequence[str]) -> dict[str, Any]:
    """Keyword arguments for ``hivemind.DHT`` (passed on to ``P2P.create``).

    ``through_relay``: reserve a slot at ``relays`` and announce the relayed address (the peer is unreachable or
    asked for it). Otherwise the peer relays for others as ``relay_service`` says. ``use_relay`` stays on in every
    case: it is what lets this peer dial others' relayed addresses.
    """
    if through_relay:
        if not relays:
            raise ValueError("listening through a relay needs a relay: pass --relays or --initial-peers with full "
                             "multiaddrs (/ip4/HOST/tcp/PORT/p2p/PEER_ID)")
        _register_static_relays()  # before the DHT process forks: the child inherits the table
        return dict(use_relay=True, use_auto_relay=True, force_reachability=STATIC_RELAYS,
                    trusted_relays=list(relays))
    force = {RelayMode.AUTO: None, RelayMode.ON: "public", RelayMode.OFF: "private"}[RelayMode(relay_service)]
    return dict(use_relay=True, use_auto_relay=False, force_reachability=force)


def needs_relay_restart(relay: RelayMode, reachable: bool | None, through_relay: bool) -> bool:
    """--relay auto: the self-check found us unreachable and p2pd is not listening through a relay yet."""
    return relay == RelayMode.AUTO and reachable is False and not through_relay


def relayed_maddrs(maddrs: Sequence[str]) -> list[str]:
    """The relayed addresses (``.../p2p-circuit/...``) among ``maddrs``."""
    return [m for m in maddrs if "/p2p-circuit" in m]


async def wait_relayed(dht: DHT, timeout_s: float, poll_s: float = 0.5) -> list[Multiaddr]:
    """This peer's addresses once a relayed one is among them (the reservation takes a moment after p2pd starts),
    or its addresses as they are after ``timeout_s``; asks p2pd afresh each time (hivemind caches them)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        visible = await loop.run_in_executor(None, functools.partial(dht.get_visible_maddrs, latest=True))
        if relayed_maddrs([str(m) for m in visible]) or loop.time() >= deadline:
            if not relayed_maddrs([str(m) for m in visible]):
                logger.warning("no relay slot reserved within %.0f s; the relays may not offer the service "
                               "(--relay-service on) or may lack a public address", timeout_s)
            return list(visible)
        await asyncio.sleep(poll_s)
