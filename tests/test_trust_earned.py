"""Trust is earned by validated work: answering a call makes no peer known (no refusal budget, never banned, a
preferred state witness); a trained gradient or micro-batch, or an averaging part the aggregate kept, does."""

from __future__ import annotations

import asyncio

import pytest
import torch

import protocol.rpc as rpc_mod
from peer.averaging.config import NetAveragingConfig
from peer.averaging.sync import StageMembers, SyncAverager
from peer.membership.records import PeerRecord
from peer.ops.metrics import PeerMetrics
from peer.pipeline.guard import GuardConfig, WorkShare
from peer.state.sync import StateSyncConfig
from protocol.codecs.registry import encode
from protocol.errors import RemoteError
from protocol.messages import Ack, AveragingPart, Busy, StateChunk, StateDigestRequest, StateRequest
from protocol.rpc import RpcServer, RpcTransport
from tests.test_netavg_rounds import RUN, MemTransport
from tests.test_state_sync import RUN as STATE_RUN
from tests.test_state_sync import _server, _trained_worker


def rec(pid: str, stage: int) -> PeerRecord:
    return PeerRecord(peer_id=pid, stage=stage, throughput=1.0, queue=0, version=0, state="training")


class _Server:
    def __init__(self) -> None:
        self.vouched: list[str] = []

    def vouch(self, peer: str) -> None:
        self.vouched.append(peer)


def test_an_answer_to_our_call_does_not_make_a_peer_known(monkeypatch):
    async def fake_call(p2p, peer_id, name, msg, **kw):
        return Ack()

    monkeypatch.setattr(rpc_mod, "call", fake_call)
    server = _Server()
    transport = RpcTransport(None, server)  # type: ignore[arg-type]
    assert isinstance(asyncio.run(transport.call("sybil", "state", Ack(), timeout=1.0)), Ack)
    assert server.vouched == []


def test_every_handler_has_a_request_size_limit_that_its_largest_honest_request_fits():

    from peer.handlers.sizes import HANDLER_KINDS, pipeline_request_bytes
    from protocol.codecs.registry import encode
    from protocol.messages import AveragingPart, pack
    from trainer.config import RunConfig
    from trainer.model import build_stage

    run = RunConfig.default()
    sizes = pipeline_request_bytes(run)
    assert set(HANDLER_KINDS) <= set(sizes)  # avg_part, state and sync had none (the server's 256 MiB)
    params = [p.detach() for p in build_stage(run, 0).parameters()]
    whole = AveragingPart(run_id=run.run_id, stage=0, round_no=1, sender="Q" * 52,
                          tensors=[encode(p, "none") for p in params], weight=1.0)
    assert len(pack(whole)) <= sizes["avg_part"] < 2 * len(pack(whole)) + 2**20
    assert sizes["state"] < 64 * 1024


