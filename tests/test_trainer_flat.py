"""The averaging's flat layout (trainer/flat.py): a round over the flat buffer equals the per-tensor round, the
parameters stay views of it through optimiser steps and state loads (and are moved back when rebound), and a round
issues as many operators for many tensors as for few."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tests.test_trainer_worker import tiny
from trainer.averaging import AveragingError, SparseAveragingState, mu_at
from trainer.config import AveragingConfig
from trainer.flat import FlatLayout
from trainer.rules import RoundInputs, rule_of
from trainer.worker import StageWorker

SHAPES = [(37, 29), (1000,), (3, 333), (7,), (1,), (64, 65)]  # 9,532 coordinates: short last blocks at block 2-8


class _PerTensor:
    """The round as it ran before the flat layout: every gather and write-back a loop over the tensors
    (``Slice.gather`` / ``Slice.scatter``), the rule once over the joined slice."""

    def __init__(self, cfg: AveragingConfig, params: list[torch.Tensor]) -> None:
        self.cfg, self.rule = cfg, rule_of(cfg)
        self.ema = [torch.zeros_like(p) for p in params] if self.rule.ema else []
        self.applied = [torch.zeros_like(p) for p in params] if self.rule.own_progress else []
        self.snaps: dict[int, tuple] = {}

    def begin(self, part, params: list[torch.Tensor], r: int) -> list[torch.Tensor]:
        flat = part.gather(params)
        self.snaps[r] = (part, flat.clone(), part.gather(self.applied) if self.applied else None)
        return list(torch.split(flat, part.sizes))

    def finish(self, r: int, mean: list[torch.Tensor], params: list[torch.Tensor], step: int) -> None:
        part, then, applied0 = self.snaps.pop(r)
        a, now = torch.cat(mean), part.gather(params)
        ema = part.gather(self.ema) if self.ema else None
        before = None
        if applied0 is not None:
            applied = part.gather(self.applied)
            then, before = then + (applied - applied0), now.clone()
        new, new_ema = self.rule.apply_round(RoundInputs(mean=a, now=now, then=then, ema=ema, lam=self.cfg.lam,
                                                         mu=mu_at(self.cfg, step, 1000)))
        part.scatter(params, new)
        if before is not None:
            part.scatter(self.applied, applied.add_(new - before))
        if new_ema is not None:
            part.scatter(self.ema, new_ema)


@pytest.mark.parametrize("lag", [0, 3])
@pytest.mark.parametrize("rule,fraction", [("ema", 0.5), ("ema", 0.1), ("delta", 0.5), ("avg", 0.5),
                                           ("full", 1.0), ("wagma", 1.0)])
def test_flat_rounds_equal_the_per_tensor_rounds(rule, fraction, lag):
    """Rounds finishing ``lag`` rounds after their begin (three in flight, sharing coordinates across cycles, or
    one at a time) with training between them: the flat path's published values, weights and EMA are bit-identical
    to the per-tensor path's."""
    cfg = AveragingConfig(rule=rule, fraction=fraction, round_steps=1, mu_warmup_steps=2)
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    flat_w = [t.clone() for t in init]
    ref_w = [t.clone() for t in init]
    state = SparseAveragingState(cfg, 1000, seed=5, stage=1, params=flat_w)
    ref = _PerTensor(cfg, ref_w)
    assert (state.layout.block > 1) == (fraction == 0.5)  # blocks with padding, and single coordinates
    published: dict[int, list[torch.Tensor]] = {}
    for r in range(12):
        sent = state.begin(r, flat_w)
        want = ref.begin(state.snapshots[r].part, ref_w, r)
        assert all(torch.equal(x, y) for x, y in zip(sent, want, strict=True))
        for a, b in zip(flat_w, ref_w, strict=True):  # the same training step on both
            step = torch.randn(a.shape, generator=gen) * 0.01
            a.add_(step)
            b.add_(step)
        published[r] = [v.clone() for v in sent]
        if r >= lag:
            mean = [v + torch.randn(v.shape, generator=gen) * 0.1 for v in published.pop(r - lag)]
            state.finish(r - lag, [m.clone() for m in mean], flat_w, r)
            ref.finish(r - lag, mean, ref_w, r)
    assert all(torch.equal(a, b) for a, b in zip(flat_w, ref_w, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(state.ema, ref.ema, strict=True))
    # (the corrections applied are kept only while other rounds are in flight: their differences are what counts)
    padding = torch.ones(state.layout.size, dtype=torch.bool)
    for view in state.layout.views(padding):
        view.fill_(False)
    for buf in (state.flat, state.ema_flat, state.applied_flat):
        assert buf is None or not bool(buf[padding].any())  # the padding stays zero


def _worker(optimizer: str = "nadam", rule: str = "ema") -> StageWorker:
    return StageWorker(tiny(optim={"optimizer": optimizer}, averaging={"rule": rule}), 0)


def _bound(w: StageWorker) -> bool:
    assert w.averaging is not None
    return w.averaging.layout.holds(w.averaging.flat, w.parameters())


def _round_sees_the_weights(w: StageWorker, r: int) -> None:
    """A round's begin publishes exactly the live weights' values at its partition."""
    assert w.averaging is not None
    w.averaging_prepare(r)
    sent = w.averaging_begin(r)
    want = w.averaging.snapshots[r].part.gather(w.parameters())
    assert torch.equal(torch.cat(sent), want)
    w.averaging_abort(r)


@pytest.mark.parametrize("optimizer", ["nadam", "adamw"])
def test_parameters_stay_views_through_steps_rounds_and_loads(optimizer):
    w = _worker(optimizer)
    x = torch.randint(0, w.run.model.vocab_size, (2, 8))
    assert _bound(w)
    before = [p.detach().clone() for p in w.parameters()]
    for i in range(2):
        w.forward(i, x)
        w.backward(i, torch.randn(2, 8, w.run.model.n_embd))
    assert w.local_step == 2 and _bound(w)  # the optimiser stepped the views in place
    assert any(not torch.equal(a, b) for a, b in zip(before, w.parameters(), strict=True))
    sent = w.averaging_begin(0)
    w.averaging_finish(0, [v + 1.0 for v in sent])
    assert _bound(w)
    _round_sees_the_weights(w, 1)
    donor = _worker(optimizer)
    w.load_state_dict(donor.state_dict())
    assert _bound(w)
    assert all(torch.equal(a, b) for a, b in zip(w.parameters(), donor.parameters(), strict=True))
    _round_sees_the_weights(w, 2)


def test_rebound_parameters_are_moved_back_into_the_buffer():
    """Something that rebinds ``param.data`` (a load with assign, a device move) breaks the views: the next round
    finds it, moves the parameters back, and averages their current values."""
    w = _worker()
    donor = _worker()
    with torch.no_grad():
        for p in donor.parameters():
            p.add_(1.0)
    w.model.load_state_dict(donor.model.state_dict(), assign=True)
    w._params = list(w.model.parameters())
    assert not _bound(w)
    _round_sees_the_weights(w, 0)
    assert _bound(w)
    assert all(torch.equal(a, b) for a, b in zip(w.parameters(), donor.parameters(), strict=True))


def test_flatten_refuses_mixed_dtypes_and_wrong_shapes():
    layout = FlatLayout([(2, 3), (4,)], 4)
    assert layout.size == 12 and layout.start == [0, 2]
    with pytest.raises(ValueError, match="one dtype"):
        layout.flatten([torch.zeros(2, 3), torch.zeros(4, dtype=torch.float64)])
    with pytest.raises(ValueError, match="do not fit"):
        layout.flatten([torch.zeros(3, 2), torch.zeros(4)])


def _round_ops(n_tensors: int) -> int:
    cfg = AveragingConfig(rule="ema", fraction=0.5, round_steps=1)
    w = [torch.randn(97 * (j + 1)) for j in range(n_tensors)]
    state = SparseAveragingState(cfg, 1000, seed=0, stage=0, params=w)
    state.begin(0, w)  # warm: scratch buffers
    state.finish(0, [torch.zeros(s) for s in state.snapshots[0].part.sizes], w, 0)
    mean = [v.clone() for v in state.begin(1, w)]
    state.prepare(2, "cpu")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        state.begin(2, w)
        state.finish(1, mean, w, 1)
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and (
        e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


def test_a_round_issues_as_many_operators_for_many_tensors_as_for_few():
    few, many = _round_ops(3), _round_ops(60)
    assert few == many, (few, many)
    assert many < 60  # a per-tensor loop alone would issue several per tensor


def test_a_placed_aggregate_is_checked_off_the_compute_thread_and_finishes_like_the_plain_one():
    results = []
    for placed in (False, True):
        w = StageWorker(tiny(), 0)
        w.averaging_prepare(0)
        mean = [v + 0.01 for v in w.averaging_begin(0)]
        w.local_step += 1
        if placed:
            p = w.averaging_place(mean)
            assert all(a is b for a, b in zip(p.tensors, mean, strict=True))  # the CPU: nothing copied
            w.averaging_finish(0, p)
        else:
            w.averaging_finish(0, mean)
        results.append(torch.cat([q.detach().reshape(-1) for q in w.parameters()]))
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_placing_an_aggregate_with_nan_or_inf_refuses_it_and_the_round_can_be_aborted(bad):
    w = StageWorker(tiny(), 0)
    w.averaging_prepare(0)
    mean = [v.clone() for v in w.averaging_begin(0)]
    mean[-1][0] = bad
    before = [q.detach().clone() for q in w.parameters()]
    with pytest.raises(AveragingError, match="NaN or Inf"):
        w.averaging_place(mean)
    w.averaging_abort(0)
    assert all(torch.equal(a, b) for a, b in zip(before, w.parameters(), strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_placed_aggregate_lands_on_the_gpu_off_the_compute_thread_and_finishes_like_the_host_one():
    from concurrent.futures import ThreadPoolExecutor

    results = []
    for place in (False, True):
        w = StageWorker(tiny(), 0, device="cuda")
        w.averaging_prepare(0)
        mean = [v.cpu() * 0.5 for v in w.averaging_begin(0)]
        if place:
            with ThreadPoolExecutor(1) as pool:
                placed = pool.submit(w.averaging_place, mean).result()
            assert all(m.device.type == "cuda" for m in placed.tensors)
            w.averaging_finish(0, placed)
        else:
            w.averaging_finish(0, mean)
        results.append(torch.cat([p.detach().reshape(-1).cpu() for p in w.parameters()]))
    assert torch.equal(results[0], results[1])
