"""Vouches (peer/membership/vouches.py): a joiner draws the witnesses of a state from the peers its initial peers
know by validated work, so that identities that did no work for anyone cannot outvote a stage's honest replicas."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from test_state_sync import _server, _trained_worker
from test_state_witness import _liar, _load, _weights_of

from peer.config import PeerConfig
from peer.membership.gate import AdmissionGate
from peer.membership.routing import Router
from peer.membership.vouches import VOUCHES_RPC, ask_vouches, serve_vouches
from peer.ops.metrics import PeerMetrics
from peer.presence import Presence
from protocol.errors import ErrorCode
from protocol.messages import MAX_VOUCHES, Error, Message, Vouches, VouchesRequest, pack, unpack
from trainer.config import RunConfig

pytestmark = pytest.mark.timeout(120)

RUN = RunConfig(name="vouches-test")


class Counts(dict):
    def __call__(self, name: str, n: int = 1) -> None:
        self[name] = self.get(name, 0) + n


def _wire(handlers: dict[str, object]):
    """A send() that reaches each anchor's handler through the messages' wire form; others are unreachable."""
    async def send(peer_id: str, name: str, msg: Message) -> Message:
        assert name == VOUCHES_RPC
        if peer_id not in handlers:
            raise ConnectionError(f"{peer_id} is unreachable")
        return unpack(pack(await handlers[peer_id](unpack(pack(msg)), "QmJoiner")))  # type: ignore[operator]
    return send


def test_anchors_name_the_peers_they_know_and_are_rate_limited():
    counts = Counts()
    known = [f"Qm{i}" for i in range(MAX_VOUCHES + 10)]
    handler = serve_vouches(lambda: known, RUN.run_id, counts)

    async def go() -> tuple[list[str], list[str], Message]:
        first = await ask_vouches(["QmAnchor", "QmGone"], RUN.run_id, _wire({"QmAnchor": handler}), counts)
        again = await ask_vouches(["QmAnchor"], RUN.run_id, _wire({"QmAnchor": handler}), counts)  # too soon
        wrong = await handler(VouchesRequest(run_id="another-run"), "QmOther")
        return first, again, wrong

    first, again, wrong = asyncio.run(go())
    # the anchor that answered first, then the most recent MAX_VOUCHES of the peers it knows, in its order
    assert first == ["QmAnchor", *known[-MAX_VOUCHES:]]
    assert again == [] and counts["rejected:vouches_rate_limited"] == 1
    assert counts["vouches_failed"] == 2 and counts["vouches_served"] == 1  # the unreachable one, then the refusal
    assert isinstance(wrong, Error) and wrong.code == ErrorCode.BAD_REQUEST


def test_a_reply_of_another_run_or_kind_vouches_for_nobody():
    async def other_run(msg: Message, peer_id: str) -> Message:
        return Vouches(run_id="another-run", peers=["QmSybil"])

    async def garbage(msg: Message, peer_id: str) -> Message:
        return Error(code=ErrorCode.BAD_REQUEST, message="no")

    counts = Counts()
    got = asyncio.run(ask_vouches(["QmA", "QmB"], RUN.run_id, _wire({"QmA": other_run, "QmB": garbage}), counts))
    assert got == [] and counts["vouches_failed"] == 2


def test_presence_prefers_its_own_validated_peers_then_the_anchors_vouches(tmp_path: Path):
    cfg = PeerConfig(initial_peers=["/ip4/127.0.0.1/tcp/1/p2p/QmAnchor", "/ip4/127.0.0.1/tcp/2/p2p/QmMe"],
                     identity_path=tmp_path / "id.key")
    presence = Presence(RUN, cfg, PeerMetrics("QmMe", 0), gate=AdmissionGate(RUN, cfg), stop=asyncio.Event(),
                        router=Router([1.0, 1.0]))
    presence.my_id = "QmMe"
    asked: list[str] = []
    handler = serve_vouches(lambda: ["QmB", "QmD"], RUN.run_id, Counts())

    async def send(peer_id: str, name: str, msg: Message, *, timeout: float | None = None) -> Message:
        asked.append(peer_id)
        return await _wire({"QmAnchor": handler})(peer_id, name, msg)

    presence.send = send  # type: ignore[method-assign]
    assert presence.initial_ids == ["QmAnchor"]  # our own address among the initial peers is not asked
    assert presence.trusted_peers() == []
    assert asyncio.run(presence.ask_anchors()) == ["QmAnchor", "QmB", "QmD"] and asked == ["QmAnchor"]
    presence.trusted_peers_own = lambda: ["QmD", "QmOwn"]  # type: ignore[method-assign]
    assert presence.trusted_peers() == ["QmD", "QmOwn", "QmAnchor", "QmB"]
    presence.revoke("QmB")  # caught doing bad work here: no longer a witness, whoever vouched for it
    assert presence.trusted_peers() == ["QmD", "QmOwn", "QmAnchor"]


def test_sybils_that_outvote_a_stage_lose_to_a_joiner_that_asked_its_anchor():
    """Three identical liars against two honest replicas: drawn from the announced records, the liars are the
    majority and their state is loaded; drawn from the anchor's vouches, the honest replicas witness and refuse it,
    and the joiner loads an honest replica's state."""
    async def main() -> None:
        honest = {f"h{i}": _server(_trained_worker(i, 2)) for i in (1, 2)}
        liar = _liar("noise")
        servers = {**honest, **{f"s{i}": _server(liar) for i in (1, 2, 3)}}
        donors = ["s1", "h2"]  # the liar announced the most progress
        blind = await _load(servers, donors, list(servers), PeerMetrics("joiner", 0))
        assert blind is not None and _weights_of(blind, liar)
        anchor = serve_vouches(lambda: ["h1", "h2"], RUN.run_id, Counts())  # the liars did no work for it
        vouched = await ask_vouches(["QmAnchor"], RUN.run_id, _wire({"QmAnchor": anchor}), Counts())
        metrics = PeerMetrics("joiner", 0)
        state = await _load(servers, donors, list(servers), metrics, trusted=vouched)
        assert state is not None and _weights_of(state, servers["h2"].worker)
        assert metrics.snapshot()["counters"].get("state_sync_outvoted", 0) >= 1

    asyncio.run(main())


