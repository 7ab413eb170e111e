"""Every state from another peer is witnessed, tensor by tensor, before it is loaded (peer/state/witness.py and
peer/state/digest.py): a lying donor is refused whatever tensor it poisons, a silent or garbage witness means "do not
load", the optimiser moments and pending gradients are dropped and ``local_step`` is capped at the witnesses'."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from test_state_sync import RUN, SMALL_CHUNKS, Direct, _server, _trained_worker

import peer.state.witness as witness_mod
from peer.ops.metrics import PeerMetrics
from peer.state.digest import FLOOR_LR_STEPS, RMS_FLOOR, digest, tensor_distances, witness_floors, witnessed_tensors
from peer.state.sync import StateSyncConfig, load_state_from_peers
from peer.state.witness import draw_witnesses, witness_state, witness_vetter
from protocol.errors import ErrorCode, PeerUnreachable
from protocol.messages import Busy, Error, StateChunk, StateRequest
from trainer.worker import StageWorker

pytestmark = pytest.mark.timeout(120)


def _liar(kind: str, only: str | None = None) -> StageWorker:
    """A replica whose served weights are attacked (all of them, or only the tensor named ``only``)."""
    w = _trained_worker(9, 2)
    with torch.no_grad():
        for name, p in w.model.named_parameters():
            if only is not None and name != only:
                continue
            if kind == "zeros":
                p.zero_()
            elif kind == "scale":
                p.mul_(-10.0)
            else:
                p.add_(3 * p.std() * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    return w


def _load(servers, donors, witnesses, metrics, **kw):
    vet = witness_vetter(run=RUN, stage=0, config=SMALL_CHUNKS, metrics=metrics, announced=witnesses, **kw)
    return load_state_from_peers(p2p=None, run=RUN, stage=0, metrics=metrics, donors=donors, config=SMALL_CHUNKS,
                                 transport=Direct(servers), vet=vet)


def _weights_of(state, worker) -> bool:
    return all(torch.equal(state["model"][k], v) for k, v in worker.model.state_dict().items())


def test_the_sketch_reads_zeros_as_one_a_sign_flip_as_two_per_tensor():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(300, 7, generator=g), torch.randn(5, generator=g)]
    a = digest(tensors, seed=11, dims=64, local_step=0)
    assert tensor_distances(a, a).tolist() == [0.0, 0.0]
    zero = digest([torch.zeros(300, 7), tensors[1]], seed=11, dims=64, local_step=0)
    assert tensor_distances(a, zero)[0] == pytest.approx(1.0, abs=0.01) and tensor_distances(a, zero)[1] == 0
    flip = digest([-t for t in tensors], seed=11, dims=64, local_step=0)
    assert tensor_distances(a, flip).tolist() == pytest.approx([2.0, 2.0], abs=0.01)
    near = digest([t + 0.05 * torch.randn(t.shape, generator=g) for t in tensors], seed=11, dims=64, local_step=0)
    assert (tensor_distances(a, near) < 0.12).all()  # about 0.05, within the sketch's error


def test_a_bias_is_measured_against_how_far_training_moves_it_and_a_weight_is_not():
    """Honest replicas' biases (zero at the init) differ early by more than their own small norm: they are measured
    relative to FLOOR_LR_STEPS x the run's learning rate at least; weights keep the fixed floor."""
    lr = 1e-3
    floors = witness_floors(["wte.weight", "blocks.0.attn.c_attn.bias", "ln_f.bias", "blocks.0.ln_1.weight"], lr)
    assert floors.tolist() == pytest.approx([RMS_FLOOR, FLOOR_LR_STEPS * lr, FLOOR_LR_STEPS * lr, RMS_FLOOR])
    g = torch.Generator().manual_seed(0)
    weight, bias = 0.05 * torch.randn(64, 32, generator=g), 0.004 * torch.randn(96, generator=g)
    honest = [weight + 0.005 * torch.randn(64, 32, generator=g), bias + 0.006 * torch.randn(96, generator=g)]
    a, b = (digest(ts, seed=3, dims=64, local_step=0) for ts in ([weight, bias], honest))
    fixed, ours = tensor_distances(a, b), tensor_distances(a, b, witness_floors(["w.weight", "w.bias"], lr))
    assert fixed[1] > 0.5 > ours[1]  # the bias: refused under the fixed floor, within tolerance under its own
    assert ours[0] == pytest.approx(fixed[0]) and ours[0] < 0.2  # the weight: unchanged
    shifted = digest([weight, bias + 0.05 * torch.randn(96, generator=g)], seed=3, dims=64, local_step=0)
    assert tensor_distances(a, shifted, witness_floors(["w.weight", "w.bias"], lr))[1] > 0.5  # 2.5x the floor: far


