"""Averaging math against hand-computed values: partitions, avg/delta/ema rules, mu schedule, WAGMA."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trainer.averaging import (
    AveragingError,
    Partitioner,
    SparseAveragingState,
    _seed,
    block_size,
    keyed_permutation,
    keyed_preimage,
    mu_at,
    wagma_group,
    wagma_is_global,
    wagma_n_fields,
)
from trainer.config import AVERAGING_RULES, AveragingConfig
from trainer.rules import RULES, wagma_members, wagma_phase


def test_partitions_disjoint_cover_and_agree():
    shapes = [(7, 5), (3,), (1,)]
    a, b = Partitioner(0, 1, shapes, 0.25), Partitioner(0, 1, shapes, 0.25)
    assert a.n == 4
    for cycle in range(2):
        parts = [a.indices(cycle * 4 + k) for k in range(4)]
        for j, numel in enumerate((35, 3, 1)):
            joined = torch.cat([p[j] for p in parts])
            assert sorted(joined.tolist()) == list(range(numel))  # disjoint and covering
            assert max(len(p[j]) for p in parts) - min(len(p[j]) for p in parts) <= 1
    from_b = {r: b.indices(r) for r in reversed(range(9))}  # another replica, asking in another order
    for r in range(9):
        assert all(torch.equal(x, y) for x, y in zip(a.indices(r), from_b[r], strict=True))
    other_stage, other_seed = Partitioner(0, 2, shapes, 0.25), Partitioner(1, 1, shapes, 0.25)
    assert not torch.equal(a.indices(0)[0], other_stage.indices(0)[0])
    assert not torch.equal(a.indices(0)[0], other_seed.indices(0)[0])
    assert not torch.equal(a.indices(0)[0], a.indices(4)[0])  # redrawn each cycle
    assert Partitioner(0, 0, [(3,)], 0.05).n == 20 and Partitioner(0, 0, [(3,)], 0.3).n == 4
    assert Partitioner(0, 0, [(2, 2)], 1.0).indices(5)[0].tolist() == [0, 1, 2, 3]


def test_partitions_drawn_ahead_on_another_thread_are_the_same_draws():
    """The daemon draws a round's partition on a worker thread while the compute thread may draw another: prepared
    or not, concurrent or not, every round's partition is the one a lone replica draws."""
    import threading

    from trainer.averaging import READY_MAX

    shapes = [(300, 70), (90,), (1,), (4000,)]
    ref = Partitioner(0, 1, shapes, 0.25)
    want = {r: ref.indices(r) for r in range(40)}
    ahead = Partitioner(0, 1, shapes, 0.25)
    worker = threading.Thread(target=lambda: [ahead.prepare(r) for r in range(0, 40, 2)])
    worker.start()
    got = {r: ahead.indices(r) for r in range(1, 40, 2)}  # drawn here, meanwhile
    worker.join()
    got.update({r: ahead.indices(r) for r in range(0, 40, 2)})  # the newest READY_MAX prepared, the rest redrawn
    for r in range(40):
        assert all(torch.equal(x, y) for x, y in zip(want[r], got[r], strict=True)), r
    assert not ahead._ready  # each prepared partition is handed out once
    for r in range(READY_MAX + 3):
        ahead.prepare(100 + r)
    assert sorted(ahead._ready) == [100 + r for r in range(3, READY_MAX + 3)]  # rounds never begun do not pile up


def _state(rule: str, **kw) -> tuple[SparseAveragingState, list[torch.Tensor]]:
    cfg = AveragingConfig(rule=rule, fraction=1.0, **kw)
    w = [torch.tensor([1.0, 2.0, 3.0, 4.0])]
    return SparseAveragingState(cfg, total_steps=100, seed=0, stage=0, params=w), w


def _drift_and_finish(state, w, round_no, drift, mean, step=0):
    sent = state.begin(round_no, w)
    w[0] += torch.tensor(drift)
    state.finish(round_no, [torch.tensor(mean)], w, local_step=step)
    return sent


def test_rule_avg():
    state, w = _state("avg")
    sent = _drift_and_finish(state, w, 0, [1.0, 0.0, 2.0, 0.0], [10.0, 10.0, 10.0, 10.0])
    assert sent[0].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert w[0].tolist() == [10.0, 10.0, 10.0, 10.0]


