"""Sync mode's fork check (peer/averaging/fork.py): the weight digest every barrier carries, who holds the stage's
weights, and a timed-out barrier whose replicas stepped with different means brought back to identical weights and
optimiser state by the next barrier (in-process peers over the in-memory transport, real workers and state servers).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import peer.sync_schedule as schedule
from peer.averaging.config import NetAveragingConfig
from peer.averaging.fork import digests_agree, fork_of, vet_resync, weights_digest
from peer.averaging.sync import SyncAverager
from peer.ops.metrics import PeerMetrics
from peer.state.sync import StateServer, StateSyncConfig
from tests.test_netavg_rounds import MemTransport, aio
from trainer.config import RunConfig
from trainer.optim import moment_bound
from trainer.worker import StageWorker

RUN = RunConfig.from_toml(Path(__file__).parent / "runs" / "tiny.toml")


def _numels(w: StageWorker) -> list[int]:
    return [p.numel() for p in w.parameters()]


def _step(w: StageWorker, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    w.set_grads([torch.randn(p.shape, generator=g) for p in w.parameters()])
    w.optimizer_step()


def test_digest_tells_a_missed_step_from_rounding():
    a, b = StageWorker(RUN, 0), StageWorker(RUN, 0)
    numels = _numels(a)
    assert torch.equal(weights_digest(a.parameters(), 0), weights_digest(b.parameters(), 0))
    _step(a, 1)
    _step(b, 1)
    same = weights_digest(a.parameters(), 1)
    assert digests_agree(same, weights_digest(b.parameters(), 1), numels, 1e-5)
    # last-bit differences, as another device's optimiser arithmetic makes them, are not a fork
    with torch.no_grad():
        for p in b.parameters():
            p.mul_(1 + 1e-7 * torch.randn(p.shape).sign())
    assert digests_agree(same, weights_digest(b.parameters(), 1), numels, 1e-5)
    _step(b, 2)  # one step the other replica did not make
    assert not digests_agree(same, weights_digest(b.parameters(), 2), numels, 1e-5)


def test_the_stage_weights_are_the_majoritys_and_a_pair_follows_the_lower_id():
    numels = [4, 3]
    base = torch.tensor([7.0, 1.0, 4.0, -2.0, 3.0])
    odd = torch.tensor([7.0, 1.5, 4.0, -2.0, 3.0])
    three = {"a": odd, "b": base, "c": base.clone()}
    fork = fork_of("a", three, numels, 1e-5)
    assert fork is not None and (fork.donor, fork.min_step, fork.agreeing) == ("b", 8, 2)
    assert fork_of("b", three, numels, 1e-5) is None and fork_of("c", three, numels, 1e-5) is None
    pair = {"a": odd, "b": base}
    assert fork_of("a", pair, numels, 1e-5) is None  # nothing tells the two apart: the lower id is kept
    fork = fork_of("b", pair, numels, 1e-5)
    assert fork is not None and fork.donor == "a"


SUBSPACE = RUN.replace(compression={"activations": "subspace", "gradients": "subspace", "subspace_rank": 4})


@pytest.mark.parametrize("run", [RUN, SUBSPACE], ids=["plain", "subspace"])
def test_a_donors_state_is_vetted_against_our_own_before_it_replaces_it(run):
    """Weights, step and moments are vetted, also on a subspace run's stage 0, whose moments of the constrained
    weights are their coordinates' (an honest Adam state there too)."""
    ours, donor = StageWorker(run, 0), StageWorker(run, 0)
    for k in range(3):  # both trained alike, then the donor made one step more: a fork of one step
        _step(ours, k)
        _step(donor, k)
    _step(donor, 99)
    own, good = ours.state_dict(), donor.state_dict()
    assert vet_resync(good, own, min_step=4, tolerance=0.5) is None
    zeros = {**good, "model": {k: torch.zeros_like(v) for k, v in good["model"].items()}}
    assert "from ours" in (vet_resync(zeros, own, min_step=4, tolerance=0.5) or "")
    assert "local step" in (vet_resync(good, own, min_step=20, tolerance=0.5) or "")
    assert "local step" in (vet_resync({**good, "local_step": 2**40}, own, min_step=4, tolerance=0.5) or "")
    crafted = {0: {**good["optimizer"]["state"][0]}}
    crafted[0]["exp_avg_sq"] = torch.zeros_like(crafted[0]["exp_avg_sq"])  # v = 0 under m != 0: an unbounded step
    bad = {**good, "optimizer": {**good["optimizer"], "state": {**good["optimizer"]["state"], **crafted}}}
    assert "moments" in (vet_resync(bad, own, min_step=4, tolerance=0.5) or "")
    crafted[0] = {**good["optimizer"]["state"][0], "step": torch.tensor(-3.0)}  # NaN bias corrections
    bad = {**good, "optimizer": {**good["optimizer"], "state": {**good["optimizer"]["state"], **crafted}}}
    assert "malformed" in (vet_resync(bad, own, min_step=4, tolerance=0.5) or "")


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.99, 0.999)])
def test_honest_moments_stay_inside_the_bound(betas):
    """|m| <= c sqrt(v) holds for an exponential average of any gradients, among them the worst case for it (a
    gradient that grows as fast as the bound allows) and a sign that flips."""
    p = torch.nn.Parameter(torch.zeros(64))
    opt = torch.optim.AdamW([p], lr=1e-3, betas=betas)
    g = torch.Generator().manual_seed(0)
    for t in range(300):
        scale = (betas[0] ** 2 / betas[1]) ** (-t / 2) if t < 40 else 1.0
        p.grad = scale * torch.randn(64, generator=g) * (1 if t % 7 else -5)
        opt.step()
    m, v = opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]
    assert bool((m.abs() <= moment_bound(*betas) * 1.001 * v.sqrt()).all())
    assert abs(moment_bound(0.9, 0.999) - 7.27) < 0.01


