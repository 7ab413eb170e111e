"""Membership gossip (peer/membership/gossip.py): signed records passed peer to peer, checked as a DHT node checks
them, so that a DHT that withholds the run's records (an eclipse) cannot hide the swarm."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import pytest
from hivemind.utils import get_dht_time

from peer.config import PeerConfig
from peer.membership.admission import issue, organiser_key
from peer.membership.gate import AdmissionGate
from peer.membership.gossip import RECORDS_RPC, RecordBook, ask_records, serve_records
from peer.membership.records import PeerRecord, admission_check, swarm_key
from peer.membership.routing import Router
from peer.membership.signing import Signer, seal
from peer.ops.metrics import PeerMetrics
from peer.presence import Presence
from protocol.errors import ErrorCode
from protocol.messages import Error, Message, Records, RecordsRequest, pack, unpack
from trainer.config import AccessConfig, RunConfig

RUN = RunConfig(name="gossip-test")


def _entry(signer: Signer, *, run_id: str = RUN.run_id, ttl: float = 20.0, stage: int = 0, version: int = 1,
           state: str = "training", credential: bytes | None = None, expiration: float | None = None) -> dict:
    exp = expiration if expiration is not None else get_dht_time() + ttl
    rec = PeerRecord(peer_id=signer.peer_id, stage=stage, throughput=1.0, queue=0, version=version, state=state)
    return {"p": signer.peer_id, "e": exp, **seal(signer, swarm_key(run_id), rec.to_value(), exp, credential)}


def test_a_book_keeps_valid_records_newest_first_and_refuses_forgeries():
    a, b, stranger = Signer.generate(), Signer.generate(), Signer.generate()
    book = RecordBook(RUN.run_id)
    assert book.offer([_entry(a), _entry(b, stage=1)]) == 2
    assert set(book.records()) == {a.peer_id, b.peer_id} and book.records()[b.peer_id].stage == 1
    newer = _entry(a, ttl=40.0, version=7)
    assert book.offer([newer]) == 1 and book.records()[a.peer_id].version == 7
    assert book.offer([_entry(a, ttl=30.0, version=3)]) == 0  # a replayed older record loses to the newer one
    assert book.records()[a.peer_id].version == 7
    altered = {**_entry(b, ttl=50.0), "b": _entry(stranger)["b"]}  # another body under b's signature
    stolen = {**_entry(stranger, ttl=50.0), "p": b.peer_id}  # the stranger's record under b's id
    other_run = _entry(stranger, run_id="another-run")
    too_late = _entry(stranger, ttl=3600.0)  # expiration beyond what any record may claim
    expired = _entry(stranger, expiration=get_dht_time() - 1)
    assert book.offer([altered, stolen, other_run, too_late]) == 0 and book.rejected == 4
    assert book.offer([expired]) == 0
    assert set(book.records()) == {a.peer_id, b.peer_id}
    assert book.offer([_entry(b, ttl=60.0, state="stopped")]) == 1  # a withdrawal supersedes and hides
    assert set(book.records()) == {a.peer_id}
    assert [e["p"] for e in book.entries()] == [b.peer_id, a.peer_id]  # latest-expiring first


def test_a_closed_runs_book_takes_only_records_the_organiser_admitted():
    organiser, member, stranger = Signer.generate(), Signer.generate(), Signer.generate()
    closed = RunConfig(name="closed", access=AccessConfig(
        mode="closed", organiser_key=base64.b64encode(organiser.public_key).decode()))
    book = RecordBook(closed.run_id, admission_check(closed.run_id, organiser_key(closed)))
    cred = issue(organiser, run_id=closed.run_id, peer_id=member.peer_id, valid_s=3600)
    assert book.offer([_entry(member, run_id=closed.run_id, credential=cred),
                       _entry(stranger, run_id=closed.run_id),
                       _entry(stranger, run_id=closed.run_id, credential=cred)]) == 1
    assert set(book.records()) == {member.peer_id} and book.rejected == 2


def _wire(handler):
    """A send() that goes through the messages' wire form to ``handler`` (as the RPC layer would)."""
    async def send(peer_id: str, name: str, msg: Message) -> Message:
        assert name == RECORDS_RPC
        return unpack(pack(await handler(unpack(pack(msg)), "QmAsker")))
    return send


