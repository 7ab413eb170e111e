"""Lost replies: thousands of concurrent calls over real p2pd on loopback, every reply must arrive.

Before the server stopped half-closing, about 1 call in 1,000 to 2,000 here ended with "stream ended after 0 of 12
bytes" although the server had replied (docs/protocol.md, "Lost replies").
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from hivemind.p2p import P2P

from protocol.codecs.registry import encode
from protocol.messages import StateChunk, StateRequest
from protocol.rpc import RpcLimits, RpcServer, call

CALLS = 2000
CONCURRENCY = 16  # the server's max_streams_per_peer: no Busy replies


@pytest.mark.timeout(240)
def test_concurrent_calls_never_lose_a_reply_the_server_sent():
    reply = StateChunk("r", 0, 1, 0, 1, {}, {"w": encode(torch.randn(32 * 1024), "none")})  # 128 KiB

    async def main() -> tuple[dict[str, int], int]:
        server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        client = await P2P.create(initial_peers=await server.get_visible_maddrs(),
                                  host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        limits = RpcLimits()
        rpc = RpcServer(server, limits)
        rpc.vouch(client.peer_id.to_base58())  # a known peer: full per-peer budgets (strangers get 4 streams)
        failures: dict[str, int] = {}
        try:
            async def handler(msg, peer):
                await asyncio.sleep(random.random() * 0.002)
                return reply

            await rpc.add_handler("stress", handler)
            slots = asyncio.Semaphore(CONCURRENCY)

            async def one(i: int) -> None:
                async with slots:
                    try:
                        await call(client, server.peer_id, "stress", StateRequest(run_id="r", stage=0, chunk=i),
                                   timeout=30, limits=limits)
                    except Exception as e:
                        failures[str(e)[-70:]] = failures.get(str(e)[-70:], 0) + 1

            await asyncio.gather(*(one(i) for i in range(CALLS)))
            return failures, rpc.served["stress"]
        finally:
            await asyncio.gather(client.shutdown(), server.shutdown(), return_exceptions=True)

    failures, served = asyncio.run(main())
    assert served == CALLS
    assert not failures, failures
