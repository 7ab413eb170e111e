"""Membership gossip: peers hand each other the run's signed records, so that the DHT is not the only way to see the
swarm.

hivemind's DHT node ids are chosen by each node, so a stranger can run the nodes closest to the run's key and
withhold the records stored there (an eclipse). The records are signed by their owners, so any peer can pass them on
without being able to alter them: each peer keeps the signed records it has accepted (``RecordBook``: from its DHT
reads and from gossip, the newest of each owner until it expires) and serves them on ``records``; every
``gossip_every_s`` it asks one peer of its view (or, before it has one, an initial peer) for theirs. A record
learnt this way passes every check a DHT node applies (owner's signature over key, body, expiration and credential;
schema; bounded expiration; in a closed run the organiser's admission until the record expires), so gossip shows
no more than the owners signed; replaying an older record loses to the owner's newer one (later expiration).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from hivemind.utils import get_dht_time

from peer.handlers.table import once_per
from peer.lifecycle import PeerState
from peer.membership.records import PeerRecord, RecordError, swarm_key
from peer.membership.signing import SignatureError, open_envelope
from protocol.messages import MAX_GOSSIP_RECORDS, Message, Records, RecordsRequest

logger = logging.getLogger(__name__)

__all__ = ["RECORDS_RPC", "RecordBook", "ask_records", "serve_records"]

RECORDS_RPC = "records"
#: the shortest interval between two ``records`` requests of one peer that we answer
SERVE_MIN_INTERVAL_S = 2.0
#: owners whose records one book holds at most (as a DHT node's allowance under the run's key)
MAX_BOOK = 8192

Admit = Callable[[str, bytes | None, float], None]
Count = Callable[[str, int], None]


class RecordBook:
    """The signed records this peer accepted, the newest per owner, until they expire.

    Args:
        run_id: the run whose key the records are signed under.
        admit: a closed run's admission check ``admit(peer_id, credential, expiration)`` (raises unless the organiser
            admitted the owner until then); None in an open run.
        clock: DHT time (seconds), a test seam.
    """

    def __init__(self, run_id: str, admit: Admit | None = None, clock: Callable[[], float] = get_dht_time) -> None:
        self.key, self.admit, self.clock = swarm_key(run_id), admit, clock
        self._held: dict[str, tuple[float, dict[str, Any], PeerRecord]] = {}  # owner -> (expiration, stored, record)
        self.rejected = 0  # gossiped records refused (bad signature, schema, admission)

    def take(self, peer_id: str, stored: object, expiration: float, record: PeerRecord) -> None:
        """Keep a record a DHT read already checked (``records.parse_swarm``'s ``keep``), if newer than ours."""
        if isinstance(stored, dict):
            self._put(peer_id, expiration, stored, record)

    def offer(self, entries: list[dict[str, Any]]) -> int:
        """Check gossiped records (``Records.records``) as a DHT node would and keep the valid, newer ones; returns
        how many owners' records were new or newer. Invalid ones are counted in ``rejected``, never raised."""
        learnt = 0
        for entry in entries:
            peer_id, expiration = entry["p"], float(entry["e"])
            stored: dict[str, Any] = {k: entry[k] for k in ("b", "k", "s", "c") if k in entry}
            try:
                body = open_envelope(self.key, peer_id, stored, expiration)
                record = PeerRecord.from_value(peer_id, body)
                if self.admit is not None:
                    self.admit(peer_id, stored.get("c"), expiration)
            except (SignatureError, RecordError, ValueError) as e:  # AdmissionError is a ValueError
                self.rejected += 1
                logger.debug("refusing a gossiped record of %s: %s", str(peer_id)[:64], e)
                continue
            learnt += self._put(peer_id, expiration, stored, record)
        return learnt

    def _put(self, peer_id: str, expiration: float, stored: dict[str, Any], record: PeerRecord) -> int:
        if expiration <= self.clock():
            return 0
        held = self._held.get(peer_id)
        if held is not None and held[0] >= expiration:
            return 0
        if held is None and len(self._held) >= MAX_BOOK:
            self._expire()
            if len(self._held) >= MAX_BOOK:
                return 0
        self._held[peer_id] = (expiration, stored, record)
        return 1

    def _expire(self) -> None:
        now = self.clock()
        self._held = {p: h for p, h in self._held.items() if h[0] > now}

    def records(self, *, include_stopped: bool = False) -> dict[str, PeerRecord]:
        """The unexpired records held, keyed by owner (a withdrawn peer's 'stopped' record hides it)."""
        self._expire()
        return {p: h[2] for p, h in self._held.items() if include_stopped or h[2].state is not PeerState.STOPPED}

    def entries(self, limit: int = MAX_GOSSIP_RECORDS) -> list[dict[str, Any]]:
        """The held records as ``Records`` carries them, the latest-expiring first."""
        self._expire()
        newest = sorted(self._held.items(), key=lambda kv: kv[1][0], reverse=True)[:limit]
        return [{"p": p, "e": e, **stored} for p, (e, stored, _r) in newest]


def serve_records(book: RecordBook, run_id: str, count: Count) -> Callable[[Message, str], Awaitable[Message]]:
    """The ``records`` handler: the book's records to a peer of the run, at most once per SERVE_MIN_INTERVAL_S each."""
    return once_per("records", RecordsRequest, run_id, SERVE_MIN_INTERVAL_S,
                    lambda: Records(run_id=run_id, records=book.entries()), count, max_peers=MAX_BOOK)


async def ask_records(book: RecordBook, run_id: str, peer_id: str,
                      send: Callable[[str, str, Message], Awaitable[Message]],
                      count: Count) -> int:
    """Ask ``peer_id`` for its records and keep the valid, newer ones; returns how many were new. Never raises."""
    try:
        reply = await send(peer_id, RECORDS_RPC, RecordsRequest(run_id=run_id))
    except Exception as e:  # a peer that does not answer is no reason to stop; the next gossip asks another
        count("gossip_failed", 1)
        logger.debug("asking %s for records failed: %r", peer_id[:16], e)
        return 0
    if not isinstance(reply, Records) or reply.run_id != run_id:
        count("gossip_failed", 1)
        return 0
    before = book.rejected
    learnt = book.offer(reply.records)
    count("rejected:gossiped_record", book.rejected - before)
    count("records_learnt", learnt)
    return learnt