class Replicas:
    """Replicas of stage 0 in one process: real workers, sync averagers and state servers over the in-memory
    transport (``net``: its lost replies and resets make a barrier time out)."""

    def __init__(self, names: list[str]) -> None:
        self.net, self.names = MemTransport(), names
        self.workers = {n: StageWorker(RUN, 0, auto_step=False) for n in names}
        self.metrics = {n: PeerMetrics(n, 0) for n in names}
        self.averagers: dict[str, SyncAverager] = {}

    async def start(self) -> Replicas:
        cfg = NetAveragingConfig(sync_timeout_s=2.0, sync_grace_s=0.2, sync_resync_s=10.0)
        for n in self.names:
            w = self.workers[n]

            async def worker_call(fn: Any, w: StageWorker = w) -> Any:
                return fn(w)

            self.averagers[n] = SyncAverager(p2p=None, rpc_server=None, run=RUN, stage=0, metrics=self.metrics[n],
                                             config=cfg, transport=self.net.for_peer(n), me=n)
            await self.averagers[n].start()
            server = StateServer(p2p=None, rpc_server=None, run=RUN, stage=0, worker_call=worker_call,
                                 metrics=self.metrics[n], transport=self.net.for_peer(n),
                                 config=StateSyncConfig(chunk_bytes=16 * 1024, snapshot_max_lag_steps=0))
            await server.start()
            server.ready = True
        return self

    async def barrier(self, barrier: int) -> list[int]:
        """Every replica: a fresh gradient of its own, then the barrier and its step; how many each averaged."""

        async def compute(fn: Any, *args: Any, urgent: bool = False) -> Any:
            return fn(*args)

        async def one(n: str) -> int:
            w = self.workers[n]
            g = torch.Generator().manual_seed(100 * barrier + self.names.index(n))
            w.set_grads([torch.randn(p.shape, generator=g) for p in w.parameters()])
            got = await schedule.barrier_step(self.averagers[n], w, compute, barrier, self.names, run=RUN, stage=0,
                                              metrics=self.metrics[n])
            self.metrics[n].local_step = w.local_step  # as SyncSchedule does: the state server's snapshots follow it
            return got

        return list(await asyncio.gather(*(one(n) for n in self.names)))

    def same_state(self) -> bool:
        """Bit-identical weights, AdamW moments and local steps on every replica."""
        first, *rest = (self.workers[n].state_dict() for n in self.names)
        for other in rest:
            if first["local_step"] != other["local_step"] or not all(
                    torch.equal(x, y) for x, y in zip(first["model"].values(), other["model"].values(), strict=True)):
                return False
            pairs = zip(first["optimizer"]["state"].values(), other["optimizer"]["state"].values(), strict=True)
            if not all(torch.equal(x[k], y[k]) for x, y in pairs for k in ("exp_avg", "exp_avg_sq")):
                return False
        return True

    def count(self, name: str) -> dict[str, int]:
        return {n: m.count(name) for n, m in self.metrics.items()}


