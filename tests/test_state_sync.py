"""State sync between real hivemind P2P peers on 127.0.0.1: exact transfer, a donor dying mid-transfer, refusals."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hivemind.p2p import P2P

from peer.ops.metrics import PeerMetrics
from peer.state.sync import StateServer, StateSyncConfig, load_state_from_peers
from protocol.errors import ErrorCode, RemoteError
from protocol.messages import Error, StateRequest, pack, unpack
from protocol.rpc import RpcServer
from trainer.config import RunConfig
from trainer.worker import StageWorker

pytestmark = pytest.mark.timeout(90)

RUN = RunConfig.default()
# libp2p streams on a loaded host are now and then cut mid-reply (the joiner's retry covers it, as in production)
SMALL_CHUNKS = StateSyncConfig(chunk_bytes=128 * 1024, chunk_timeout_s=3.0, chunk_retries=2, peer_start_burst=10**6,
                               peer_chunk_burst=10**6)


def _trained_worker(seed: int, steps: int) -> StageWorker:
    """A stage-0 worker with optimiser state and counters, different for each seed."""
    torch.manual_seed(0)
    w = StageWorker(RUN, 0)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        w.set_grads([torch.randn(p.shape, generator=g) for p in w.parameters()])
        w.optimizer_step()
    return w


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


class Node:
    def __init__(self, p2p: P2P, worker: StageWorker, run: RunConfig = RUN) -> None:
        self.p2p, self.worker, self.id = p2p, worker, p2p.peer_id.to_base58()
        self.metrics = PeerMetrics(self.id, 0)
        self.executor = ThreadPoolExecutor(1)
        self.server = StateServer(p2p=p2p, rpc_server=RpcServer(p2p), run=run, stage=0,
                                  worker_call=self.worker_call, metrics=self.metrics, config=SMALL_CHUNKS)

    async def worker_call(self, fn):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, self.worker)


async def _nodes(workers: list[StageWorker]) -> list[Node]:
    first = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    maddrs = await first.get_visible_maddrs()
    rest = await asyncio.gather(*(P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
                                  for _ in workers[1:]))
    nodes = [Node(p, w) for p, w in zip([first, *rest], workers, strict=True)]
    for n in nodes:
        await n.server.start()
    return nodes


async def _shutdown(nodes: list[Node]) -> None:
    await asyncio.gather(*(n.p2p.shutdown() for n in nodes), return_exceptions=True)
    for n in nodes:
        n.executor.shutdown(wait=False)


def test_joiner_gets_the_exact_state_from_the_second_donor_when_the_first_dies_mid_transfer():
    async def main():
        joiner_worker = StageWorker(RUN, 0)
        reference = joiner_worker.state_dict()
        dying, good, joiner = await _nodes([_trained_worker(1, 2), _trained_worker(2, 3), joiner_worker])
        dying.server.ready = good.server.ready = True
        loop = asyncio.get_running_loop()
        served: list[int] = []
        build = dying.server._build

        def build_then_die(snap, chunk):  # the first donor's process dies while serving chunk 3
            served.append(chunk)
            if chunk == 3:
                asyncio.run_coroutine_threadsafe(dying.p2p.shutdown(), loop).result(timeout=10)
                time.sleep(0.2)
            return build(snap, chunk)

        dying.server._build = build_then_die
        try:
            t0 = time.monotonic()
            state = await load_state_from_peers(p2p=joiner.p2p, run=RUN, stage=0, metrics=joiner.metrics,
                                                reference=reference, donors=[dying.id, good.id],
                                                config=SMALL_CHUNKS)
            elapsed = time.monotonic() - t0
        finally:
            await _shutdown([dying, good, joiner])
        assert served[0] == 0 and 3 in served and len(served) == len(set(served))  # each chunk asked for once
        assert state is not None
        assert _same(state, good.worker.state_dict()), "the state must be the good donor's, byte for byte"
        counters = joiner.metrics.snapshot()["counters"]
        assert counters.get("state_sync_donor_failed") == 1 and counters.get("state_sync_ok") == 1
        assert good.metrics.snapshot()["counters"]["state_chunks_served"] > 4  # several chunks really were used
        joiner_worker.load_state_dict(state)
        assert joiner_worker.local_step == 3
        for p, q in zip(joiner_worker.parameters(), good.worker.parameters(), strict=True):
            assert torch.equal(p, q)
        assert elapsed < 30

    asyncio.run(main())


def test_donors_that_are_not_ready_or_of_another_run_give_none_and_a_ready_one_serves():
    async def main():
        donor, joiner = await _nodes([_trained_worker(1, 1), StageWorker(RUN, 0)])
        other_run = RUN.replace(seed=RUN.seed + 1)
        try:
            kwargs = dict(p2p=joiner.p2p, stage=0, metrics=joiner.metrics, donors=[donor.id], config=SMALL_CHUNKS)
            assert await load_state_from_peers(run=RUN, **kwargs) is None  # donor still loading its own state
            donor.server.ready = True
            assert await load_state_from_peers(run=other_run, **kwargs) is None  # wrong run: refused
            wrong_shape = joiner.worker.state_dict()
            wrong_shape["model"] = dict(wrong_shape["model"])
            name = next(iter(wrong_shape["model"]))
            wrong_shape["model"][name] = torch.zeros(3)
            assert await load_state_from_peers(run=RUN, reference=wrong_shape, **kwargs) is None
            state = await load_state_from_peers(run=RUN, reference=joiner.worker.state_dict(), **kwargs)
        finally:
            await _shutdown([donor, joiner])
        assert state is not None and _same(state, donor.worker.state_dict())
        assert joiner.metrics.snapshot()["counters"]["state_sync_donor_failed"] == 3
        assert donor.metrics.snapshot()["counters"].get("rejected:state_wrong_run") == 1

    asyncio.run(main())


class Direct:
    """Transport straight into in-process StateServers (through the real message codec); ``after`` hooks a call."""

    def __init__(self, servers: dict[str, StateServer], after=None) -> None:
        self.servers, self.after = servers, after

    async def call(self, peer_id, name, msg, *, timeout):
        reply = await self.servers[peer_id]._handle(unpack(pack(msg)), "joiner")
        if self.after is not None:
            await self.after(peer_id, msg)
        if isinstance(reply, Error):
            raise RemoteError(reply.code, reply.message)
        return unpack(pack(reply))


def _server(worker: StageWorker, clock=time.monotonic, config=SMALL_CHUNKS) -> StateServer:
    async def worker_call(fn):
        return fn(worker)

    server = StateServer(p2p=None, rpc_server=None, run=getattr(worker, "run", RUN), stage=0, worker_call=worker_call,
                         metrics=PeerMetrics("donor", 0), config=config, transport=Direct({}), clock=clock)
    server.ready = True
    server.worker = worker  # for the tests' comparisons
    return server


def test_a_donor_replacing_its_snapshot_mid_transfer_is_dropped_for_the_next():
    async def main():
        first, second = _server(_trained_worker(1, 1)), _server(_trained_worker(2, 2))

        async def bump(peer_id, msg):  # donor "first" takes a new snapshot right after serving chunk 1
            if peer_id == "first" and msg.chunk == 1:
                first._snapshots[0] = await first._take()

        metrics = PeerMetrics("joiner", 0)
        state = await load_state_from_peers(p2p=None, run=RUN, stage=0, metrics=metrics, donors=["first", "second"],
                                            config=SMALL_CHUNKS,
                                            transport=Direct({"first": first, "second": second}, bump))
        assert state is not None and _same(state, second.worker.state_dict())
        assert metrics.snapshot()["counters"]["state_sync_donor_failed"] == 1

    asyncio.run(main())


def test_a_fast_stage_gets_a_new_snapshot_once_it_is_max_lag_steps_ahead_of_the_shared_one():
    """A fast stage makes thousands of steps in 60 s: a joiner must not receive a state that far behind what the
    donor announced (in a churn run a restarted peer got step 4,069 from a donor announcing 4,518)."""
    async def main():
        now = [1000.0]
        config = StateSyncConfig(chunk_bytes=128 * 1024, snapshot_max_age_s=60, snapshot_max_lag_steps=200)
        server = _server(_trained_worker(1, 1), clock=lambda: now[0], config=config)
        server.ready = True

        async def ask():
            return (await server._handle(StateRequest(run_id=RUN.run_id, stage=0, chunk=0, version=0), "j")).version

        server.metrics.local_step = 1
        v1 = await ask()
        taken = server._snapshots[0][0].local_step
        server.metrics.local_step = taken + 200
        now[0] += 1
        assert await ask() == v1  # 200 steps behind: still shared
        server.metrics.local_step = taken + 201
        assert await ask() == v1 + 1  # 201: a new one, though it is only a second old

    asyncio.run(main())


def test_server_shares_a_fresh_snapshot_keeps_the_replaced_one_for_its_transfers_and_releases_idle_ones():
    async def main():
        now = [1000.0]
        config = StateSyncConfig(chunk_bytes=128 * 1024, snapshot_max_age_s=60, snapshot_idle_s=60)
        server = _server(_trained_worker(1, 1), clock=lambda: now[0], config=config)

        async def ask(chunk, version=0, run=RUN):
            return await server._handle(StateRequest(run_id=run.run_id, stage=0, chunk=chunk, version=version),
                                        "joiner")

        server.ready = False
        assert (await ask(0)).code == ErrorCode.NOT_READY
        server.ready = True
        assert (await ask(1)).code == ErrorCode.BAD_REQUEST  # a later chunk must name its snapshot
        assert (await ask(1, version=7)).code == ErrorCode.NOT_READY  # no such snapshot: start at chunk 0
        v1 = (await ask(0)).version
        now[0] += 10
        assert (await ask(0)).version == v1  # a second joiner shares the fresh snapshot
        # Demand every few seconds must not pin a snapshot forever (neighbour backups every 2 s once received a
        # step-0 state for as long as they kept asking): past its age a new transfer gets a new snapshot ...
        for _ in range(30):
            now[0] += 5
            assert (await ask(1, version=v1)).version == v1
        assert (await ask(0)).version == v1 + 1
        # ... while the transfer of the replaced one goes on reading it, whole
        now[0] += 5
        assert (await ask(1, version=v1)).version == v1
        assert (await ask(1, version=v1 + 1)).version == v1 + 1
        now[0] += 61  # nobody touched either for 61 s: both released
        assert (await ask(1, version=v1)).code == ErrorCode.NOT_READY
        assert (await ask(1, version=v1 + 1)).code == ErrorCode.NOT_READY
        assert (await ask(0)).version == v1 + 2
        assert len(server._snapshots[0]) == 1
        assert (await ask(10**6, version=v1 + 2)).code == ErrorCode.BAD_REQUEST
        assert (await ask(0, run=RUN.replace(seed=5))).code == ErrorCode.WRONG_RUN
        counters = server.metrics.snapshot()["counters"]
        assert counters["rejected:state_bad_chunk"] == 1 and counters["rejected:state_wrong_run"] == 1
        assert counters["rejected:state_no_version"] == 1

    asyncio.run(main())


def test_a_donor_whose_state_is_not_a_dict_is_dropped_for_the_next():
    """Without a reference to check against, a delivered state must still be a stage's state dict at its root."""
    class ListWorker:
        def state_dict(self):
            return [torch.zeros(3)]

    async def main():
        liar, honest = _server(ListWorker()), _server(_trained_worker(1, 1))
        metrics = PeerMetrics("joiner", 0)
        state = await load_state_from_peers(p2p=None, run=RUN, stage=0, metrics=metrics, donors=["liar", "honest"],
                                            config=SMALL_CHUNKS, transport=Direct({"liar": liar, "honest": honest}))
        assert state is not None and _same(state, honest.worker.state_dict())
        assert metrics.snapshot()["counters"]["state_sync_donor_failed"] == 1

    asyncio.run(main())
