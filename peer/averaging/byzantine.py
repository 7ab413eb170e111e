"""The red-team knob ``PeerConfig.byzantine_attack`` on a real peer: what a Byzantine replica puts on the wire.

It exists to measure robust averaging on a real swarm (tools/byzantine_swarm.py); an honest peer never builds an
``Attacker``. The attacker is an announced replica of the stage that trains honestly: it passes the membership
filter, so only the distance check, the outlier check and the robust aggregate stand between its parts and the
honest weights. The simulator's attacker (trainer/attacks.py) may read every honest part before it sends; a real
peer holds only its own values and what reaches it in the round, so each attack is realised with exactly that:

* ``zeros``, ``scale`` (x -10) and ``signflip``: from its own values, as in the simulator.
* ``noise``: its own values plus Gaussian noise of 3 x their rms (per tensor), drawn from the attacker's own
  generator (the peer's global random state, which its data and model use, is left alone).
* ``alie`` ("a little is enough", Baruch et al. 2019) by *rushing*: the peer holds its own part back and reads the
  parts the others send it first (in the exchange the smaller id calls at once, and a larger id calls a silent peer
  after ``initiator_grace`` (0.5) of the window), until every partner has offered one or ``ALIE_WAIT`` (0.6) of
  the round's exchange window has passed. It then sends, per coordinate, the mean minus ``z`` = 1 population
  standard deviations of its own honestly trained values and the parts it read. A part that arrives later is not
  read. Colluders do not coordinate: two alie peers each wait
  for the other, so each normally sees only the honest parts and they send nearly the same vector. With nothing
  received it sends its own values (an honest part). Honest rounds with a rushing peer last until it answers.
* The attacker defends nothing: it accepts every well-formed part (so an honest caller is answered at once instead
  of being refused by a check against the attacked values), and its attacked part is also its own contribution.

It counts what it did in its PeerMetrics (``/status`` counters): ``byzantine_parts`` (attacked parts built) and, for
'alie', ``byzantine_parts_read`` (the others' parts it read before sending), so a measurement can tell an 'alie' that
saw the honest parts from one that sent its own values.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from peer.averaging.exchange import PartExchange, Slot
from trainer.attacks import ATTACKS, byzantine_part

if TYPE_CHECKING:
    from peer.ops.metrics import PeerMetrics

logger = logging.getLogger(__name__)
ALIE_WAIT = 0.6
"""Fraction of the round's exchange window a rushing 'alie' peer waits for the others' parts before it sends."""


class Attacker:
    """What a Byzantine peer sends instead of its own part; see the module docstring.

    Args:
        kind: one of trainer.attacks.ATTACKS. z: 'alie' shift in standard deviations. noise_ratio: 'noise' rms
            relative to the own values' rms. seed: of the noise generator (None: a fresh random seed).
        metrics: where the counters go (None: not counted).
    """

    def __init__(self, kind: str, *, z: float = 1.0, noise_ratio: float = 3.0, seed: int | None = None,
                 metrics: PeerMetrics | None = None) -> None:
        if kind not in ATTACKS:
            raise ValueError(f"byzantine_attack must be one of {ATTACKS}, got {kind!r}")
        self.kind, self.z, self.noise_ratio, self.metrics = kind, z, noise_ratio, metrics
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    @classmethod
    def arm(cls, kind: str, exchange: PartExchange, metrics: PeerMetrics | None = None) -> Attacker | None:
        """The attacker for ``kind`` with ``exchange`` set up for it (its check, kept offers); None for ''."""
        if not kind:
            return None
        attacker = cls(kind, metrics=metrics)
        exchange.check = attacker.check
        exchange.keep_offers = attacker.rushing
        logger.warning("red-team knob byzantine_attack=%r: this peer sends attacked averaging parts", kind)
        return attacker

    @property
    def rushing(self) -> bool:
        """Whether this attack reads the others' parts before it sends its own (the exchange must keep them)."""
        return self.kind == "alie"

    @staticmethod
    def check(received: list[torch.Tensor], own: list[torch.Tensor]) -> str | None:
        """The attacker's check of a received part: none (it takes every well-formed part)."""
        return None

    async def part(self, exchange: PartExchange, slot: Slot, own: list[torch.Tensor], partners: Iterable[str],
                   window_start: float) -> list[torch.Tensor]:
        """The values to publish in ``slot`` instead of ``own`` (for 'alie', after waiting for the others' parts)."""
        self._count("byzantine_parts")
        if not self.rushing:
            return [byzantine_part(self.kind, v, noise_ratio=self.noise_ratio, generator=self.generator) for v in own]
        wait = window_start + ALIE_WAIT * (slot.deadline - window_start) - exchange.clock()
        logger.debug("alie round %d: begun %.2f s into the window", slot.key, exchange.clock() - window_start)
        if wait > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_offered(slot, set(partners)), wait)
        like = [v.detach().reshape(-1).float() for v in own]
        # decoded here, not in an executor: a thread hop costs tenths of a second on busy cores, late in the window
        received = exchange.decode_offers(dict(slot.offers or {}), like)
        self._count("byzantine_parts_read", len(received))
        logger.debug("alie round %d: read %d parts (partners %d) %.2f s into the window, %.2f s before its end",
                     slot.key, len(received), len(set(partners)), exchange.clock() - window_start,
                     slot.deadline - exchange.clock())
        return self.alie(like, list(received.values()))

    def _count(self, name: str, n: int = 1) -> None:
        if self.metrics is not None:
            self.metrics.inc(name, n)

    def alie(self, own: list[torch.Tensor], received: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """Per tensor: mean - z x std over our values and the ``received`` parts (each a list like ``own``)."""
        return [byzantine_part("alie", v, torch.stack([v, *(r[j] for r in received)]), z=self.z)
                for j, v in enumerate(own)]


async def _offered(slot: Slot, partners: set[str]) -> None:
    """Until every partner, and everyone that has called us since, has offered a part."""
    assert slot.offers is not None, "the exchange must keep offers (keep_offers) for a rushing attacker"
    while (partners | slot.senders) - set(slot.offers):
        slot.arrived.clear()
        await slot.arrived.wait()