@pytest.mark.timeout(60)
@aio
async def test_a_timed_out_barrier_forks_the_replicas_and_the_next_one_resynchronises_them():
    reps = await Replicas(["p0", "p1"]).start()
    assert await reps.barrier(0) == [2, 2]
    assert reps.same_state()
    # barrier 1 times out at p0: every reply of p1 to p0's calls is lost, while p1 holds p0's part and averages both
    reps.net.lost_replies[("p0", "p1")] = 10
    assert await reps.barrier(1) == [1, 2]
    assert not reps.same_state()  # p0 stepped with its own gradient, p1 with the mean: forked
    reps.net.lost_replies.clear()
    # barrier 2: the digests differ; p1 (the higher id of a pair) loads p0's state after p0's step
    assert await reps.barrier(2) == [2, 2]
    assert reps.count("sync_fork_detected") == {"p0": 0, "p1": 1} and reps.count("sync_resync_ok")["p1"] == 1
    assert reps.same_state()
    # and identical means keep them identical
    assert await reps.barrier(3) == [2, 2]
    assert reps.same_state()
    assert reps.count("sync_fork_detected") == {"p0": 0, "p1": 1}


@pytest.mark.timeout(60)
@aio
async def test_a_replica_that_dies_mid_barrier_leaves_three_means_and_the_next_barrier_one():
    """p2's part reaches p0 only, p1's reaches p0 only (the streams between p1 and p2 reset, as when p2 dies mid-
    exchange): p0 averages three parts, p1 and p2 two different pairs. The next barrier finds three digests that agree
    with none other, and both others load p0's state (the lowest id on a tie)."""
    reps = await Replicas(["p0", "p1", "p2"]).start()
    assert await reps.barrier(0) == [3, 3, 3]
    reps.net.resets[("p1", "p2")] = reps.net.resets[("p2", "p1")] = 10
    assert await reps.barrier(1) == [3, 2, 2]
    assert not reps.same_state()
    reps.net.resets.clear()
    assert await reps.barrier(2) == [3, 3, 3]
    assert reps.count("sync_fork_detected") == {"p0": 0, "p1": 1, "p2": 1}
    assert reps.count("sync_resync_ok") == {"p0": 0, "p1": 1, "p2": 1}
    assert reps.same_state()
    assert await reps.barrier(3) == [3, 3, 3]
    assert reps.same_state()


@pytest.mark.timeout(30)
@aio
async def test_a_replica_still_in_its_previous_barrier_does_not_join_the_next_one_empty(monkeypatch):
    """A partner opens barrier 5 while our barrier 4 still runs (a resync loading a replica's state): the forwards of
    flush 5 wait for barrier 4 here, so joining 5 with nothing would leave our share out of its step. We wait until
    barrier 4 is done, then join as before."""
    monkeypatch.setattr(schedule, "EMPTY_FLUSH_WAIT_S", 0.05)
    ran: list[int] = []
    holds: set[int] = set()
    pipe = SimpleNamespace(holds_flush=lambda flush: flush in holds, spawn=asyncio.ensure_future)
    sched = schedule.SyncSchedule(SimpleNamespace(), 1, SimpleNamespace(local_step=0), pipe, None)

    async def average_and_step(barrier: int) -> None:
        ran.append(barrier)

    sched.average_and_step = average_and_step
    await sched.lock.acquire()  # barrier 4 (and its resync) runs
    sched._join_empty(5)
    await asyncio.sleep(0.3)
    assert ran == [] and sched.clock.closed is None
    sched.lock.release()
    holds.add(5)  # barrier 4 done, the forwards of flush 5 go on: our share is here
    await asyncio.sleep(0.3)
    assert ran == [] and sched.clock.closed is None  # its last backward closes flush 5, not an empty join
    holds.clear()
    sched._join_empty(5)  # with no earlier barrier running, a replica that holds nothing joins at once
    await asyncio.sleep(0.1)
    assert ran == [5]