def test_rule_delta():
    state, w = _state("delta", lam=0.5)
    _drift_and_finish(state, w, 0, [1.0, 0.0, 2.0, -4.0], [10.0, 10.0, 10.0, 10.0])
    assert w[0].tolist() == [10.5, 10.0, 11.0, 8.0]


def test_rule_ema_two_rounds():
    state, w = _state("ema", lam=1.0, mu_start=0.5, mu_warmup_steps=10)
    _drift_and_finish(state, w, 0, [1.0, 0.0, 2.0, 0.0], [10.0, 10.0, 10.0, 10.0])
    # first update of a coordinate: e = drift (the reference code's start, not (1 - mu) * drift); W = a + e
    assert state.ema[0].tolist() == [1.0, 0.0, 2.0, 0.0]
    assert w[0].tolist() == [11.0, 10.0, 12.0, 10.0]
    _drift_and_finish(state, w, 1, [1.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0])
    # e = 0.5*[1, -, 2, -] + 0.5*[1, -, 0, -]; coordinates 1 and 3 had no drift yet, so theirs starts now
    assert state.ema[0].tolist() == [1.0, 2.0, 1.0, 0.0]
    assert w[0].tolist() == [1.0, 2.0, 1.0, 0.0]


def test_ema_sparse_partition_touches_only_its_coordinates():
    cfg = AveragingConfig(rule="ema", fraction=0.5, mu_start=0.5, mu_warmup_steps=10)
    w = [torch.arange(6.0)]
    state = SparseAveragingState(cfg, 100, seed=3, stage=0, params=w)
    idx = state.partitioner.indices(0)[0]
    before = w[0].clone()
    sent = state.begin(0, w)
    assert torch.equal(sent[0], before[idx])
    w[0] += 1.0  # local step drifts every coordinate by 1
    state.finish(0, [torch.full((3,), -5.0)], w, local_step=0)
    untouched = torch.ones(6, dtype=torch.bool)
    untouched[idx] = False
    assert torch.equal(w[0][untouched], before[untouched] + 1.0)
    assert torch.equal(w[0][idx], torch.full((3,), -4.0))  # a + drift: the first EMA value is the drift
    assert torch.equal(state.ema[0][untouched], torch.zeros(3))


def test_mu_schedule_hand_values():
    cfg = AveragingConfig(mu_start=0.5, mu_end=0.99, mu_warmup_steps=10)
    assert mu_at(cfg, 0, 21) == 0.5 and mu_at(cfg, 9, 21) == 0.5
    assert mu_at(cfg, 10, 21) == pytest.approx(0.5)  # t = 0
    assert mu_at(cfg, 15, 21) == pytest.approx(0.745)  # t = 0.5: 0.5 + 0.49 * 0.5
    assert mu_at(cfg, 12, 21) == pytest.approx(0.5 + 0.49 * (1 - math.cos(math.pi * 0.2)) / 2)
    assert mu_at(cfg, 20, 21) == pytest.approx(0.99) and mu_at(cfg, 500, 21) == pytest.approx(0.99)
    assert mu_at(cfg, 10, 5) == 0.99  # schedule shorter than the warm-up


def test_ema_uses_mu_of_the_local_step():
    state, w = _state("ema", lam=1.0, mu_start=0.5, mu_end=0.9, mu_warmup_steps=0)
    mu = mu_at(state.cfg, 50, 100)
    _drift_and_finish(state, w, 0, [2.0, 0.0, 0.0, 0.0], [0.0] * 4, step=50)
    assert state.ema[0][0].item() == pytest.approx(2.0)
    _drift_and_finish(state, w, 1, [0.0, 0.0, 0.0, 0.0], [0.0] * 4, step=50)
    assert state.ema[0][0].item() == pytest.approx(mu * 2.0)


