"""StageWorker: pipeline gradients equal the full model's, stepping, accumulation, stashing, errors, state."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from trainer.config import RunConfig
from trainer.model import build_gpt
from trainer.optim import lr_at
from trainer.worker import StageWorker, resolve_device


def tiny(n_stages: int = 2, **sections) -> RunConfig:
    model = {"n_layer": 2, "n_embd": 16, "n_head": 2, "block_size": 8, "vocab_size": 256, **sections.pop("model", {})}
    optim = {"warmup_steps": 0, "total_steps": 100, **sections.pop("optim", {})}
    return RunConfig.default().replace(n_stages=n_stages, model=model, optim=optim, **sections)


def batch(seed: int = 0, B: int = 2, T: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (B, T), generator=g), torch.randint(0, 256, (B, T), generator=g)


def run_pipeline(workers: list[StageWorker], mb: int, x: torch.Tensor, y: torch.Tensor) -> float:
    h = x
    for w in workers[:-1]:
        h = w.forward(mb, h)
    loss, g = workers[-1].forward_loss(mb, h, y)
    for w in reversed(workers[:-1]):
        g = w.backward(mb, g)
    return loss


@pytest.mark.parametrize("n_stages", [1, 2, 3])
def test_pipeline_gradients_equal_full_model(n_stages):
    run = tiny(n_stages, model={"n_layer": 3})
    workers = [StageWorker(run, s, auto_step=False) for s in range(n_stages)]
    full = build_gpt(run)
    x, y = batch()
    loss = run_pipeline(workers, 0, x, y)
    ref = torch.nn.functional.cross_entropy(full(x).reshape(-1, 256), y.reshape(-1))
    ref.backward()
    assert loss == pytest.approx(ref.item(), abs=1e-6)
    got = [g for w in workers for g in w.grads()]
    want = [p.grad for p in full.parameters()]
    names = [n for n, _ in full.named_parameters()]
    # full.parameters() order: wte, wpe, blocks..., ln_f, lm_head — the same as the stages' concatenation
    assert len(got) == len(want)
    for n, a, b in zip(names, got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)
    assert all(w.pending() == 0 for w in workers)


def test_auto_step_advances_versions_and_lowers_loss():
    torch.manual_seed(0)
    run = tiny(2, optim={"lr": 3e-3})
    workers = [StageWorker(run, s) for s in range(2)]
    x, y = batch(1)
    first = run_pipeline(workers, 0, x, y)
    for mb in range(1, 30):
        last = run_pipeline(workers, mb, x, y)
    assert workers[0].version == workers[1].version == 30
    assert last < first - 1.0


def test_input_validation_errors():
    run = tiny(2)
    w0, w1 = StageWorker(run, 0), StageWorker(run, 1)
    with pytest.raises(ValueError, match="integer token ids"):
        w0.forward(0, torch.zeros(2, 8, 16))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 256\)"):
        w0.forward(0, torch.full((2, 8), 256))
    with pytest.raises(ValueError, match="block_size"):
        w0.forward(0, torch.zeros(2, 9, dtype=torch.long))
    with pytest.raises(ValueError, match=r"float activations \[B, T, 16\]"):
        w1.forward_loss(0, torch.zeros(2, 8, 15), torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="targets must be integer ids"):
        w1.forward_loss(0, torch.zeros(2, 8, 16), torch.zeros(2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="last stage"):
        w1.forward(0, torch.zeros(2, 8, 16))
    with pytest.raises(ValueError, match="not the last stage"):
        w0.forward_loss(0, torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="not pending"):
        w0.backward(5, torch.zeros(2, 8, 16))
    w0.forward(1, torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="already pending"):
        w0.forward(1, torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="must be float"):
        w0.backward(1, torch.zeros(2, 8, 17))
    assert w0.pending() == 1  # a rejected gradient leaves the micro-batch pending
    w0.drop(1)
    w0.drop(1)  # idempotent
    assert w0.pending() == 0


def test_evaluate_matches_training_loss_without_stepping():
    run = tiny(2)
    w0, w1 = StageWorker(run, 0, auto_step=False), StageWorker(run, 1, auto_step=False)
    x, y = batch(2)
    ev = w1.evaluate(w0.evaluate(x), y)
    loss = run_pipeline([w0, w1], 0, x, y)
    assert ev == pytest.approx(loss, abs=1e-6)
    assert w0.version == 0


def _grad_at(worker: StageWorker, weights: list[torch.Tensor], x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    """Reference: d(sum(out * g))/dW of a fresh copy of the stage's module at ``weights``."""
    ref = copy.deepcopy(worker.model)
    with torch.no_grad():
        for p, w in zip(ref.parameters(), weights, strict=True):
            p.copy_(w)
    ref.zero_grad()
    (ref(x) * g).sum().backward()
    return [p.grad.clone() for p in ref.parameters()]