@pytest.mark.parametrize("kind", ["zeros", "scale", "noise"])
def test_a_lying_donor_is_refused_and_the_next_donor_is_loaded(kind: str):
    async def main():
        servers = {"liar": _server(_liar(kind)), **{f"h{i}": _server(_trained_worker(i, 2)) for i in (1, 2, 3)}}
        metrics = PeerMetrics("joiner", 0)
        state = await _load(servers, ["liar", "h1"], ["h1", "h2", "h3"], metrics)
        assert state is not None and _weights_of(state, servers["h1"].worker)
        counters = metrics.snapshot()["counters"]
        assert counters["state_sync_outvoted"] == 1 and counters["state_sync_ok"] == 1

    asyncio.run(main())


def test_one_poisoned_tensor_anywhere_in_the_state_is_refused():
    """The last tensor of the stage (far from chunk 0) zeroed, everything else honest."""
    async def main():
        last = [k for k, v in _trained_worker(9, 2).model.named_parameters() if v.dim() >= 2][-1]
        servers = {"liar": _server(_liar("zeros", only=last)), "h1": _server(_trained_worker(1, 2)),
                   "h2": _server(_trained_worker(2, 2))}
        metrics = PeerMetrics("joiner", 0)
        assert await _load(servers, ["liar"], list(servers), metrics) is None
        assert metrics.snapshot()["counters"]["state_sync_outvoted"] == 1

    asyncio.run(main())


def test_moments_and_pending_gradients_are_dropped_and_the_step_is_capped_at_the_witnesses():
    async def main():
        liar = _trained_worker(9, 2)
        liar.local_step = 2**62
        for slot in liar.optimizer.state.values():
            for v in slot.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    v.mul_(1e6)
        servers = {"liar": _server(liar), "h1": _server(_trained_worker(1, 3)), "h2": _server(_trained_worker(2, 5))}
        metrics = PeerMetrics("joiner", 0)
        state = await _load(servers, ["liar"], list(servers), metrics)
        assert state is not None and _weights_of(state, liar)  # its weights are honest: loaded
        assert state["optimizer"]["state"] == {} and state["grads"] is None and state["accumulated"] == 0
        assert state["averaging"] is None  # the loader keeps its own fresh EMA
        assert state["local_step"] == 5 and metrics.snapshot()["counters"]["state_step_capped"] == 1
        fresh = StageWorker(RUN, 0)
        fresh.load_state_dict(state)  # the worker takes it
        assert fresh.local_step == 5

    asyncio.run(main())


def test_a_silent_or_garbage_witness_is_outvoted_by_the_donor_and_an_agreeing_one_and_vetoes_alone():
    async def main():
        class Silent:
            ready = True

            async def _handle(self, msg, peer):
                return Error(code=ErrorCode.NOT_READY, message="never")

        for bad in (Silent(), _server(_liar("zeros"))):
            servers = {"h1": _server(_trained_worker(1, 2)), "h2": _server(_trained_worker(2, 2)), "bad": bad}
            metrics = PeerMetrics("joiner", 0)
            state = await _load(servers, ["h1"], ["h1", "h2", "bad"], metrics)  # 2 of 3 vouch
            assert state is not None and _weights_of(state, servers["h1"].worker)
            assert metrics.snapshot()["counters"]["state_witness_dissent"] == 1
            metrics = PeerMetrics("joiner", 0)
            assert await _load(servers, ["h1"], ["h1", "bad"], metrics) is None  # a stage of two: a tie
            text = metrics.snapshot()["warnings"][-1]["text"]
            assert "bad" in text and "not loaded" in text and "1 of 2" in text

    asyncio.run(main())


