"""Stage moves that cannot empty a stage, however many peers decide at once: decide, claim, re-check, then move.

A peer proposes a move when ``should_move`` (``peer.membership.stage_choice``) says so on two snapshots a random
jitter apart, then *claims* it: it announces itself 'draining' (a record that expires with its usual TTL, so a mover
that dies mid-claim frees it) and waits ``settle_s`` for the claim to reach the DHT. It moves only if, read again,
another peer of its stage still trains and none of them claimed too (``may_leave``), and the move still pays;
otherwise it withdraws the claim. Two peers that claim together cannot both miss each other, since each reads only
``settle_s`` after its own claim was stored; at worst both back off. A cool-down after any move or back-off
(``cooldown_s``, plus up to as much at random so aligned timers drift apart) stops a peer from flapping.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, replace

from peer.lifecycle import PeerState
from peer.membership.records import PeerRecord
from peer.membership.stage_choice import may_leave, should_move

logger = logging.getLogger(__name__)

Read = Callable[[], Awaitable[dict[str, PeerRecord]]]
Announce = Callable[[], Awaitable[None]]


@dataclass(frozen=True, kw_only=True)
class MoveTiming:
    """Timers of one move negotiation."""

    jitter_s: float
    """Random wait (up to this) between the decision and its re-check."""
    settle_s: float
    """Wait after announcing the claim before re-reading the swarm (DHT propagation)."""
    cooldown_s: float
    """No new decision for this long (plus up to as much again at random) after a move or a back-off."""

    def __post_init__(self) -> None:
        for name in ("jitter_s", "settle_s", "cooldown_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)}")


class Mover:
    """One peer's move negotiations; ``await decide(...)`` returns the stage to move to now, or None."""

    def __init__(self, costs: list[float], *, quality: float, timing: MoveTiming, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep, fits: Collection[int] | None = None,
                 ) -> None:
        self.costs, self.quality, self.timing = costs, quality, timing
        self.fits = fits  # the stages this peer can hold (None: all)
        self.rng = rng or random.Random()
        self.clock, self.sleep = clock, sleep
        self.quiet_until = 0.0
        self.backoffs = 0

    def cool_down(self) -> None:
        """Start a cool-down now (after joining, a move or a back-off)."""
        c = self.timing.cooldown_s
        self.quiet_until = self.clock() + c + self.rng.uniform(0, c)

    async def decide(self, *, my_id: str, read: Read, claim: Announce, release: Announce) -> int | None:
        """Decide, claim, re-check (see the module docstring). ``claim``/``release`` announce 'draining'/'training'.

        On a non-None result the claim stands: the caller leaves its stage now.
        """
        if self.clock() < self.quiet_until:
            return None
        target = should_move(await read(), self.costs, my_id, quality=self.quality, fits=self.fits)
        if target is None:
            return None
        await self.sleep(self.rng.uniform(0, self.timing.jitter_s))
        target = should_move(await read(), self.costs, my_id, quality=self.quality, fits=self.fits)
        if target is None:
            return None
        await claim()
        await self.sleep(self.timing.settle_s)
        snap = await read()
        me = snap.get(my_id)
        still = None
        if me is not None:  # judge the move as if we stayed: our own record says 'draining' now
            still = should_move({**snap, my_id: replace(me, state=PeerState.TRAINING)}, self.costs, my_id,
                                quality=self.quality, fits=self.fits)
        if still is None or not may_leave(snap, my_id):
            self.backoffs += 1
            logger.info("not moving to stage %d after all: %s", target,
                        "the move no longer pays off" if still is None and me is not None
                        else "another peer of our stage claimed a move too, or our stage would empty")
            await release()
            self.cool_down()
            return None
        self.cool_down()
        return still
