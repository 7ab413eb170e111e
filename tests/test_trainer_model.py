"""The GPT and its stages: slicing equals the full model, init is nanoGPT's, shapes and errors are checked."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.config import RunConfig
from trainer.model import GPT, build_gpt, build_stage


def tiny(n_stages: int = 3, n_layer: int = 4, **kw) -> RunConfig:
    model = {"n_layer": n_layer, "n_embd": 32, "n_head": 2, "block_size": 16, "vocab_size": 256}
    return RunConfig.default().replace(n_stages=n_stages, model=model, **kw)


@pytest.mark.parametrize("n_stages,split", [(1, ()), (2, ()), (3, ()), (4, (0, 2, 2, 0)), (3, (3, 1, 0))])
def test_chained_stages_equal_full_model(n_stages, split):
    run = tiny(n_stages, layers_per_stage=split)
    full = build_gpt(run)
    stages = [build_stage(run, s) for s in range(n_stages)]
    idx = torch.randint(0, 256, (2, 16))
    h = idx
    for s in stages:
        h = s(h)
    assert h.shape == (2, 16, 256)
    torch.testing.assert_close(h, full(idx), rtol=0, atol=0)
    # every stage parameter is bit-identical to the same slice of the full model
    full_params = dict(full.named_parameters())
    for s in stages:
        for name, p in s.named_parameters():
            if name.startswith("blocks."):
                _, i, rest = name.split(".", 2)
                name = f"blocks.{s.layer_start + int(i)}.{rest}"
            assert torch.equal(p, full_params[name]), name


def test_stage_contents():
    run = tiny(3)
    first, mid, last = (build_stage(run, s) for s in range(3))
    assert hasattr(first, "wte") and not hasattr(first, "lm_head")
    assert not hasattr(mid, "wte") and not hasattr(mid, "ln_f")
    assert hasattr(last, "lm_head") and not hasattr(last, "wpe")
    assert last.lm_head.weight.data_ptr() != first.wte.weight.data_ptr()  # untied head
    assert [len(s.blocks) for s in (first, mid, last)] == [2, 1, 1]


def test_seed_changes_weights_and_is_deterministic():
    run = tiny(2)
    a, b, c = build_stage(run, 1), build_stage(run, 1), build_stage(run, 1, seed=7)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.blocks[0].mlp.c_fc.weight, c.blocks[0].mlp.c_fc.weight)


def test_init_statistics_follow_nanogpt():
    cfg = tiny(1, n_layer=8).model.__class__(n_layer=8, n_embd=128, n_head=4, block_size=32, vocab_size=256)
    model = GPT(cfg, seed=3)
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    proj = torch.cat([b.mlp.c_proj.weight.flatten() for b in model.blocks])
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert torch.all(model.blocks[0].ln_1.weight == 1) and torch.all(model.blocks[0].attn.c_attn.bias == 0)
    # different parameters of the same shape get different draws
    assert not torch.equal(model.blocks[0].attn.c_proj.weight, model.blocks[1].attn.c_proj.weight)


def test_attention_is_causal():
    run = tiny(1)
    model = build_gpt(run)
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    torch.testing.assert_close(model(idx)[:, :10], model(changed)[:, :10])


def test_loss_at_init_is_near_uniform():
    run = tiny(1)
    stage = build_stage(run, 0)
    idx = torch.randint(0, 256, (4, 16))
    loss = stage.loss(stage(idx), idx)
    assert loss.item() == pytest.approx(math.log(256), abs=0.1)


def test_bad_stage_index():
    with pytest.raises(ValueError, match="stage must be in"):
        build_stage(tiny(2), 2)