def test_generate_uses_the_vouched_replica_of_a_stage_the_sybils_announce_more_of():
    """``asyncmesh-peer generate``'s witnesses (RemotePipeline.witness_stages): three identical liars and one honest
    replica of stage 0. Judged among all announced replicas the liars are the majority and the honest one is
    excluded; judged among the replicas the initial peers vouch for, the liars are."""
    from test_state_sync import RUN as SYNC_RUN
    from test_state_sync import Direct

    from peer.membership.records import PeerRecord
    from peer.pipeline.remote import RemotePipeline

    async def main() -> None:
        liar = _liar("zeros")
        servers = {"h1": _server(_trained_worker(1, 2)), **{f"s{i}": _server(liar) for i in (1, 2, 3)}}
        direct = Direct(servers)
        records = {p: PeerRecord(peer_id=p, stage=0, throughput=1.0, queue=0, version=5, state="training")
                   for p in servers}

        async def read() -> dict[str, PeerRecord]:
            return records

        async def call(peer_id: str, name: str, msg: Message, timeout: float) -> Message:
            return await direct.call(peer_id, name, msg, timeout=timeout)

        for vouched, excluded in ((None, ["h1"]), (["QmAnchor", "h1"], ["s1", "s2", "s3"])):
            pipe = RemotePipeline(run=SYNC_RUN, call=call, read_swarm=read)
            await pipe.refresh()
            assert (await pipe.witness_stages(vouched)).get(0) == excluded, vouched
            assert pipe.excluded == set(excluded)

    asyncio.run(main())


def test_vouched_donors_are_asked_first_so_sybils_cannot_use_up_the_attempts():
    """Five identities announcing the highest versions would take all 4 donor attempts (StateSyncConfig.max_donors)
    and the joiner would start from the init; donors the initial peers vouch for are asked first."""
    from peer.state.sync import StateSyncConfig, vouched_first

    ranked = ["liar", "s1", "s2", "s3", "s4", "h1", "h2"]  # by announced version
    assert vouched_first(ranked, ["QmAnchor", "h2", "h1"])[:2] == ["h1", "h2"]  # rank order kept within each group
    assert vouched_first(ranked, None) == ranked
    assert len(ranked) - 2 > StateSyncConfig().max_donors  # the sybils alone would use up every attempt