def test_a_peer_learns_the_swarm_from_another_and_requests_are_rate_limited():
    signers = [Signer.generate() for _ in range(3)]
    known = RecordBook(RUN.run_id)
    known.offer([_entry(s, stage=i % 2) for i, s in enumerate(signers)])
    counts: dict[str, int] = {}

    def count(name: str, n: int = 1) -> None:
        counts[name] = counts.get(name, 0) + n

    handler = serve_records(known, RUN.run_id, count)
    eclipsed = RecordBook(RUN.run_id)

    async def go() -> tuple[int, int, Message]:
        first = await ask_records(eclipsed, RUN.run_id, "QmKnown", _wire(handler), count)
        again = await ask_records(eclipsed, RUN.run_id, "QmKnown", _wire(handler), count)  # within the interval
        wrong = await handler(RecordsRequest(run_id="another-run"), "QmOther")
        return first, again, wrong

    first, again, wrong = asyncio.run(go())
    assert first == 3 and set(eclipsed.records()) == {s.peer_id for s in signers}
    assert again == 0 and counts["rejected:records_rate_limited"] == 1 and counts["gossip_failed"] == 1
    assert isinstance(wrong, Error) and wrong.code == ErrorCode.BAD_REQUEST
    assert counts["records_served"] == 1 and counts["records_learnt"] == 3


def test_a_liar_serving_forged_records_teaches_nothing():
    honest = Signer.generate()
    forged = {**_entry(honest), "b": _entry(Signer.generate())["b"]}

    async def liar(msg: Message, peer_id: str) -> Message:
        return Records(run_id=RUN.run_id, records=[forged] * 50)

    counts: dict[str, int] = {}
    book = RecordBook(RUN.run_id)
    learnt = asyncio.run(ask_records(book, RUN.run_id, "QmLiar", _wire(liar),
                                     lambda name, n=1: counts.__setitem__(name, counts.get(name, 0) + n)))
    assert learnt == 0 and not book.records() and counts["rejected:gossiped_record"] == 50


class _EclipsedDHT:
    """A DHT whose reads of the run's key come back empty, as through nodes that withhold the records."""

    def get(self, key: str, latest: bool, return_future: bool) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


def test_an_eclipsed_peer_sees_the_swarm_through_an_initial_peer(tmp_path: Path):
    """Presence's refresh with a DHT that returns nothing: gossip from the initial peer fills the view."""
    members = [Signer.generate() for _ in range(2)]
    known = RecordBook(RUN.run_id)
    known.offer([_entry(s, stage=i) for i, s in enumerate(members)])
    handler = serve_records(known, RUN.run_id, lambda name, n=1: None)
    cfg = PeerConfig(initial_peers=[f"/ip4/127.0.0.1/tcp/1/p2p/{members[0].peer_id}"], gossip_every_s=0.01,
                     identity_path=tmp_path / "id.key")
    metrics = PeerMetrics("QmMe", 0)
    presence = Presence(RUN, cfg, metrics, gate=AdmissionGate(RUN, cfg), stop=asyncio.Event(),
                        router=Router([1.0, 1.0]))
    presence.dht, presence.my_id = _EclipsedDHT(), "QmMe"  # type: ignore[assignment]
    asked: list[str] = []

    async def send(peer_id: str, name: str, msg: Message, *, timeout: float | None = None) -> Message:
        asked.append(peer_id)
        return await _wire(handler)(peer_id, name, msg)

    presence.send = send  # type: ignore[method-assign]

    async def go() -> dict[str, PeerRecord]:
        assert await presence.refresh_swarm() == {}  # the DHT shows nothing; gossip starts in the background
        assert presence._gossip is not None
        await presence._gossip
        return await presence.refresh_swarm()

    seen = asyncio.run(go())
    assert asked == [members[0].peer_id]
    assert set(seen) == {m.peer_id for m in members}
    assert metrics.count("records_learnt") == 2


@pytest.mark.parametrize("every", [0.0])
def test_gossip_can_be_turned_off(tmp_path: Path, every: float):
    cfg = PeerConfig(initial_peers=["/ip4/127.0.0.1/tcp/1/p2p/QmSomeone"], gossip_every_s=every,
                     identity_path=tmp_path / "id.key")
    presence = Presence(RUN, cfg, PeerMetrics("QmMe", 0), gate=AdmissionGate(RUN, cfg), stop=asyncio.Event(),
                        router=Router([1.0, 1.0]))
    presence.dht = _EclipsedDHT()  # type: ignore[assignment]
    asyncio.run(presence.refresh_swarm())
    assert presence._gossip is None
