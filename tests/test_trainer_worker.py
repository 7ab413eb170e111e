"""StageWorker: pipeline gradients equal the full model's, stepping, accumulation, stashing, errors, state."""

from __future__ import annotations

import pytest
import torch

from trainer.config import RunConfig
from trainer.model import build_gpt
from trainer.worker import StageWorker


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
