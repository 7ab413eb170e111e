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
