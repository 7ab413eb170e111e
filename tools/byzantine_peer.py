#!/usr/bin/env python3
"""A Byzantine replica on a real peer, for measurements: ``join`` with an attacking averaging behaviour.

    python tools/byzantine_peer.py --attack zeros join --run RUN.toml --stage 0 --initial-peers MADDR ...

runs ``asyncmesh-peer join`` with every argument after ``--attack ATTACK`` as given, but hands the daemon an
``Attacker`` as its averaging behaviour (the seam of peer/averaging/behaviour.py): nothing of it is in the product,
and no setting of a product peer selects it. It exists to measure robust averaging on a real swarm
(tools/byzantine_swarm.py). The attacker is an announced replica of the stage that trains honestly: it passes the
membership filter, so only the distance check, the outlier check and the robust aggregate stand between its parts
and the honest weights. The simulator's attacker (trainer/attacks.py) may read every honest part before it sends; a
real peer holds only its own values and what reaches it in the round, so each attack is realised with exactly that:

* ``zeros``, ``scale`` (x -10) and ``signflip``: from its own values, as in the simulator.
* ``noise``: its own values plus Gaussian noise of 3 x their rms (per tensor), drawn from the attacker's own
  generator (the peer's global random state, which its data and model use, is left alone).
* ``alie`` ("a little is enough", Baruch et al. 2019) by *rushing*: the peer holds its own part back and reads the
  parts the others send it first (in the exchange the smaller id calls at once, and a larger id calls a silent peer
  after ``initiator_grace`` (0.5) of the short window), until every partner has offered one or ``ALIE_WAIT`` (0.6) of
  the round's exchange window has passed. It then sends, per coordinate, the mean minus ``z`` = 1 population
  standard deviations of its own honestly trained values and the parts it read. A part that arrives later is not
  read. Colluders do not coordinate: two alie peers each wait
  for the other, so each normally sees only the honest parts and they send nearly the same vector. With nothing
  received it sends its own values (an honest part). Honest rounds with a rushing peer last until it answers.
* The attacker defends nothing: it accepts every well-formed part (so an honest caller is answered at once instead
  of being refused by a check against the attacked values), and its attacked part is also its own contribution.

It counts what it did in the peer's PeerMetrics (``/status`` counters): ``byzantine_parts`` (attacked parts built)
and, for 'alie', ``byzantine_parts_read`` (the others' parts it read before sending), so a measurement can tell an
'alie' that saw the honest parts from one that sent its own values.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import Iterable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from peer.averaging.exchange import Check, PartExchange, Slot  # noqa: E402
from trainer.attacks import ATTACKS, byzantine_part  # noqa: E402

logger = logging.getLogger(__name__)
ALIE_WAIT = 0.6
"""Fraction of the round's exchange window a rushing 'alie' peer waits for the others' parts before it sends."""


class Attacker:
    """What a Byzantine peer sends instead of its own part (an ``AveragingBehaviour``); see the module docstring.

    Args:
        kind: one of trainer.attacks.ATTACKS. z: 'alie' shift in standard deviations. noise_ratio: 'noise' rms
            relative to the own values' rms. seed: of the noise generator (None: a fresh random seed).
    """

    def __init__(self, kind: str, *, z: float = 1.0, noise_ratio: float = 3.0, seed: int | None = None) -> None:
        if kind not in ATTACKS:
            raise ValueError(f"the attack must be one of {ATTACKS}, got {kind!r}")
        self.kind, self.z, self.noise_ratio = kind, z, noise_ratio
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    @property
    def keeps_offers(self) -> bool:
        """Whether this attack reads the others' parts before it sends its own (the exchange must keep them)."""
        return self.kind == "alie"

    def check(self, honest: Check) -> Check:
        """The attacker's check of a received part: none (it takes every well-formed part)."""
        return _accept_all

    async def part(self, exchange: PartExchange, slot: Slot, own: list[torch.Tensor], partners: Iterable[str],
                   window_start: float) -> list[torch.Tensor]:
        """The values to publish in ``slot`` instead of ``own`` (for 'alie', after waiting for the others' parts)."""
        exchange.metrics.inc("byzantine_parts")
        if not self.keeps_offers:
            return [byzantine_part(self.kind, v, noise_ratio=self.noise_ratio, generator=self.generator) for v in own]
        wait = window_start + ALIE_WAIT * (slot.deadline - window_start) - exchange.clock()
        logger.debug("alie round %d: begun %.2f s into the window", slot.key, exchange.clock() - window_start)
        if wait > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_offered(slot, set(partners)), wait)
        like = [v.detach().reshape(-1).float() for v in own]
        # decoded here, not in an executor: a thread hop costs tenths of a second on busy cores, late in the window
        received = exchange.decode_offers(dict(slot.offers or {}), like)
        exchange.metrics.inc("byzantine_parts_read", len(received))
        logger.debug("alie round %d: read %d parts (partners %d) %.2f s into the window, %.2f s before its end",
                     slot.key, len(received), len(set(partners)), exchange.clock() - window_start,
                     slot.deadline - exchange.clock())
        return self.alie(like, list(received.values()))

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


def _accept_all(received: list[torch.Tensor], own: list[torch.Tensor]) -> str | None:
    return None


def main(argv: list[str] | None = None) -> int:
    from peer.cli import build_parser
    from peer.cli import join as join_cli

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attack", required=True, choices=ATTACKS, help="what this replica sends instead of its part")
    p.add_argument("join", nargs=argparse.REMAINDER, help="'join' and its arguments, as for asyncmesh-peer")
    args = p.parse_args(argv)
    if not args.join or args.join[0] != "join":
        p.error("give the join command after --attack: ... --attack zeros join --run RUN.toml ...")
    join_args = build_parser().parse_args(args.join)
    logger.warning("this peer sends attacked averaging parts (%s): a measurement, not a product peer", args.attack)
    return int(join_cli.run(join_args, averaging_behaviour=Attacker(args.attack)) or 0)


if __name__ == "__main__":
    sys.exit(main())