def test_finish_rejects_bad_input_and_leaves_weights():
    state, w = _state("avg")
    state.begin(0, w)
    before = w[0].clone()
    with pytest.raises(AveragingError, match="shape"):
        state.finish(0, [torch.zeros(3)], w, 0)
    with pytest.raises(AveragingError, match="NaN"):
        state.finish(0, [torch.tensor([1.0, float("nan"), 0.0, 0.0])], w, 0)
    with pytest.raises(AveragingError, match="2 tensors"):
        state.finish(0, [torch.zeros(4), torch.zeros(4)], w, 0)
    assert torch.equal(w[0], before)
    with pytest.raises(AveragingError, match="already begun"):
        state.begin(0, w)
    state.abort(0)
    with pytest.raises(AveragingError, match="never begun"):
        state.finish(0, [torch.zeros(4)], w, 0)
    state.abort(0)  # aborting an unknown round is harmless


def test_wagma_groups_power_of_g():
    assert wagma_n_fields(8, 2) == 3 and wagma_n_fields(16, 4) == 2 and wagma_n_fields(1, 2) == 1
    assert wagma_group(5, 0, 8, 2) == [4, 5]
    assert wagma_group(5, 1, 8, 2) == [5, 7]
    assert wagma_group(5, 2, 8, 2) == [1, 5]
    assert wagma_group(5, 3, 8, 2) == [4, 5]  # phases cycle
    assert wagma_group(6, 0, 16, 4) == [4, 5, 6, 7]
    assert wagma_group(6, 1, 16, 4) == [2, 6, 10, 14]
    for G, R in ((2, 8), (4, 16)):  # XOR butterfly of the released code for G a power of two
        bits = G.bit_length() - 1
        for i in range(R):
            for t in range(wagma_n_fields(R, G)):
                assert wagma_group(i, t, R, G) == sorted(i ^ (m << (t * bits)) for m in range(G))


@pytest.mark.parametrize("R,G", [(6, 2), (5, 3), (10, 4), (3, 2), (8, 2)])
def test_wagma_groups_partition_and_mix(R, G):
    L = wagma_n_fields(R, G)
    reach = {i: {i} for i in range(R)}
    full_mix = L if G**L == R else 2 * L  # padded index spaces need a second pass over the fields
    for t in range(1, 1 + full_mix):  # any window of phases works; start off a cycle boundary
        groups = {tuple(wagma_group(i, t, R, G)) for i in range(R)}
        members = sorted(m for g in groups for m in g)
        assert members == list(range(R))  # disjoint, covering
        assert all(i in wagma_group(i, t, R, G) and len(g) <= G for g in groups for i in g)
        reach = {i: set().union(*(reach[m] for m in wagma_group(i, t, R, G))) for i in range(R)}
    assert all(reach[i] == set(range(R)) for i in range(R))  # every model influenced every other
    assert wagma_group(5, 1, 6, 2) == [5]  # padded index 7 does not exist


def test_wagma_phase_rotates_whatever_the_rounds_per_tick():
    """A daemon with two slots per tick that opens slot 0 only has even round numbers; the phase still advances by
    one a tick, so with 3-4 replicas (two digit fields) the groups rotate."""
    assert [wagma_phase(r, 2) for r in (0, 2, 4, 6)] == [0, 1, 2, 3]
    assert [wagma_phase(r, 1) for r in range(4)] == [0, 1, 2, 3]
    for n in (3, 4):
        groups = {tuple(wagma_group(0, wagma_phase(r, 2), n, 2)) for r in (0, 2, 4, 6)}
        assert len(groups) == 2
    assert [s for s in range(25) if wagma_is_global(s, 11)] == [10, 21]
    cfg = AveragingConfig(rule="wagma", wagma_global_every=3)
    assert wagma_members(1, 2, 4, cfg) == [0, 1, 2, 3] and wagma_members(1, 0, 4, cfg) == [0, 1]


def test_wagma_rule_through_state():
    """The delta form: the group's mean of the published (begin-time) models, plus our own progress since, on group
    and global rounds alike (partners' progress since arrives in later rounds)."""
    state, w = _state("wagma", wagma_group_size=2, wagma_global_every=3)
    sent = state.begin(0, w)  # published [1, 2, 3, 4]; the partner published [7, 6, 5, 4]
    w[0] += torch.tensor([1.0, 1.0, 0.0, 0.0])  # local steps before the partner's part arrives
    state.finish(0, [(sent[0] + torch.tensor([7.0, 6.0, 5.0, 4.0])) / 2], w, 0)
    assert w[0].tolist() == pytest.approx([5.0, 5.0, 4.0, 4.0])  # group mean then [4, 4, 4, 4] + drift
    state.begin(2, w)
    w[0] += 1.0
    state.finish(2, [torch.zeros(4)], w, 0)  # a global round: global mean 0 plus the drift since
    assert w[0].tolist() == [1.0] * 4


