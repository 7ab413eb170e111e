"""Averaging rounds between real hivemind P2P peers on 127.0.0.1 through protocol.rpc, with real StageWorkers.

Covers: two honest replicas average their partition (equal to the mean within int8 error, bit-identical on both);
a malicious peer's NaN / wrong-shape / huge parts are refused and counted while the honest weights stay finite and
exact; a peer that dies right after beginning a round costs the others only its contribution.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hivemind.p2p import P2P

from peer.averaging import AVG_RPC, AveragingLoop, NetAveragingConfig, next_round
from peer.metrics import PeerMetrics
from protocol.codecs import encode
from protocol.errors import RemoteError
from protocol.messages import AveragingPart
from protocol.rpc import RpcServer, call
from trainer.config import RunConfig
from trainer.worker import StageWorker

pytestmark = pytest.mark.timeout(90)

RUN = RunConfig.default()
CFG = NetAveragingConfig(period_s=1.5, collect_fraction=0.6, call_timeout_s=1.0, clock_skew_s=0.3)


class Recording:
    """A StageWorker whose averaging hooks record what they returned and received."""

    def __init__(self, worker: StageWorker, on_begin=None) -> None:
        self.w, self.on_begin = worker, on_begin
        self.begun: dict[int, list[torch.Tensor]] = {}
        self.means: dict[int, list[torch.Tensor]] = {}
        self.aborted: list[int] = []

    @property
    def local_step(self) -> int:
        return self.w.local_step

    def averaging_begin(self, r: int) -> list[torch.Tensor]:
        values = self.w.averaging_begin(r)
        self.begun[r] = [v.clone() for v in values]
        if self.on_begin is not None:
            self.on_begin(r)
        return values

    def averaging_finish(self, r: int, mean: list[torch.Tensor], **kwargs) -> None:
        self.means[r] = [m.clone() for m in mean]
        self.w.averaging_finish(r, mean, **kwargs)

    def averaging_abort(self, r: int) -> None:
        self.aborted.append(r)
        self.w.averaging_abort(r)


class Peer:
    def __init__(self, p2p: P2P, worker: Recording | None) -> None:
        self.p2p, self.worker = p2p, worker
        self.id = p2p.peer_id.to_base58()
        self.metrics = PeerMetrics(self.id, 0)
        self.rpc = RpcServer(p2p)
        self.executor = ThreadPoolExecutor(1)  # the compute thread
        self.loop: AveragingLoop | None = None

    async def worker_call(self, fn):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, self.worker)

    def averaging(self, view: list[str]) -> AveragingLoop:
        async def fetch_peers():
            return [p for p in view if p != self.id]

        self.loop = AveragingLoop(p2p=self.p2p, rpc_server=self.rpc, dht=None, run=RUN, stage=0,
                                  worker_call=self.worker_call, metrics=self.metrics, config=CFG,
                                  fetch_peers=fetch_peers)
        return self.loop


def _worker(perturb_seed: int | None) -> StageWorker:
    torch.manual_seed(0)
    w = StageWorker(RUN, 0)
    if perturb_seed is not None:  # another replica: same init, then some drift
        g = torch.Generator().manual_seed(perturb_seed)
        with torch.no_grad():
            for p in w.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=g))
    return w


async def _peers(n: int, workers: list[Recording | None]) -> list[Peer]:
    first = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    maddrs = await first.get_visible_maddrs()
    rest = await asyncio.gather(*(P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
                                  for _ in range(n - 1)))
    return [Peer(p, w) for p, w in zip([first, *rest], workers, strict=True)]


async def _shutdown(peers: list[Peer]) -> None:
    for p in peers:
        if p.loop is not None:
            await p.loop.stop()
    await asyncio.gather(*(p.p2p.shutdown() for p in peers), return_exceptions=True)
    for p in peers:
        p.executor.shutdown(wait=False)


def _int8_step(*tensors: torch.Tensor) -> float:
    return max(float(t.abs().max()) for t in tensors) / 127


def test_honest_pair_averages_and_a_malicious_peer_is_refused():
    async def main():
        honest = [Recording(_worker(None)), Recording(_worker(1))]
        peers = await _peers(3, [*honest, None])
        a, b, evil = peers
        try:
            view = [a.id, b.id, evil.id]  # the attacker announced itself: the honest keep rounds open for it
            for p in (a, b):
                await p.averaging(view).start()
            r = next_round(time.time(), CFG.period_s) + 1
            await asyncio.sleep(r * CFG.period_s - time.time() + 0.1)
            shapes = [v.shape for v in honest[0].begun[r]] if r in honest[0].begun else None
            assert shapes is not None, "round did not begin on the honest peer"
            zeros = [torch.zeros(s) for s in shapes]
            poisons = {
                "nonfinite": ("none", [torch.full(shapes[0], float("nan")), *zeros[1:]]),
                "shape": ("int8", [torch.zeros(shapes[0][0] + 3), *zeros[1:]]),
                "too_far": ("int8", [torch.full(shapes[0], 1e4), *zeros[1:]]),
            }
            for kind, (codec, tensors) in poisons.items():
                part = AveragingPart(run_id=RUN.run_id, stage=0, round_no=r, sender=evil.id,
                                     tensors=[encode(t, codec) for t in tensors], weight=1e6)
                for target in (a, b):
                    with pytest.raises(RemoteError, match=kind):
                        await call(evil.p2p, target.p2p.peer_id, AVG_RPC, part, timeout=5.0)
            await asyncio.sleep(CFG.period_s * 1.5)
        finally:
            await _shutdown(peers)
        assert r in honest[0].means and r in honest[1].means, "the attacked round must complete among the honest"
        for kind in poisons:
            for p in (a, b):
                assert p.metrics.snapshot()["counters"].get(f"rejected:avg_{kind}") == 1
        for j, (va, vb) in enumerate(zip(honest[0].begun[r], honest[1].begun[r], strict=True)):
            ma, mb = honest[0].means[r][j], honest[1].means[r][j]
            assert torch.equal(ma, mb)
            assert float((ma - (va + vb) / 2).abs().max()) <= _int8_step(va, vb) + 1e-7
        for rec in honest:
            assert all(bool(torch.isfinite(p).all()) for p in rec.w.parameters())
        assert a.metrics.avg_group_size == 2 and a.metrics.avg_tau == 0

    asyncio.run(main())


def test_a_peer_dying_after_begin_costs_only_its_contribution():
    async def main():
        recs = [Recording(_worker(None)), Recording(_worker(1)), Recording(_worker(2))]
        peers = await _peers(3, recs)
        victim = peers[2]
        dying_round: list[int] = []

        def die(r: int) -> None:  # runs on the victim's compute thread right after its begin of the doomed round
            if dying_round and r == dying_round[0]:
                asyncio.run_coroutine_threadsafe(victim.p2p.shutdown(), main_loop)

        recs[2].on_begin = die
        main_loop = asyncio.get_running_loop()
        try:
            view = [p.id for p in peers]
            for p in peers:
                await p.averaging(view).start()
            dying_round.append(next_round(time.time(), CFG.period_s) + 1)
            await asyncio.sleep((dying_round[0] + 1) * CFG.period_s - time.time())
        finally:
            await _shutdown(peers)
        r = dying_round[0]
        assert r in recs[0].means and r in recs[1].means
        for j in range(len(recs[0].means[r])):
            ma, mb = recs[0].means[r][j], recs[1].means[r][j]
            va, vb = recs[0].begun[r][j], recs[1].begun[r][j]
            assert torch.equal(ma, mb), "survivors must apply the same mean"
            assert float((ma - (va + vb) / 2).abs().max()) <= _int8_step(va, vb) + 1e-7
        assert r not in recs[2].means

    asyncio.run(main())
