"""The simulator's event schedule: exact per-stage delays, averaging hooks, replica combination, same samples."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest
import torch

from trainer.data import load_corpus, val_batches
from trainer.sim.methods import METHODS
from trainer.sim.presets import preset, with_overrides
from trainer.sim.simulator import SimConfig, _Run, run_method, speeds_from_steps
from trainer.worker import StageWorker


def tiny(stages: int = 2, steps: int = 16, **kw) -> SimConfig:
    sim = with_overrides(preset("smoke"), stages=stages, steps=steps, eval_every=8, **kw)
    return dataclasses.replace(sim, eval_batches=1)


def build(sim: SimConfig, method: str, tau: int | None = None) -> _Run:
    corpus = load_corpus(sim.run.data, sim.run.model.vocab_size)
    val = val_batches(corpus, sim.run.model.block_size, sim.run.data.batch_size, 1)
    return _Run(sim, METHODS[method], sim.tau if tau is None else tau, corpus, val)


def backward_delays(monkeypatch) -> dict[int, list[int]]:
    """stage -> the staleness (local steps since its forward) of every backward any worker of that stage runs."""
    seen: dict[int, list[int]] = defaultdict(list)
    original = StageWorker.backward

    def spy(self, mb_id, grad):
        seen[self.stage].append(self.local_step - self._pending[mb_id].version)
        return original(self, mb_id, grad)

    monkeypatch.setattr(StageWorker, "backward", spy)
    return seen


@pytest.mark.timeout(60)
def test_async_delay_of_stage_s_is_k_minus_1_minus_s(monkeypatch):
    seen = backward_delays(monkeypatch)
    k, n = 4, 24
    state = build(tiny(stages=k, steps=n), "asyncpp")
    state.run_async()
    for s in range(k - 1):
        delays = seen[s]
        assert len(delays) == n * state.R
        tau_s = k - 1 - s
        assert max(delays) == tau_s
        # after the fill (the first tau_s micro-batches) every backward is exactly tau_s steps stale
        per_replica = delays[::state.R]
        assert per_replica[tau_s:] == [tau_s] * (n - tau_s)
    assert all(w.local_step == n for row in state.w for w in row)  # one step per micro-batch, every stage
    assert all(w.pending() == 0 for row in state.w for w in row)  # drained


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra", [1, 2])
def test_pipeline_extra_delays_every_stage_by_that_many_steps(monkeypatch, extra):
    """A daemon's stage 0 with W micro-batches in flight on K stages sees W - 1 steps of staleness: pipeline_extra
    adds W - K to 1F1B's K - 1 - s at every stage but the last, and every micro-batch is still trained once."""
    seen = backward_delays(monkeypatch)
    k, n = 3, 16
    state = build(dataclasses.replace(tiny(stages=k, steps=n), pipeline_extra=extra), "asyncpp")
    state.run_async()
    for s in range(k - 1):
        per_replica = seen[s][:: state.R]
        tau_s = k - 1 - s + extra
        assert len(per_replica) == n and per_replica[tau_s:] == [tau_s] * (n - tau_s)
    assert all(w.local_step == n for row in state.w for w in row)
    assert all(w.pending() == 0 for row in state.w for w in row)


def test_each_replica_evaluation_is_the_mean_of_the_replicas_own_losses():
    sim = dataclasses.replace(tiny(steps=8), eval_replicas="each")
    state = build(sim, "asyncmesh")
    state.run_async()
    own = [state._val_loss(r) for r in range(state.R)]
    assert state.evaluate() == pytest.approx(sum(own) / len(own))
    averaged = build(dataclasses.replace(sim, eval_replicas="averaged"), "asyncmesh")
    averaged.w = state.w
    assert averaged.evaluate() != pytest.approx(state.evaluate())  # replicas differ, so the two evaluations do


@pytest.mark.timeout(60)
def test_sparse_averaging_rounds_are_applied_tau_steps_late():
    n, tau = 16, 3
    state = build(tiny(steps=n, tau=tau), "asyncmesh")
    finished: list[tuple[int, int, int]] = []  # (stage, round, local_step at finish)
    for row in state.w:
        for w in row:
            original = w.averaging_finish

            def spy(rn, mean, w=w, original=original):
                finished.append((w.stage, rn, w.local_step))
                return original(rn, mean)

            w.averaging_finish = spy
    state.run_async()
    assert state.rounds_applied == state.K * (n - tau)
    for _stage, rn, step in finished:
        assert step == rn + 1 + tau  # round rn began after local step rn + 1, applied tau steps later