def test_rule_registry_declares_needs():
    assert set(RULES) == set(AVERAGING_RULES)
    cfg = AveragingConfig(fraction=0.05, round_steps=10)
    assert RULES["ema"].round_fraction(cfg) == pytest.approx(0.5) and RULES["ema"].ema and RULES["ema"].drift
    assert RULES["wagma"].round_fraction(cfg) == 1.0 and RULES["wagma"].groups
    assert RULES["full"].whole and not RULES["full"].drift and not RULES["none"].averages
    assert not RULES["avg"].drift and RULES["delta"].drift and not RULES["delta"].ema
    state, w = _state("full")
    state.begin(0, w)
    w[0] += 1.0
    state.finish(0, [torch.zeros(4)], w, 0)
    assert w[0].tolist() == [0.0] * 4


def test_state_dict_roundtrip():
    state, w = _state("ema")
    _drift_and_finish(state, w, 0, [1.0, 0.0, 2.0, 0.0], [0.0] * 4)
    other, _ = _state("ema")
    other.load_state_dict(state.state_dict())
    assert torch.equal(other.ema[0], state.ema[0])
    with pytest.raises(ValueError, match="does not match"):
        other.load_state_dict({"ema": [torch.zeros(5)]})


def test_finish_rejects_non_tensors():
    state, w = _state("wagma")
    state.begin(0, w)
    with pytest.raises(AveragingError, match="float tensor"):
        state.finish(0, [[0.0] * 4], w, 0)
    with pytest.raises(AveragingError, match="float tensor"):
        state.finish(0, [torch.zeros(4, dtype=torch.long)], w, 0)
    assert w[0].tolist() == [1.0, 2.0, 3.0, 4.0]


def test_keyed_permutation_is_a_permutation_and_pinned():
    for n in [1, 2, 3, 7, 16, 17, 255, 1000, 4097]:
        perm = keyed_permutation(n, key=n)
        assert np.array_equal(np.sort(perm), np.arange(n))
    assert not np.array_equal(keyed_permutation(1000, 1), keyed_permutation(1000, 2))
    # Wire-compatibility pin: replicas must agree on partitions across machines and releases. If this changes,
    # peers running the old and the new code would average different coordinates: bump the protocol version.
    assert keyed_permutation(10, 0).tolist() == [0, 3, 8, 2, 6, 9, 5, 7, 1, 4]
    assert keyed_permutation(10, 1).tolist() == [0, 3, 4, 2, 6, 5, 1, 9, 7, 8]
    with pytest.raises(ValueError):
        keyed_permutation(0, 1)


def test_keyed_preimage_inverts_the_permutation():
    for n in [1, 2, 3, 7, 16, 17, 1000, 4097]:
        perm = keyed_permutation(n, key=n + 1)
        assert np.array_equal(keyed_preimage(perm, n, key=n + 1), np.arange(n, dtype=np.uint64))
    with pytest.raises(ValueError):
        keyed_preimage(np.zeros(1, dtype=np.uint64), 0, 1)


def test_small_tensors_keep_the_coordinate_partitions():
    """Up to PERM_BLOCKS coordinates a partition is {i : pi(i) mod n == k}, as before blocks existed."""
    numel, n = 5000, 4
    parts = Partitioner(3, 1, [(numel,)], 1 / n)
    perm = keyed_permutation(numel, _seed(3, 1, 0, 1))
    for k in range(n):
        expected = np.flatnonzero(perm % np.uint64(n) == k)
        assert parts.indices(n + k)[0].tolist() == expected.tolist()


