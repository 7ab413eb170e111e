"""A donor's state is witnessed by other replicas of the stage before a joiner loads it (peer/state/witness.py):
a lying donor that announces the most progress is outvoted, an honest donor is loaded whatever one liar says."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
import torch
from test_state_sync import RUN, SMALL_CHUNKS, Direct, _same, _server, _trained_worker

from peer.ops.metrics import PeerMetrics
from peer.state.sync import load_state_from_peers
from peer.state.witness import relative_distance, witness_state, witness_vetter
from trainer.worker import StageWorker

pytestmark = pytest.mark.timeout(120)


def _liar(kind: str) -> StageWorker:
    """A replica whose served weights are attacked (its optimiser state and counters look honest)."""
    w = _trained_worker(9, 2)
    with torch.no_grad():
        for p in w.model.parameters():
            if kind == "zeros":
                p.zero_()
            elif kind == "scale":
                p.mul_(-10.0)
            else:
                p.add_(3 * p.std() * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    return w


def test_relative_distance_reads_zeros_as_one_and_a_sign_flip_as_two():
    x = torch.randn(100)
    assert relative_distance(x, x) == 0.0
    assert relative_distance(x, torch.zeros(100)) == pytest.approx(1.0)
    assert relative_distance(x, -x) == pytest.approx(2.0)


@pytest.mark.parametrize("kind", ["zeros", "scale", "noise"])
def test_a_lying_donor_is_outvoted_and_the_next_donor_is_loaded(kind: str):
    async def main():
        servers = {"liar": _server(_liar(kind)), **{f"h{i}": _server(_trained_worker(i, 2)) for i in (1, 2, 3)}}
        metrics = PeerMetrics("joiner", 0)
        vet = witness_vetter(run=RUN, stage=0, config=SMALL_CHUNKS, metrics=metrics, witnesses=list(servers))
        state = await load_state_from_peers(p2p=None, run=RUN, stage=0, metrics=metrics, donors=["liar", "h1"],
                                            config=SMALL_CHUNKS, transport=Direct(servers), vet=vet)
        assert state is not None and _same(state, servers["h1"].worker.state_dict())
        counters = metrics.snapshot()["counters"]
        assert counters["state_sync_outvoted"] == 1 and counters["state_sync_ok"] == 1
        assert any("outvoted" in w["text"] for w in metrics.snapshot()["warnings"])

    asyncio.run(main())


def test_an_honest_donor_is_loaded_whatever_one_lying_witness_says():
    async def main():
        servers = {"liar": _server(_liar("zeros")), "h1": _server(_trained_worker(1, 2)),
                   "h2": _server(_trained_worker(2, 2))}
        for witnesses in (["liar", "h2"], ["liar"]):
            metrics = PeerMetrics("joiner", 0)
            vet = witness_vetter(run=RUN, stage=0, config=SMALL_CHUNKS, metrics=metrics, witnesses=witnesses)
            state = await load_state_from_peers(p2p=None, run=RUN, stage=0, metrics=metrics, donors=["h1"],
                                                config=SMALL_CHUNKS, transport=Direct(servers), vet=vet)
            assert state is not None and _same(state, servers["h1"].worker.state_dict())
            counters = metrics.snapshot()["counters"]
            assert counters.get("state_sync_outvoted", 0) == 0 and counters["state_sync_disputed"] == 1

    asyncio.run(main())


def test_the_verdict_reads_weights_only_and_skips_a_witness_that_cannot_answer():
    async def main():
        honest = {f"h{i}": _server(_trained_worker(i, 2)) for i in (1, 2, 3)}
        state = honest["h1"].worker.state_dict()
        config = dataclasses.replace(SMALL_CHUNKS, witnesses=3, probe_chunks=2)
        verdict = await witness_state(transport=Direct(honest), state=state, donor="h1",
                                      witnesses=["h1", "h2", "h3", "gone"], run=RUN, stage=0, config=config,
                                      limit=2**30, rng=random.Random(0))
        assert not verdict.outvoted and not verdict.disputed
        assert set(verdict.distances) == {"h2", "h3"} and max(verdict.distances.values()) < 0.05
        # the optimiser state of a replica may differ wildly: only the model's weights are compared
        odd = honest["h1"].worker.state_dict()
        for slot in odd["optimizer"]["state"].values():
            for k, v in slot.items():
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() > 1:
                    slot[k] = v * 1e3
        verdict = await witness_state(transport=Direct(honest), state=odd, donor="h1", witnesses=["h2", "h3"],
                                      run=RUN, stage=0, config=config, limit=2**30)
        assert not verdict.outvoted

    asyncio.run(main())


def test_two_witnesses_cannot_outvote_when_they_disagree_with_each_other():
    async def main():
        servers = {"h1": _server(_trained_worker(1, 2)), "a": _server(_liar("zeros")), "b": _server(_liar("scale"))}
        verdict = await witness_state(transport=Direct(servers), state=servers["h1"].worker.state_dict(),
                                      donor="h1", witnesses=["a", "b"], run=RUN, stage=0, config=SMALL_CHUNKS,
                                      limit=2**30)
        assert not verdict.outvoted and sorted(verdict.disputed) == ["a", "b"]

    asyncio.run(main())