@pytest.mark.parametrize("stashing", [True, False])
def test_backward_uses_stashed_or_latest_weights(stashing):
    run = tiny(2, optim={"weight_stashing": stashing, "lr": 1e-2})
    w0 = StageWorker(run, 0, auto_step=False)
    (x0, _), (x1, _) = batch(0), batch(1)
    v0 = [p.detach().clone() for p in w0.parameters()]
    w0.forward(0, x0)
    w0.forward(1, x1)  # both forwarded at version 0
    g = torch.randn(2, 8, 16)
    w0.backward(0, g)
    w0.optimizer_step()  # version 1: weights change while micro-batch 1 is still pending
    v1 = [p.detach().clone() for p in w0.parameters()]
    assert w0.version == 1 and not all(torch.equal(a, b) for a, b in zip(v0, v1, strict=True))
    assert w0.stashed_versions() == ([0] if stashing else [])
    w0.backward(1, g)
    want = _grad_at(w0, v0 if stashing else v1, x1, g)
    for a, b in zip(w0.grads(), want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert w0.stashed_versions() == []  # freed with the last micro-batch of version 0
    assert all(torch.equal(p, b) for p, b in zip(w0.parameters(), v1, strict=True))  # live weights untouched
    w0.optimizer_step()
    assert w0.version == 2


def test_stash_freed_on_drop_and_not_made_without_references():
    run = tiny(2, optim={"weight_stashing": True})
    w0 = StageWorker(run, 0, auto_step=False)
    x, _ = batch()
    w0.optimizer_step()
    assert w0.stashed_versions() == []  # nothing pending: no copy needed
    w0.forward(7, x)
    w0.optimizer_step()
    assert w0.stashed_versions() == [1]
    w0.drop(7)
    assert w0.stashed_versions() == [] and w0.pending() == 0


@pytest.mark.parametrize("change", ["averaging", "load", "averaging+step"])
def test_backward_uses_forward_weights_whatever_changed_them(change):
    """An averaging finish or a state load between a micro-batch's forward and its backward (the daemon's compute
    thread runs them in between) must not reach that backward: it runs at the weights its forward used."""
    run = tiny(2, optim={"weight_stashing": True, "lr": 1e-2}, averaging={"rule": "avg", "fraction": 0.5})
    w0 = StageWorker(run, 0, auto_step=False)
    x, _ = batch()
    before = [p.detach().clone() for p in w0.parameters()]
    w0.forward(0, x)
    if change.startswith("averaging"):
        values = w0.averaging_begin(0)
        w0.averaging_finish(0, [v * 0 + 0.5 for v in values])
        if change.endswith("step"):
            w0.set_grads([torch.ones_like(p) for p in w0.parameters()])
            w0.optimizer_step()
    else:
        donor = StageWorker(run, 0, seed=7)
        w0.load_state_dict(donor.state_dict())
    live = [p.detach().clone() for p in w0.parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(before, live, strict=True))
    assert w0.pending() == 1 and len(w0.stashed_versions()) == 1
    g = torch.randn(2, 8, 16)
    w0.backward(0, g)
    for a, b in zip(w0.grads(), _grad_at(w0, before, x, g), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert w0.stashed_versions() == []
    assert all(torch.equal(p, b) for p, b in zip(w0.parameters(), live, strict=True))  # live weights untouched


def test_no_stash_without_pending_and_backward_after_change_without_stashing_uses_latest():
    run = tiny(2, optim={"weight_stashing": False}, averaging={"rule": "avg", "fraction": 0.5})
    w0 = StageWorker(run, 0, auto_step=False)
    x, _ = batch()
    w0.forward(0, x)
    values = w0.averaging_begin(0)
    w0.averaging_finish(0, [v * 0 + 0.5 for v in values])
    post = [p.detach().clone() for p in w0.parameters()]
    assert w0.stashed_versions() == []
    g = torch.randn(2, 8, 16)
    w0.backward(0, g)
    for a, b in zip(w0.grads(), _grad_at(w0, post, x, g), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    stashing = StageWorker(tiny(2, averaging={"rule": "avg", "fraction": 0.5}), 0, auto_step=False)
    values = stashing.averaging_begin(0)
    stashing.averaging_finish(0, [v * 0 + 0.5 for v in values])
    assert stashing.stashed_versions() == []  # nothing pending: no copy


def test_averaging_hooks_apply_rule_and_abort_leaves_weights():
    run = tiny(2, averaging={"rule": "delta", "fraction": 0.25, "lam": 1.0})
    w = StageWorker(run, 1, auto_step=False)
    idx = w.averaging.partitioner.indices(3)
    before = [p.detach().clone() for p in w.parameters()]
    values = w.averaging_begin(3)
    assert [v.shape for v in values] == [i.shape for i in idx]
    assert all(torch.equal(v, b.reshape(-1)[i]) for v, b, i in zip(values, before, idx, strict=True))
    w.averaging_abort(3)
    assert all(torch.equal(p, b) for p, b in zip(w.parameters(), before, strict=True))
    w.averaging_begin(3)
    w.set_grads([torch.ones_like(p) for p in w.parameters()])
    w.optimizer_step()
    stepped = [p.detach().clone() for p in w.parameters()]
    mean = [torch.full_like(v, 0.25) for v in values]
    w.averaging_finish(3, mean)
    for p, b, s, i in zip(w.parameters(), before, stepped, idx, strict=True):
        expect = s.reshape(-1).clone()
        expect[i] = 0.25 + (s.reshape(-1)[i] - b.reshape(-1)[i])  # a + lam * drift
        torch.testing.assert_close(p.detach().reshape(-1), expect)
    none = StageWorker(tiny(2, averaging={"rule": "none"}), 0)
    with pytest.raises(ValueError, match="rule is 'none'"):
        none.averaging_begin(0)


def test_mean_grads_is_the_flush_mean_the_simulator_steps_with():
    run = tiny(2, optim={"lr": 1e-2})
    w1 = StageWorker(run, 1, auto_step=False)
    for i in range(3):
        w1.forward_loss(i, torch.randn(2, 8, 16), batch(i)[1])
    assert w1.accumulated == 3
    for m, g in zip(w1.mean_grads(), w1.grads(), strict=True):
        torch.testing.assert_close(m, g / 3)
    w1.optimizer_step()
    assert all(not m.any() for m in w1.mean_grads())  # nothing accumulated: zeros, no division by zero


def test_accumulation_sums_gradients_and_steps_once():
    run = tiny(2, optim={"accumulate": 3, "lr": 1e-2})
    acc = StageWorker(run, 1)  # auto_step with accumulate=3
    ref = StageWorker(run, 1, auto_step=False)
    batches = [(torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(i)), batch(i)[1]) for i in range(3)]
    for i, (h, y) in enumerate(batches):
        acc.forward_loss(i, h, y)
        assert acc.version == (1 if i == 2 else 0)
    for i, (h, y) in enumerate(batches):
        ref.forward_loss(i, h, y)  # sums into .grad (see the next test)
    ref.optimizer_step()
    assert acc.version == ref.version == 1
    for a, b in zip(acc.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    states = [s["step"].item() for s in acc.optimizer.state_dict()["state"].values()]
    assert states and all(s == 1.0 for s in states)  # optimiser state advanced once for 3 gradients


def test_accumulated_gradient_is_sum_of_individual_ones():
    run = tiny(2)
    w = StageWorker(run, 1, auto_step=False)
    parts = []
    for i in range(2):
        one = StageWorker(run, 1, auto_step=False)
        h, y = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(i)), batch(i)[1]
        one.forward_loss(i, h, y)
        w.forward_loss(i, h, y)
        parts.append(one.grads())
    for got, a, b in zip(w.grads(), *parts, strict=True):
        torch.testing.assert_close(got, a + b)


def test_lr_schedule_and_nonfinite_step_skipped():
    run = tiny(2, optim={"warmup_steps": 4, "lr": 1e-2})
    w = StageWorker(run, 1, auto_step=False)
    w.set_grads([torch.ones_like(p) for p in w.parameters()])
    w.optimizer_step()
    assert w.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 / 5)
    before = [p.detach().clone() for p in w.parameters()]
    w.set_grads([torch.full_like(p, float("nan")) for p in w.parameters()])
    w.optimizer_step()
    assert w.steps_skipped == 1 and w.version == 1
    assert all(torch.equal(p, b) for p, b in zip(w.parameters(), before, strict=True))
    with pytest.raises(ValueError, match="expected"):
        w.set_grads([torch.zeros(1) for _ in w.parameters()])
    with pytest.raises(ValueError, match="tensors"):
        w.set_grads([])


def test_grad_clipping_is_per_stage():
    run = tiny(2, optim={"grad_clip": 1.0})
    w = StageWorker(run, 1, auto_step=False)
    w.set_grads([torch.full_like(p, 10.0) for p in w.parameters()])
    n = sum(p.numel() for p in w.parameters())
    w.optimizer_step()
    assert w.last_grad_norm == pytest.approx(10.0 * n**0.5, rel=1e-5)


def test_dropout_recompute_reproduces_the_forward_masks():
    run = tiny(2, model={"dropout": 0.3})
    w0 = StageWorker(run, 0, auto_step=False)
    x, _ = batch()
    g = torch.randn(2, 8, 16)
    ref = copy.deepcopy(w0.model)
    torch.manual_seed(11)
    y = w0.forward(0, x)
    torch.manual_seed(11)
    out = ref(x)
    torch.testing.assert_close(y, out.detach())
    (out * g).sum().backward()
    torch.manual_seed(99)  # the RNG moved on; backward must still use the forward's masks
    w0.backward(0, g)
    for a, p in zip(w0.grads(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-7)


def _train(workers: list[StageWorker], start: int, n: int) -> list[float]:
    return [run_pipeline(workers, mb, *batch(mb)) for mb in range(start, start + n)]


def _avg_round(workers: list[StageWorker], r: int) -> None:
    for w in workers:
        v = w.averaging_begin(r)
        w.averaging_finish(r, [t * 0.5 for t in v])


def test_state_dict_round_trips_exactly():
    run = tiny(2, averaging={"rule": "ema", "fraction": 0.5}, optim={"accumulate": 2})
    a = [StageWorker(run, s) for s in range(2)]
    _train(a, 0, 5)  # leaves one gradient accumulated
    _avg_round(a, 0)
    assert a[0].accumulated == 1
    b = [StageWorker(run, s) for s in range(2)]
    for src, dst in zip(a, b, strict=True):
        dst.load_state_dict(src.state_dict())
        assert dst.version == src.version and dst.accumulated == src.accumulated
        assert torch.equal(dst.averaging.ema[0], src.averaging.ema[0])
    la, lb = _train(a, 5, 4), _train(b, 5, 4)
    _avg_round(a, 1)
    _avg_round(b, 1)
    assert la == lb
    for wa, wb in zip(a, b, strict=True):
        assert all(torch.equal(p, q) for p, q in zip(wa.parameters(), wb.parameters(), strict=True))
    other = StageWorker(tiny(2, seed=5), 0)
    with pytest.raises(ValueError, match="state is for run"):
        other.load_state_dict(a[0].state_dict())


def test_load_state_dict_rejects_bad_states_and_leaves_worker_intact():
    run = tiny(2, averaging={"rule": "ema", "fraction": 0.5})
    src, dst = StageWorker(run, 1), StageWorker(run, 1, seed=9)
    src.forward_loss(0, torch.randn(2, 8, 16), batch()[1])
    good = src.state_dict()
    before = copy.deepcopy(dst.state_dict())

    def bad(mutate) -> dict:
        d = copy.deepcopy(good)
        mutate(d)
        return d

    key = next(iter(good["model"]))
    cases = {
        "NaN": bad(lambda d: d["model"][key].view(-1).__setitem__(0, float("nan"))),
        "shape": bad(lambda d: d["model"].__setitem__(key, torch.zeros(3))),
        "do not match": bad(lambda d: d["model"].pop(key)),
        "unknown parameter": bad(lambda d: d["optimizer"]["state"].__setitem__(999, {})),
        "non-negative int": bad(lambda d: d.__setitem__("local_step", -1)),
        "lacks": bad(lambda d: d.pop("grads")),
        "EMA": bad(lambda d: d["averaging"].__setitem__("ema", [])),
        r"optimizer\[0\]\[exp_avg\]": bad(lambda d: d["optimizer"]["state"][0].__setitem__("exp_avg", torch.ones(2))),
        # v = 0 under m != 0 (or v < 0): a step of any size, whoever sends it (a donor when witnessing is off)
        "never reach": bad(lambda d: d["optimizer"]["state"][0]["exp_avg_sq"].zero_()),
        r"optimizer\[1\] holds moments": bad(lambda d: d["optimizer"]["state"][1]["exp_avg_sq"].fill_(-1.0)),
        "step count": bad(lambda d: d["optimizer"]["state"][0].__setitem__("step", torch.tensor(0.0))),
        "not an AdamW": bad(lambda d: d["optimizer"]["state"][0].__setitem__("momentum_buffer", torch.tensor(1.0))),
    }
    for match, state in cases.items():
        with pytest.raises((ValueError, TypeError), match=match):
            dst.load_state_dict(state)
    after = dst.state_dict()
    assert all(torch.equal(after["model"][k], v) for k, v in before["model"].items())
    assert after["local_step"] == before["local_step"] == 0
    # hyper-parameters are this run's own, whatever the donor says
    hostile = bad(lambda d: d["optimizer"]["param_groups"][0].__setitem__("weight_decay", 100.0))
    dst.load_state_dict(hostile)
    assert dst.optimizer.param_groups[0]["weight_decay"] == run.optim.weight_decay
    assert dst.local_step == 1 and torch.equal(dst.parameters()[0], src.parameters()[0])


def test_middle_stage_stashing_gradient_wrt_input_and_weights():
    run = tiny(3, model={"n_layer": 3}, optim={"weight_stashing": True, "lr": 1e-2})
    w = StageWorker(run, 1, auto_step=False)
    h = torch.randn(2, 8, 16)
    v0 = [p.detach().clone() for p in w.parameters()]
    w.forward(0, h)
    w.set_grads([torch.ones_like(p) for p in w.parameters()])
    w.optimizer_step()
    g = torch.randn(2, 8, 16)
    grad_h = w.backward(0, g)
    ref = copy.deepcopy(w.model)
    with torch.no_grad():
        for p, v in zip(ref.parameters(), v0, strict=True):
            p.copy_(v)
    hh = h.clone().requires_grad_(True)
    (ref(hh) * g).sum().backward()
    torch.testing.assert_close(grad_h, hh.grad, rtol=1e-5, atol=1e-7)
    for a, p in zip(w.grads(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_matches_cpu():
    run = tiny(2)
    cpu = [StageWorker(run, s, auto_step=False) for s in range(2)]
    gpu = [StageWorker(run, s, device="cuda", auto_step=False) for s in range(2)]
    assert all(p.is_cuda for w in gpu for p in w.parameters())
    x, y = batch()
    assert run_pipeline(gpu, 0, x, y) == pytest.approx(run_pipeline(cpu, 0, x, y), abs=1e-4)
    for wc, wg in zip(cpu, gpu, strict=True):
        for a, b in zip(wc.grads(), wg.grads(), strict=True):
            torch.testing.assert_close(a, b.cpu(), rtol=1e-3, atol=1e-5)
        v = wg.averaging_begin(0)
        wg.averaging_finish(0, [t.cpu() for t in v])
        wg.optimizer_step()


@pytest.mark.parametrize("stashing", [True, False])
def test_asynchronous_1f1b_pipeline_learns(stashing):
    """A 3-stage pipeline with 3 micro-batches in flight (stage s sees gradients K-1-s steps stale) learns a small
    corpus; with stashing every backward runs at the version its forward used."""
    torch.manual_seed(0)
    run = tiny(3, model={"n_layer": 3}, optim={"weight_stashing": stashing, "lr": 3e-3, "warmup_steps": 5})
    workers = [StageWorker(run, s) for s in range(3)]
    data = [batch(i % 4) for i in range(120)]
    inflight: list[tuple[int, torch.Tensor]] = []  # (mb, gradient at the last stage's input)
    losses = []
    for mb, (x, y) in enumerate(data):
        h = workers[1].forward(mb, workers[0].forward(mb, x))
        loss, g = workers[2].forward_loss(mb, h, y)
        losses.append(loss)
        inflight.append((mb, g))
        if len(inflight) == 3:  # the oldest micro-batch's gradient reaches the earlier stages 2 steps late
            old, g = inflight.pop(0)
            workers[0].backward(old, workers[1].backward(old, g))
    assert workers[2].version == 120 and workers[0].version == 118
    assert max(len(w.stashed_versions()) for w in workers) <= 2
    assert sum(losses[-8:]) / 8 < sum(losses[:8]) / 8 - 1.5


def test_resolve_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="no CUDA GPU"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"
    assert resolve_device("cuda:1") == "cuda:1"


def test_last_delay_counts_the_steps_between_forward_and_backward():
    run = RunConfig.default().replace(n_stages=2, model={"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 16})
    w0 = StageWorker(run, 0)
    x = torch.randint(0, 256, (2, 16))
    for mb in range(3):
        w0.forward(mb, x)  # all three at version 0
    for mb in range(3):
        w0.backward(mb, torch.randn(2, 16, 32))
        assert w0.last_delay == mb  # each backward steps, so the next one is one step staler



def test_a_state_loaded_without_moments_warms_its_learning_rate_up_again():
    """A witnessed state from another peer comes without optimiser moments (peer.state.witness.sanitize): fresh Adam
    moments move every coordinate by a full lr, so the worker ramps its lr up again over the run's warm-up steps;
    its own checkpoint (moments kept) resumes at the schedule's lr."""
    run = RunConfig.from_toml(Path(__file__).parent / "runs" / "tiny.toml")
    donor = StageWorker(run, 0)
    g = torch.Generator().manual_seed(0)
    for _ in range(run.optim.warmup_steps + 20):
        donor.set_grads([torch.randn(p.shape, generator=g) for p in donor.parameters()])
        donor.optimizer_step()
    scheduled = lr_at(run.optim, donor.local_step)
    own = StageWorker(run, 0)
    own.load_state_dict(donor.state_dict())
    assert own.rewarm_from is None and own.lr_now() == scheduled
    sanitized = {**donor.state_dict(), "optimizer": {**donor.state_dict()["optimizer"], "state": {}}}
    joiner = StageWorker(run, 0)
    joiner.load_state_dict(sanitized)
    assert joiner.rewarm_from == donor.local_step
    assert joiner.lr_now() == pytest.approx(scheduled / (run.optim.warmup_steps + 1))
    seen = []
    for _ in range(run.optim.warmup_steps + 2):
        seen.append(joiner.lr_now())
        joiner.set_grads([torch.randn(p.shape, generator=g) for p in joiner.parameters()])
        joiner.optimizer_step()
    assert seen == sorted(seen[: run.optim.warmup_steps]) + seen[run.optim.warmup_steps:]  # ramps up
    assert joiner.rewarm_from is None and joiner.lr_now() == lr_at(run.optim, joiner.local_step)
    fresh = StageWorker(run, 0)
    fresh.load_state_dict(StageWorker(run, 0).state_dict())  # the seeded init at step 0: the schedule warms it
    assert fresh.rewarm_from is None
