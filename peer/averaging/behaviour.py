"""How this peer takes part in an averaging round: the seam through which tests and the red team put a Byzantine
replica on a real peer, without patching the exchange.

The product has one behaviour, ``Honest``: it applies the exchange's own check to every received part, keeps no part
that arrives before its own, and publishes its own values. A behaviour for measurements (tools/byzantine_peer.py)
is handed to ``AveragingLoop(behaviour=...)`` through ``Daemon(..., averaging_behaviour=...)``; no setting of the
peer's configuration or command line selects one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from peer.averaging.exchange import Check, PartExchange, Slot


class AveragingBehaviour(Protocol):
    """What a peer does with its part of a round (see the module docstring)."""

    @property
    def keeps_offers(self) -> bool:
        """Whether the exchange keeps the raw parts that arrive before this peer's part is set (``Slot.offers``)."""
        ...

    def check(self, honest: Check) -> Check:
        """The check of received parts the exchange applies, given the honest one."""
        ...

    async def part(self, exchange: PartExchange, slot: Slot, own: list[torch.Tensor], partners: Iterable[str],
                   window_start: float) -> list[torch.Tensor]:
        """The values to publish in ``slot``, given this peer's own ``own``."""
        ...


class Honest:
    """The product's behaviour: the honest check, no kept offers, its own values."""

    keeps_offers = False

    def check(self, honest: Check) -> Check:
        return honest

    async def part(self, exchange: PartExchange, slot: Slot, own: list[torch.Tensor], partners: Iterable[str],
                   window_start: float) -> list[torch.Tensor]:
        return own


HONEST = Honest()
