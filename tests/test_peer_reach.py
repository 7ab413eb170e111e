"""The reachability helper dials back only the requester's own observed address, never into private ranges of a
public swarm (it must not serve as a port-probe oracle)."""

from __future__ import annotations

import asyncio
import socket

from peer.membership.reachability import ReachabilityHelper, is_private, swarm_is_local
from protocol.messages import PROTOCOL_VERSION, Ack, Error, Hello, StateRequest


def _hello(*maddrs: str) -> Hello:
    return Hello(protocol_version=PROTOCOL_VERSION, run_id="run", stage=0, peer_id="x", capabilities=list(maddrs))


def test_private_ranges_and_local_swarms():
    assert all(is_private(h) for h in ("127.0.0.1", "10.1.2.3", "192.168.0.1", "172.16.0.9", "169.254.1.1", "::1",
                                       "0.0.0.0", "fc00::1", "localhost"))
    assert not is_private("1.2.3.4") and not is_private("2606:4700::1111")
    assert swarm_is_local(["/ip4/127.0.0.1/tcp/1/p2p/Qm", "/ip4/10.0.0.2/tcp/2"])
    assert not swarm_is_local(["/ip4/127.0.0.1/tcp/1", "/ip4/1.2.3.4/tcp/2"]) and not swarm_is_local([])


def test_reach_dials_only_the_requesters_own_address():
    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        dialled: list[str] = []

        async def observed(peer: str) -> set[str]:
            dialled.append(peer)
            return {"127.0.0.1"} if peer == "me" else {"10.0.0.9"}

        try:
            local = ReachabilityHelper(run_id="run", timeout_s=2, observed=observed, local_swarm=lambda: True,
                                       min_interval_s=0)
            public = ReachabilityHelper(run_id="run", timeout_s=2, observed=observed, local_swarm=lambda: False,
                                        min_interval_s=0)
            assert isinstance(await local.handle(_hello(f"/ip4/127.0.0.1/tcp/{port}"), "me"), Ack)
            # a public swarm: loopback is never dialled, even when it is where the requester connects from
            refused = await public.handle(_hello(f"/ip4/127.0.0.1/tcp/{port}"), "me")
            assert isinstance(refused, Error) and refused.code.name == "BAD_REQUEST"
            # another host than the requester's own is never dialled; its observed host is, and in a public swarm only
            # when public (this one, 10.0.0.9, is private): refused without dialling
            other = await public.handle(_hello("/ip4/1.2.3.4/tcp/80"), "stranger")
            assert isinstance(other, Error) and other.code.name == "BAD_REQUEST"
            # seen from an address it does not announce (behind NAT): dialled there, on the ports it announces
            assert isinstance(await local.handle(_hello(f"/ip4/10.9.9.9/tcp/{port}"), "me"), Ack)
            closed = socket.socket()
            closed.bind(("127.0.0.1", 0))
            closed_port = closed.getsockname()[1]
            closed.close()
            nat = await local.handle(_hello(f"/ip4/10.9.9.9/tcp/{closed_port}"), "me")
            assert isinstance(nat, Error) and "could not connect to 127.0.0.1:" in nat.message
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def test_a_request_of_the_run_that_is_not_a_hello_is_refused_not_raised():
    async def observed(peer: str) -> set[str]:
        return {"127.0.0.1"}

    helper = ReachabilityHelper(run_id="run", timeout_s=2, observed=observed, local_swarm=lambda: True,
                                min_interval_s=0)
    reply = asyncio.run(helper.handle(StateRequest(run_id="run", stage=0, chunk=0, version=0), "me"))
    assert isinstance(reply, Error) and reply.code.name == "BAD_REQUEST"