def test_rounds_batch_round_steps_and_draw_measured_delays():
    """The daemon's cadence: a round every round_steps local steps averaging p * round_steps, applied after a delay
    drawn from measured ones; the fraction averaged per step is p whatever the batching."""
    n = 24
    sim = tiny(steps=n)
    sim = dataclasses.replace(sim, run=sim.run.replace(averaging={"round_steps": 4}), fraction=0.05,
                              tau_samples=(0, 2, 5))
    state = build(sim, "asyncmesh")
    assert state.run.averaging.round_fraction == pytest.approx(0.2)
    begun: list[tuple[int, int]] = []  # (round, local step at begin) of stage 0, replica 0
    finished: dict[int, int] = {}
    w = state.w[0][0]
    begin, finish = w.averaging_begin, w.averaging_finish

    def spy_begin(rn, w=w, begin=begin):
        begun.append((rn, w.local_step))
        return begin(rn)

    def spy_finish(rn, mean, w=w, finish=finish):
        finished[rn] = w.local_step
        return finish(rn, mean)

    w.averaging_begin, w.averaging_finish = spy_begin, spy_finish
    state.run_async()
    assert [step for _, step in begun] == list(range(4, n + 1, 4))
    delays = [finished[rn] - step for rn, step in begun if rn in finished]
    assert set(delays) <= {0, 2, 5} and len(set(delays)) >= 2
    assert state.delays[: len(delays)] == delays
    rec = run_method(sim, "asyncmesh", "asyncmesh", sim.tau)
    # 6 rounds of 20 % begin in 24 steps (p = 5 % per step); those whose delay runs past the end are not applied
    assert 0.2 * 4 / n <= rec["avg_fraction_per_step"] <= 0.05 + 1e-9
    assert rec["avg_delay_steps"] is not None


@pytest.mark.timeout(60)
def test_full_averaging_and_gradient_averaging_keep_replicas_identical():
    for method in ("full-avg", "asyncpp", "fullsync"):
        state = build(tiny(steps=8), method)
        state.run_sync() if method == "fullsync" else state.run_async()
        for s in range(state.K):
            a, b = state.w[0][s].parameters(), state.w[1][s].parameters()
            assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a, b, strict=True)), (method, s)
    state = build(tiny(steps=8), "asyncmesh")  # sparse averaging: replicas differ (different data)
    state.run_async()
    a, b = state.w[0][0].parameters(), state.w[1][0].parameters()
    assert not all(torch.allclose(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.timeout(60)
def test_two_methods_see_identical_token_batches():
    sim = tiny(steps=8)
    sync = run_method(sim, "fullsync", "fullsync", sim.tau)
    mesh = run_method(sim, "asyncmesh", "asyncmesh", sim.tau)
    assert sync["data_digests"] == mesh["data_digests"]
    assert len(set(sync["data_digests"])) == 2  # ...and the two replicas read different shards
    assert sync["samples"] == mesh["samples"] == 8 * 2 * sim.run.data.batch_size


def test_tau_variants_name_each_run():
    sim = with_overrides(preset("stress"), taus=(10, 50), methods=("fullsync", "asyncmesh", "full-avg"))
    assert sim.variants() == [("fullsync", "fullsync", 10), ("asyncmesh@tau10", "asyncmesh", 10),
                              ("asyncmesh@tau50", "asyncmesh", 50), ("full-avg", "full-avg", 0)]


def test_steps_must_divide_evenly_for_equal_samples():
    with pytest.raises(ValueError, match="same samples"):
        with_overrides(preset("smoke"), steps=10)  # micro_batches is 4


@pytest.mark.timeout(60)
def test_codec_error_of_every_hop_is_recorded_in_the_curve():
    sim = tiny(steps=16)
    sim = dataclasses.replace(sim, run=sim.run.replace(
        compression={"activations": "int8", "gradients": "none", "averaging": "none"}))
    rec = run_method(sim, "asyncpp", "asyncpp", sim.tau)
    for point in rec["curve"]:
        assert 0.0 < point["act_codec_rel_err"] < 0.01  # int8: ~0.65 % relative error per hop
        assert "grad_codec_rel_err" not in point  # gradients travelled uncompressed


def test_base_preset_is_the_asyncpp_base_scale():
    sim = preset("base")
    m = sim.run.model
    assert (m.n_layer, m.n_embd, m.n_head, m.block_size, sim.run.n_stages) == (8, 768, 12, 512, 8)
    assert sim.run.data.batch_size == 8 and sim.n_replicas == 1 and sim.run.optim.lr == 3e-4
    assert set(sim.methods) == {"fullsync", "asyncpp", "naive-async"}
    assert with_overrides(sim, device="cuda").device == "cuda"


def test_device_must_be_cpu_or_cuda():
    with pytest.raises(ValueError, match="device must be"):
        dataclasses.replace(preset("smoke"), device="tpu")
    legacy = preset("smoke").to_dict()
    del legacy["device"]  # results.json written before the field existed
    assert SimConfig.from_dict(legacy).device == "cpu"


def test_simulate_cli_takes_the_cadence_and_a_daemons_measured_delays(tmp_path):
    import argparse
    import json

    from peer.cli import simulate as cmd_simulate
    from peer.errors import UserError

    summary = tmp_path / "s.json"
    summary.write_text(json.dumps({"avg_delay_hist": {"1": 2, "3": 1}}))
    parser = argparse.ArgumentParser()
    cmd_simulate.add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path), "--round-steps", "5", "--delays-from", str(summary)])
    sim = cmd_simulate.build_config(args)
    assert sim.run.averaging.round_steps == 5 and sorted(sim.tau_samples) == [1, 1, 3]
    (tmp_path / "empty.json").write_text("{}")
    with pytest.raises(UserError, match="no averaging round"):
        cmd_simulate.build_config(parser.parse_args(["--out", str(tmp_path), "--delays-from",
                                                     str(tmp_path / "empty.json")]))