def test_a_witness_unreachable_once_is_asked_again_and_one_that_stays_unreachable_still_vetoes(monkeypatch):
    """A dial can fail while a peer is still starting: the witness is asked once more before it counts against."""
    monkeypatch.setattr(witness_mod, "UNREACHABLE_PAUSE_S", 0.05)

    class Flaky:
        ready = True

        def __init__(self, inner, failures: int) -> None:
            self.inner, self.failures, self.calls = inner, failures, 0

        async def _handle(self, msg, peer):
            self.calls += 1
            if self.calls <= self.failures:
                raise PeerUnreachable("failed to dial")
            return await self.inner._handle(msg, peer)

    async def main():
        for failures, loaded in ((1, True), (5, False)):
            witness = Flaky(_server(_trained_worker(2, 2)), failures)
            servers = {"h1": _server(_trained_worker(1, 2)), "h2": witness}
            metrics = PeerMetrics("joiner", 0)
            state = await _load(servers, ["h1"], ["h1", "h2"], metrics)  # a stage of two: the witness decides
            assert (state is not None) is loaded, failures
            assert witness.calls == 2  # asked twice, never more

    asyncio.run(main())


def test_k_liars_keep_a_joiner_from_loading_only_when_as_many_as_the_honest_and_win_only_when_more():
    async def main():
        honest = {f"h{i}": _server(_trained_worker(i, 2)) for i in (1, 2)}
        liars = {f"s{i}": _server(_liar("noise")) for i in (1, 2, 3)}  # identical lies: they vouch for each other
        for k, donor, loaded in ((1, "h1", "h1"), (1, "s1", "h2"), (2, "h1", None), (2, "s1", None), (3, "s1", "s1")):
            servers = {**honest, **{f"s{i}": liars[f"s{i}"] for i in range(1, k + 1)}}
            metrics = PeerMetrics("joiner", 0)
            state = await _load(servers, [donor, "h2"] if donor.startswith("s") else [donor], list(servers), metrics)
            if loaded is None:
                assert state is None, (k, donor)
            else:
                assert state is not None and _weights_of(state, servers[loaded].worker), (k, donor)

    asyncio.run(main())


def test_trusted_replicas_are_the_witnesses_when_any_serves_the_stage():
    rng = random.Random(0)
    announced = ["d", *[f"sybil{i}" for i in range(20)], "h1", "h2"]
    for _ in range(20):
        assert sorted(draw_witnesses(trusted=["h1", "h2", "elsewhere"], announced=announced, donor="d", n=3,
                                     rng=rng)) == ["h1", "h2"]
    drawn = draw_witnesses(trusted=[], announced=announced, donor="d", n=3, rng=rng)
    assert len(drawn) == 3 and "d" not in drawn


def test_an_honest_swarm_agrees_and_a_lone_replica_loads_unwitnessed_only_when_allowed():
    async def main():
        honest = {f"h{i}": _server(_trained_worker(i, 2)) for i in (1, 2, 3)}
        state = honest["h1"].worker.state_dict()
        verdict = await witness_state(transport=Direct(honest), state=state, witnesses=["h2", "h3"], run=RUN,
                                      stage=0, config=SMALL_CHUNKS)
        assert verdict.loadable and set(verdict.distances) == {"h2", "h3"}
        assert max(verdict.distances.values()) < SMALL_CHUNKS.tensor_tolerance
        for allow in (True, False):
            metrics = PeerMetrics("joiner", 0)
            loaded = await _load(honest, ["h1"], [], metrics, allow_alone=allow)
            assert (loaded is not None) is allow
            assert metrics.snapshot()["counters"].get("state_sync_unwitnessed", 0) == int(allow)

    asyncio.run(main())


def test_witnessed_tensors_are_the_weights():
    state = _trained_worker(1, 2).state_dict()
    assert witnessed_tensors(state) == list(state["model"].values())