def test_sync_mode_admits_parts_only_from_announced_replicas_of_the_stage():
    """phantom barriers: before, any peer's part for a future step opened a barrier (4 at most, then honest replicas'
    were refused) and made a later stage close its flush early; membership was checked only when averaging."""
    async def main() -> None:
        net = MemTransport()
        view = {"p0": rec("p0", 0), "p1": rec("p1", 0), "s1": rec("s1", 1)}
        reads: list[int] = []

        async def refresh() -> None:
            reads.append(1)
            if len(reads) == 2:
                view["late"] = rec("late", 0)  # a replica that announced itself a moment ago

        opened: list[tuple[int, str]] = []
        members = StageMembers(stage=0, swarm=lambda: view, refresh=refresh, refresh_s=0.0)
        target = SyncAverager(p2p=None, rpc_server=None, run=RUN, stage=0, metrics=PeerMetrics("p0", 0),
                              config=NetAveragingConfig(sync_timeout_s=0.3), transport=net.for_peer("p0"),
                              me="p0", member=members)
        target.on_remote_open = lambda step, peer: opened.append((step, peer))
        await target.start()

        def part(step: int, sender: str) -> AveragingPart:
            return AveragingPart(run_id=RUN.run_id, stage=0, round_no=step, sender=sender,
                                 tensors=[encode(torch.ones(6), "none")], weight=1.0)

        for sender in ("evil", "s1"):  # a stranger, and an announced peer of another stage
            for step in range(1, 6):
                with pytest.raises(RemoteError, match="not_member"):
                    await net.for_peer(sender).call("p0", "avg_sync", part(step, sender), timeout=2.0)
        assert target.exchange.slots == {} and opened == []
        assert target.metrics.snapshot()["counters"]["rejected:avg_not_member"] == 10
        honest = asyncio.create_task(net.for_peer("p1").call("p0", "avg_sync", part(7, "p1"), timeout=2.0))
        late = asyncio.create_task(net.for_peer("late").call("p0", "avg_sync", part(8, "late"), timeout=2.0))
        await asyncio.sleep(0.05)
        assert set(target.exchange.slots) == {7, 8} and opened == [(7, "p1"), (8, "late")]
        honest.cancel()
        late.cancel()

    asyncio.run(main())


def test_a_peer_banned_for_bad_work_is_a_stranger_again():
    """Known is not for good: a sender whose work our loss check refused again and again while others' was trained
    (a share ban) loses the known peer's budgets, its immunity to bans and its place among the preferred state
    witnesses, until validated work vouches for it anew (a hop banned by spot checks likewise: test_peer_spotcheck)."""
    server = RpcServer(None)  # type: ignore[arg-type]  # no p2p: only its bookkeeping of known peers is used
    banned: list[str] = []
    share = WorkShare(GuardConfig(share_ban_after=3), lambda name: None)
    share.on_ban = lambda peer: (banned.append(peer), server.revoke(peer))
    for peer in ("honest", "liar"):
        server.vouch(peer)  # both had work trained once
    for _ in range(3):
        share.refused("liar")
        share.trained("honest")
    assert banned == ["liar"]
    assert server.is_known("honest") and not server.is_known("liar") and server.known_peers() == ["honest"]
    server.vouch("liar")  # trained work again: known again
    assert server.is_known("liar")


def test_state_transfers_chunks_and_digests_are_limited_per_peer():
    """state_flood: a peer may start a few transfers or digests (each may cost a snapshot) and fetch chunks at a
    bounded rate; beyond either it is answered Busy, counted, and other peers are served as before."""
    async def main() -> None:
        config = StateSyncConfig(chunk_bytes=16 * 1024)
        server = _server(_trained_worker(1, 1), clock=lambda: 0.0, config=config)
        first = await server._handle(StateRequest(run_id=STATE_RUN.run_id, stage=0, chunk=0), "flooder")
        assert isinstance(first, StateChunk) and first.n_chunks > 2
        run_id, n = STATE_RUN.run_id, first.n_chunks
        chunks = [await server._handle(StateRequest(run_id=run_id, stage=0, chunk=1 + i % (n - 1),
                                                    version=first.version), "flooder")
                  for i in range(config.peer_chunk_burst + 10)]
        assert sum(isinstance(r, StateChunk) for r in chunks) == config.peer_chunk_burst
        assert all(isinstance(r, Busy) for r in chunks[config.peer_chunk_burst:])
        digests = [await server._handle(StateDigestRequest(run_id=run_id, stage=0, seed=i, dims=64), "flooder")
                   for i in range(config.peer_start_burst)]  # chunk 0 spent one of the same budget
        assert sum(isinstance(r, StateChunk) for r in digests) == config.peer_start_burst - 1
        assert isinstance(digests[-1], Busy)
        other = await server._handle(StateDigestRequest(run_id=run_id, stage=0, seed=0, dims=64), "joiner")
        assert isinstance(other, StateChunk)
        assert server.metrics.snapshot()["counters"]["rejected:state_rate_limited"] == 10 + 1

    asyncio.run(main())
