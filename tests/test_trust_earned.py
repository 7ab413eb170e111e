"""Trust is earned by validated work: answering a call makes no peer known (no refusal budget, never banned, a
preferred state witness); a trained gradient or micro-batch, or an averaging part the aggregate kept, does."""

from __future__ import annotations

import asyncio

import protocol.rpc as rpc_mod
from protocol.messages import Ack
from protocol.rpc import RpcTransport


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