def test_large_stages_are_drawn_in_blocks_that_cover_them():
    assert block_size(1000, 4) == 1 and block_size(1 << 20, 2) == 64 and block_size(1 << 26, 2) == 256
    shapes = [(300, 301), (37,), (5, 7)]  # 90,300 coordinates: blocks of 16 at n = 4, short last blocks
    parts = Partitioner(0, 0, shapes, 0.25)
    assert parts.block == 16
    for cycle in range(2):
        got = [parts.indices(cycle * parts.n + k) for k in range(parts.n)]
        for j, shape in enumerate(shapes):
            numel = math.prod(shape)
            joined = torch.cat([g[j] for g in got])
            assert torch.equal(joined.sort().values, torch.arange(numel))  # disjoint and covering
            assert all(bool((g[j][1:] > g[j][:-1]).all()) for g in got)  # ascending
            assert max(len(g[j]) for g in got) - min(len(g[j]) for g in got) < 2 * 16  # one block, and a short one
    assert not torch.equal(parts.indices(0)[0], parts.indices(parts.n)[0])  # redrawn each cycle
    w = [torch.randn(s) for s in shapes]
    part = next(p for p in map(parts.slice, range(parts.n)) if any(p.tail))  # one with a short last block
    idx = part.indices()
    assert [len(i) for i in idx] == part.sizes
    assert torch.equal(part.gather(w), torch.cat([t.reshape(-1)[i] for t, i in zip(w, idx, strict=True)]))
    part.scatter(w, -torch.arange(float(part.total)) - 1)
    assert torch.equal(torch.cat([t.reshape(-1)[i] for t, i in zip(w, idx, strict=True)]),
                       -torch.arange(float(part.total)) - 1)


@pytest.mark.parametrize("rule", ["ema", "delta"])
@pytest.mark.parametrize("tau", [3, 8])
def test_whole_tensor_rounds_in_flight_keep_the_replicas_together(rule, tau):
    """Rounds of the whole tensor every step (p x round_steps = 1), tau of them in flight: each finish re-applies our
    own progress since its begin, not the corrections of the rounds that finished in between. Re-applied, those made
    the replicas' difference follow d(t+1) = d(t) - d(t - tau): with the EMA rule it had grown to 91 at tau 3 and to
    5722 at tau 8 after 80 rounds (a real 4-replica tiny_cadence stage, tau 40-116 steps, diverged the same way)."""
    _rounds_in_flight_keep_the_replicas_together(AveragingConfig(rule=rule, fraction=1.0, mu_warmup_steps=1000),
                                                 10_000, tau, 80)


def _rounds_in_flight_keep_the_replicas_together(cfg: AveragingConfig, n_steps: int, tau: int, rounds: int) -> None:
    """Two replicas average the whole tensor every step, each round finishing ``tau`` steps after its begin, while
    one trains twice as fast as the other: only the progress since the last begin may set them apart, and the
    mean keeps all of it."""
    w = [[torch.tensor([0.0, 10.0])], [torch.tensor([4.0, -10.0])]]
    states = [SparseAveragingState(cfg, n_steps, 0, 0, ws) for ws in w]
    published = {}
    for t in range(rounds):
        published[t] = [s.begin(t, ws)[0] for s, ws in zip(states, w, strict=True)]
        for i, ws in enumerate(w):
            ws[0] += torch.tensor([0.1, 0.1]) * (1 + i)  # training progress: replica 1 twice as fast
        if t >= tau:
            a = (published[t - tau][0] + published[t - tau][1]) / 2
            for s, ws in zip(states, w, strict=True):
                s.finish(t - tau, [a], ws, 0)
    gap = float((w[0][0] - w[1][0]).abs().max())
    assert gap == pytest.approx(0.1 * (tau + 1), abs=1e-4)  # only the progress since the last begin differs
    mean = (w[0][0] + w[1][0]) / 2
    assert mean.tolist() == pytest.approx([2.0 + 0.15 * rounds, 0.15 * rounds], abs=1e-4)  # no progress lost


def test_wagma_overlapping_rounds_re_apply_only_own_progress():
    """Rounds every step, tau 3 in flight: each finish sets W to the group's mean at its begin plus our own training
    progress since, not the corrections of the rounds that finished in between (which made the difference between
    replicas grow)."""
    _rounds_in_flight_keep_the_replicas_together(AveragingConfig(rule="wagma", fraction=1.0, wagma_global_every=1000),
                                                 100, 3, 40)
