"""The daemon's path end to end: peers found through real hivemind DHT records (membership.records), not a given list.

Two DHT nodes on 127.0.0.1 announce PeerRecords; a joiner finds its donor with ``choose_donors`` over
``fetch_swarm`` and loads its state, then both average rounds whose partners come from the same records.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from peer.averaging.loop import AveragingLoop, NetAveragingConfig
from peer.membership.records import PeerRecord, announce
from peer.ops.metrics import PeerMetrics
from peer.state.sync import StateServer, StateSyncConfig, choose_donors, load_state_from_peers
from protocol.rpc import RpcServer
from tests.dht_utils import signed_dht
from trainer.config import RunConfig
from trainer.worker import StageWorker

pytestmark = pytest.mark.timeout(120)

RUN = RunConfig.default().replace(averaging={"period_s": 1.5, "round_steps": 1, "rounds_per_tick": 1})
CFG = NetAveragingConfig(collect_fraction=0.6, call_timeout_s=1.0, swarm_timeout_s=2.0)


def _record(peer_id: str, state: str, version: int, stage: int = 0) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, stage=stage, throughput=1.0, queue=0, version=version, state=state)


def test_choose_donors_prefers_the_most_trained_training_peers_of_the_stage():
    records = {r.peer_id: r for r in [_record("a", "training", 5), _record("b", "training", 9),
                                      _record("c", "loading_state", 99), _record("d", "training", 50, stage=1),
                                      _record("me", "training", 100)]}
    assert choose_donors(records, 0, "me") == ["b", "a"]


def test_joiner_finds_its_donor_and_its_partners_through_the_dht(tmp_path):
    async def main():
        first, s0 = signed_dht(tmp_path, "p0", RUN.run_id)
        second, s1 = signed_dht(tmp_path, "p1", RUN.run_id, [str(m) for m in first.get_visible_maddrs()])
        dhts, signers = [first, second], [s0, s1]
        executors = [ThreadPoolExecutor(1), ThreadPoolExecutor(1)]
        loops: list[AveragingLoop] = []
        try:
            p2ps = [await d.replicate_p2p() for d in dhts]
            ids = [p.peer_id.to_base58() for p in p2ps]
            torch.manual_seed(0)
            workers = [StageWorker(RUN, 0), StageWorker(RUN, 0)]
            workers[0].set_grads([torch.ones_like(p) for p in workers[0].parameters()])
            workers[0].optimizer_step()
            metrics = [PeerMetrics(i, 0) for i in ids]
            rpcs = [RpcServer(p) for p in p2ps]

            def worker_call(i):
                async def call(fn):
                    return await asyncio.get_running_loop().run_in_executor(executors[i], fn, workers[i])
                return call

            server = StateServer(p2p=p2ps[0], rpc_server=rpcs[0], run=RUN, stage=0, worker_call=worker_call(0),
                                 metrics=metrics[0], config=StateSyncConfig(chunk_bytes=256 * 1024))
            await server.start()
            server.ready = True
            assert await announce(dhts[0], RUN.run_id, _record(ids[0], "training", 1), 60, signer=signers[0])
            assert await announce(dhts[1], RUN.run_id, _record(ids[1], "loading_state", 0), 60, signer=signers[1])

            state = await load_state_from_peers(p2p=p2ps[1], dht=dhts[1], run=RUN, stage=0, metrics=metrics[1],
                                                reference=workers[1].state_dict())
            assert state is not None
            workers[1].load_state_dict(state)
            assert workers[1].local_step == 1
            for p, q in zip(workers[0].parameters(), workers[1].parameters(), strict=True):
                assert torch.equal(p, q)

            assert await announce(dhts[1], RUN.run_id, _record(ids[1], "training", 1), 60, signer=signers[1])
            for i in range(2):
                loops.append(AveragingLoop(p2p=p2ps[i], rpc_server=rpcs[i], dht=dhts[i], run=RUN, stage=0,
                                           worker_call=worker_call(i), metrics=metrics[i], config=CFG))
                await loops[-1].start()
            deadline = time.monotonic() + 20 * RUN.averaging.period_s  # ends at the first success
            while time.monotonic() < deadline and not all(
                    m.snapshot()["counters"].get("averaging_rounds_ok") for m in metrics):
                await asyncio.sleep(0.2)
        finally:
            for loop in loops:
                await loop.stop()
            for d in dhts:
                d.shutdown()
            for e in executors:
                e.shutdown(wait=False)
        for m in metrics:
            assert m.snapshot()["counters"].get("averaging_rounds_ok", 0) >= 1 and m.avg_group_size == 2

    asyncio.run(main())