@pytest.mark.timeout(120)
def test_replicas_at_different_speeds_train_their_share_and_rounds_follow_the_fastest():
    n = 16
    sim = dataclasses.replace(tiny(steps=n, tau=0), speeds=(1.0, 0.5))
    state = build(sim, "asyncmesh")
    state.run_async()
    assert state.trained == [16, 8]
    assert [state.w[r][0].local_step for r in range(2)] == [16, 8]  # every micro-batch of each was trained on
    assert state.rounds_applied == state.K * 16  # a round per step of the fastest replica
    assert state.curve[-1]["samples"] == 24 * sim.run.data.batch_size
    with pytest.raises(ValueError, match="speeds"):
        dataclasses.replace(sim, speeds=(0.5, 0.5))
    assert speeds_from_steps([400, 300, 100]) == (1.0, 0.75, 0.25)  # a daemon's replicas' steps over one budget
    with pytest.raises(ValueError, match="at least one step"):
        speeds_from_steps([400, 0])


def test_the_simulator_combines_replicas_with_the_daemons_aggregation_code():
    """One implementation: the daemon's rounds and sync barrier and the simulator's call the same functions of
    trainer/aggregate.py, and the simulator's fullsync barrier drops a far gradient as the daemon's does."""
    import peer.averaging.aggregate as daemon_aggregate
    import peer.averaging.loop as daemon_loop
    import peer.averaging.sync as daemon_sync
    import trainer.aggregate as shared
    import trainer.sim.simulator as simulator

    assert daemon_loop.robust_combine is shared.robust_combine is simulator.robust_combine
    assert daemon_sync.barrier_mean is daemon_aggregate.barrier_mean is shared.barrier_mean is simulator.barrier_mean
    state = build(tiny(replicas=4), "fullsync")
    g = torch.Generator().manual_seed(0)
    honest = [[torch.randn(50, generator=g), torch.randn(7, generator=g)] for _ in range(3)]
    far = [10 * t for t in honest[0]]
    means = state.barrier([far, *honest])  # the far one first: the simulator's mean is the first replica's
    for r in range(4):  # every replica drops the far part and takes the plain mean of the rest, the far one too
        for j in range(2):
            torch.testing.assert_close(means[r][j], sum(h[j] for h in honest) / 3)
    pair = build(tiny(), "fullsync").barrier(honest[:2])
    assert all(torch.equal(pair[0][j], pair[1][j]) for j in range(2))
    torch.testing.assert_close(pair[0][0], (honest[0][0] + honest[1][0]) / 2)