def test_one_peer_gets_a_few_snapshots_and_a_bounded_chunk_rate_then_busy():
    """state_flood: one peer asking for chunk 0 (a new transfer, perhaps a new snapshot) over and over."""
    async def main():
        now = [0.0]
        config = StateSyncConfig(chunk_bytes=128 * 1024)
        server = _server(_trained_worker(1, 2), clock=lambda: now[0], config=config)
        replies = [await server._handle(StateRequest(run_id=RUN.run_id, stage=0, chunk=0), "flooder")
                   for _ in range(20)]
        assert sum(isinstance(r, StateChunk) for r in replies) == config.peer_start_burst
        assert all(isinstance(r, Busy) for r in replies[config.peer_start_burst:])
        other = await server._handle(StateRequest(run_id=RUN.run_id, stage=0, chunk=0), "joiner")
        assert isinstance(other, StateChunk)  # another peer is served
        now[0] += 1 / config.peer_starts_per_s
        assert isinstance(await server._handle(StateRequest(run_id=RUN.run_id, stage=0, chunk=0), "flooder"),
                          StateChunk)
        assert server.metrics.snapshot()["counters"]["rejected:state_rate_limited"] == 20 - 6

    asyncio.run(main())


def test_a_client_that_trusts_nobody_keeps_the_replicas_a_majority_vouches_for():
    """generate through a live swarm: a liar among three honest replicas of a stage is not used."""
    from peer.state.witness import agreeing_replicas

    async def main():
        servers = {"liar": _server(_liar("zeros")), **{f"h{i}": _server(_trained_worker(i, 2)) for i in (1, 2, 3)}}
        kept = await agreeing_replicas(transport=Direct(servers), run=RUN, stage=0, peers=list(servers),
                                       config=SMALL_CHUNKS)
        assert sorted(kept) == ["h1", "h2", "h3"]

    asyncio.run(main())


def test_a_subspace_runs_tables_are_witnessed_on_their_trained_part_not_on_the_fixed_tables():
    """A subspace run's embedding tables are F (fixed, every replica's) plus a trained part: a state that replaces
    the whole trained part (zeroed or negated) is refused, though F keeps it near the honest table as a whole."""
    from pathlib import Path

    from trainer.config import RunConfig
    from trainer.subspace import fixed_tables

    tiny = RunConfig.from_toml(Path(__file__).parent / "runs" / "tiny.toml")
    run = tiny.replace(compression={"activations": "subspace", "gradients": "subspace", "subspace_rank": 4})
    tables = fixed_tables(run, 0)
    assert set(tables) == {"wte.weight", "wpe.weight"} and fixed_tables(run, 1) == {} and fixed_tables(tiny, 0) == {}

    def replica(seed: int) -> StageWorker:
        torch.manual_seed(0)
        w = StageWorker(run, 0)
        g = torch.Generator().manual_seed(seed)
        for _ in range(2):
            w.set_grads([torch.randn(p.shape, generator=g) for p in w.parameters()])
            w.optimizer_step()
        return w

    async def main():
        servers = {f"h{i}": _server(replica(i)) for i in (1, 2)}
        honest = servers["h1"].worker.state_dict()
        figures = {}
        for kind in ("honest", "zeros", "negated"):
            state = {**honest, "model": dict(honest["model"])}
            f = tables["wte.weight"]
            if kind == "zeros":
                state["model"]["wte.weight"] = f.clone()
            elif kind == "negated":
                state["model"]["wte.weight"] = 2 * f - honest["model"]["wte.weight"]
            verdict = await witness_state(transport=Direct(servers), state=state, witnesses=["h2"], run=run,
                                          stage=0, config=SMALL_CHUNKS)
            assert "h2" in verdict.distances, verdict.reason
            figures[kind] = (verdict.loadable, verdict.distances["h2"])
        assert figures["honest"][0] and figures["honest"][1] < SMALL_CHUNKS.tensor_tolerance, figures
        assert not figures["zeros"][0] and figures["zeros"][1] > 0.9, figures  # ~1: the trained part's own norm
        assert not figures["negated"][0] and figures["negated"][1] > 1.8, figures  # ~2: a sign flip
        # against the whole table, as before, the same lies read near: F is most of its norm
        seed = 7
        names = list(honest["model"])
        i = names.index("wte.weight")
        ours = digest(witnessed_tensors(honest), seed=seed, dims=64, local_step=0)
        zeroed = digest([tables["wte.weight"] if n == "wte.weight" else t for n, t in honest["model"].items()],
                        seed=seed, dims=64, local_step=0)
        assert float(tensor_distances(ours, zeroed)[i]) < SMALL_CHUNKS.tensor_tolerance
        fixed = witness_mod.fixed_sketches(run, 0, names, seed=seed)
        assert float(tensor_distances(ours, zeroed, fixed=fixed)[i]) > 0.9

    asyncio.run(main())
