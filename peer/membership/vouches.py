"""Vouches: a joiner with no history borrows the validated-work history of the peers it chose to join through.

A state is loaded only when witnesses of its stage vouch for it (``peer.state.witness``), and witnesses are drawn
from the peers that did validated work for us. A joiner has none yet, so it would draw them from the announced
records, and in an open run an identity costs a key pair: five records serving the same forged state outvote a
stage of two honest replicas. The peers a user names with ``--initial-peers`` are the one choice the joiner did not
take from the swarm, so it asks them (``vouches``) which peers did validated work for them and draws its witnesses
from those, and from the initial peers themselves. An identity the initial peers vouch for has done real work for
them (a trained gradient, a passed check or an accepted averaging part), which costs compute rather than a key pair.
The reply names peers, nothing else; each peer may ask once per SERVE_MIN_INTERVAL_S.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from peer.handlers.table import once_per
from protocol.messages import MAX_VOUCHES, Message, Vouches, VouchesRequest

logger = logging.getLogger(__name__)

__all__ = ["VOUCHES_RPC", "ask_vouches", "peer_ids_of", "serve_vouches"]

VOUCHES_RPC = "vouches"
#: the shortest interval between two ``vouches`` requests of one peer that we answer
SERVE_MIN_INTERVAL_S = 2.0

Count = Callable[[str, int], None]
Send = Callable[[str, str, Message], Awaitable[Message]]


def peer_ids_of(maddrs: list[str], me: str = "") -> list[str]:
    """The peer ids the multiaddrs name (``/p2p/<id>``), each once, ``me`` left out."""
    ids = [m.rsplit("/p2p/", 1)[1] for m in maddrs if "/p2p/" in m]
    return [i for i in dict.fromkeys(ids) if i != me]


def serve_vouches(known: Callable[[], list[str]], run_id: str,
                  count: Count) -> Callable[[Message, str], Awaitable[Message]]:
    """The ``vouches`` handler: the most recent MAX_VOUCHES peers of ``known()`` (the RPC server's known peers,
    most recently vouched for last), at most once per SERVE_MIN_INTERVAL_S to each peer."""
    return once_per("vouches", VouchesRequest, run_id, SERVE_MIN_INTERVAL_S,
                    lambda: Vouches(run_id=run_id, peers=known()[-MAX_VOUCHES:]), count)


async def ask_vouches(anchors: list[str], run_id: str, send: Send, count: Count) -> list[str]:
    """The anchors that answered, then the peers they vouch for (each once, in the anchors' order). Never raises: an
    anchor that does not answer, or answers something else, vouches for nobody (counted in ``vouches_failed``)."""

    async def one(anchor: str) -> list[str] | None:
        try:
            reply = await send(anchor, VOUCHES_RPC, VouchesRequest(run_id=run_id))
        except Exception as e:  # an unreachable anchor is no reason to stop; the others may answer
            logger.debug("asking %s for its vouches failed: %r", anchor[:16], e)
            return None
        if not isinstance(reply, Vouches) or reply.run_id != run_id:
            return None
        return reply.peers

    answers = await asyncio.gather(*(one(a) for a in anchors))
    count("vouches_failed", sum(a is None for a in answers))
    answered = [a for a, peers in zip(anchors, answers, strict=True) if peers is not None]
    vouched = [p for peers in answers if peers is not None for p in peers]
    return list(dict.fromkeys([*answered, *vouched]))
