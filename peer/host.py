"""What a stage uses of the peer that hosts it, handed over explicitly: ``StageContext`` (and ``StageNetwork``).

The daemon builds one ``StageContext`` and gives it to every ``peer.stage.StageService`` it starts, so a stage depends
on the few things it uses (the run, the peer's settings, metrics and lifecycle, its network presence, routing, the
compute thread, the sample ledger and spare copies, announcing and checkpointing), not on the daemon.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from hivemind import DHT
    from hivemind.p2p import P2P

    from peer.averaging.behaviour import AveragingBehaviour
    from peer.config import PeerConfig
    from peer.handlers.table import Handlers
    from peer.lifecycle import Lifecycle
    from peer.membership.records import PeerRecord
    from peer.membership.routing import Router
    from peer.membership.signing import Signer
    from peer.ops.metrics import PeerMetrics
    from peer.pipeline.ledger import SampleLedger
    from peer.seams import Compute
    from peer.state.spare import SpareStore
    from protocol.messages import Message
    from trainer.config import RunConfig

__all__ = ["StageContext", "StageNetwork"]


class StageNetwork(Protocol):
    """What a stage uses of the peer on the network (``peer.presence.Presence``), read when used: the DHT, p2pd and
    handler table are replaced when the peer joins again through a relay."""

    @property
    def my_id(self) -> str: ...

    @property
    def p2p(self) -> P2P | None: ...

    @property
    def dht(self) -> DHT | None: ...

    @property
    def handlers(self) -> Handlers | None: ...

    @property
    def swarm(self) -> dict[str, PeerRecord]: ...

    @property
    def signer(self) -> Signer | None:
        """The identity key (signs our records and pipeline frames; None until the peer started)."""

    async def send(self, peer_id: str, name: str, msg: Message, *, timeout: float | None = None) -> Message: ...

    async def refresh_swarm(self) -> dict[str, PeerRecord]: ...

    def vouch(self, peer_id: str) -> None: ...

    def revoke(self, peer_id: str) -> None: ...

    def trusted_peers(self) -> list[str]: ...

    async def ask_anchors(self) -> list[str]: ...


@dataclass(kw_only=True)
class StageContext:
    """Everything a stage uses of its peer; built once by ``peer.daemon.Daemon``."""

    run: RunConfig
    cfg: PeerConfig
    """The peer's settings (the daemon replaces them on a second SIGINT: the drain is skipped)."""
    metrics: PeerMetrics
    life: Lifecycle
    """The peer's state: a stage enters TRAINING once it serves, and serves only while the peer trains."""
    net: StageNetwork
    router: Router
    costs: list[float]
    """The relative compute cost of every stage (announced throughput is in these units)."""
    compute: Compute
    announce: Callable[[], Awaitable[None]]
    """Announces the peer's record as it is now."""
    checkpoint: Callable[[], Awaitable[None]]
    """Writes a checkpoint of the stage served (when the peer keeps checkpoints)."""
    ledger: SampleLedger
    spares: SpareStore
    stop: asyncio.Event
    """Set when the peer stops."""
    averaging_behaviour: AveragingBehaviour | None = None
    """How this peer takes part in averaging rounds (None: honest)."""

    @property
    def p2p(self) -> P2P:
        """The p2pd client (a stage exists only once the peer is on the network)."""
        assert self.net.p2p is not None, "a stage runs only once the peer is on the network"
        return self.net.p2p

    @property
    def dht(self) -> DHT:
        assert self.net.dht is not None, "a stage runs only once the peer is on the network"
        return self.net.dht

    @property
    def handlers(self) -> Handlers:
        assert self.net.handlers is not None, "a stage runs only once the peer is on the network"
        return self.net.handlers
