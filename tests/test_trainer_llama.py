"""The Llama-style model: stages chain to the whole model, it is transformers' LlamaForCausalLM to the bit, its
config is checked, and every update rule, averaging rule, the simulator and the state codec work on it."""

from __future__ import annotations

import pytest
import torch

from peer.state.codec import StateAssembler, check_against_reference, flatten_state, plan_pieces
from trainer.config import ARCHITECTURES, ModelConfig, RunConfig
from trainer.model import build_model, build_stage
from trainer.worker import StageWorker


def llama(n_stages: int = 2, **kw) -> RunConfig:
    model = {"arch": "llama", "n_layer": 3, "n_embd": 32, "n_head": 4, "n_kv_head": 2, "block_size": 16,
             "vocab_size": 256, **kw.pop("model", {})}
    optim = {"warmup_steps": 0, "total_steps": 100, **kw.pop("optim", {})}
    return RunConfig.default().replace(n_stages=n_stages, model=model, optim=optim, **kw)


def hf_llama(cfg: ModelConfig):
    transformers = pytest.importorskip("transformers")
    hc = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.mlp_width,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.block_size, rms_norm_eps=cfg.rms_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings)
    return transformers.LlamaForCausalLM(hc).eval()


@pytest.mark.parametrize("n_stages,split", [(1, ()), (2, ()), (3, (1, 2, 0)), (4, (0, 2, 1, 0))])
def test_chained_stages_equal_the_whole_model(n_stages, split):
    run = llama(n_stages, layers_per_stage=split)
    full = build_model(run.model, run.seed)
    idx = torch.randint(0, 256, (2, 16))
    h = idx
    for s in range(n_stages):
        h = build_stage(run, s)(h)
    torch.testing.assert_close(h, full(idx), rtol=0, atol=0)


@pytest.mark.parametrize("kw", [{}, {"n_kv_head": 1, "rope_theta": 5e5, "rms_eps": 1e-6, "intermediate_size": 80},
                                {"n_kv_head": 4, "tie_embeddings": True}])
def test_state_dict_is_a_transformers_llama_with_the_same_logits(kw):
    run = llama(1, model=kw)
    ours = build_model(run.model, seed=3).eval()
    theirs = hf_llama(run.model)
    theirs.load_state_dict(ours.state_dict(), strict=True)  # names and shapes 1:1
    idx = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(theirs(idx).logits, ours(idx), rtol=0, atol=1e-5)
    if run.model.tie_embeddings:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_names_init_and_causality():
    run = llama(2)
    first, last = build_stage(run, 0), build_stage(run, 1)
    assert [n for n, _ in first.named_parameters()][:3] == [
        "model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.weight"]
    assert "lm_head.weight" in dict(last.named_parameters()) and "model.norm.weight" in dict(last.named_parameters())
    assert not any(n.endswith("bias") for n, _ in last.named_parameters())
    assert first.model.layers[0].self_attn.k_proj.weight.shape == (16, 32)  # 2 kv heads of 8
    assert torch.all(last.model.norm.weight == 1)
    full = build_model(run.model)
    assert "cos" not in full.state_dict()  # rotary tables are buffers, not weights
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, 9:] = (changed[0, 9:] + 1) % 256
    torch.testing.assert_close(full(idx)[:, :9], full(changed)[:, :9])


@pytest.mark.parametrize("model,match", [
    ({"n_kv_head": 3}, "multiple of model.n_kv_head"),
    ({"arch": "mamba"}, "model.arch must be one of"),
    ({"n_embd": 36, "n_head": 12, "n_kv_head": 0}, "even head size"),
    ({"arch": "gpt", "n_kv_head": 2}, "setting of arch 'llama'"),
    ({"rms_eps": 0.0}, "must be positive"),
])
def test_config_errors(model, match):
    with pytest.raises(ValueError, match=match):
        llama(2, model=model)


def test_tied_embeddings_need_one_stage_and_new_fields_change_the_run_id():
    with pytest.raises(ValueError, match="n_stages = 1"):
        llama(2, model={"tie_embeddings": True})
    base = llama(2)
    ids = {base.run_id, llama(2, model={"n_kv_head": 4}).run_id, llama(2, model={"rope_theta": 5e5}).run_id,
           llama(2, model={"arch": "gpt", "n_kv_head": 0}).run_id}
    assert len(ids) == 4
    import tomllib

    assert RunConfig.from_dict(tomllib.loads(base.to_toml())).run_id == base.run_id
    assert set(ARCHITECTURES) == {"gpt", "llama"}


def test_gpt_run_ids_leave_the_llama_fields_out():
    d = RunConfig.default().to_dict()["model"]
    assert set(d) == {"n_layer", "n_embd", "n_head", "block_size", "vocab_size", "dropout"}


def _pipeline(workers, mb, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g)
    h = x
    for w in workers[:-1]:
        h = w.forward(mb, h)
    loss, grad = workers[-1].forward_loss(mb, h, y)
    for w in reversed(workers[:-1]):
        grad = w.backward(mb, grad)
    return loss


def test_pipeline_gradients_equal_the_whole_model():
    run = llama(3, layers_per_stage=(0, 2, 1))
    workers = [StageWorker(run, s, auto_step=False) for s in range(3)]
    full = build_model(run.model, run.seed)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g)
    loss = _pipeline(workers, 0)
    ref = torch.nn.functional.cross_entropy(full(x).reshape(-1, 256), y.reshape(-1))
    ref.backward()
    assert loss == pytest.approx(ref.item(), abs=1e-6)
    for a, b in zip([g for w in workers for g in w.grads()], [p.grad for p in full.parameters()], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rule", ["ema", "delta", "avg", "wagma", "none"])
def test_workers_train_and_average_with_each_rule(rule):
    run = llama(2, averaging={"rule": rule, "fraction": 0.5}, optim={"lr": 3e-3})
    reps = [[StageWorker(run, s) for s in range(2)] for _ in range(2)]
    first = [_pipeline(ws, 0) for ws in reps]
    for mb in range(1, 13):
        for ws in reps:
            _pipeline(ws, mb, seed=mb % 3)
        if rule != "none" and mb % 4 == 0:
            for s in range(2):
                parts = [reps[r][s].averaging_begin(mb) for r in range(2)]
                mean = [(a + b) / 2 for a, b in zip(*parts, strict=True)]
                for r in range(2):
                    reps[r][s].averaging_finish(mb, mean)
    last = [_pipeline(ws, 99) for ws in reps]
    assert all(torch.isfinite(torch.tensor(last))) and sum(last) < sum(first)


def test_state_codec_round_trip_loads_into_a_fresh_worker():
    run = llama(2, averaging={"rule": "ema", "fraction": 0.5})
    a = [StageWorker(run, s) for s in range(2)]
    for mb in range(4):
        _pipeline(a, mb)
    for s, src in enumerate(a):
        state = src.state_dict()
        skeleton, tensors = flatten_state(state)
        plan = plan_pieces(tensors, 4096)
        builder = StateAssembler(skeleton, plan.piece_bytes, 2**30)
        for chunk in plan.chunks:
            for idx, offset, length in chunk:
                builder.put(idx, offset, tensors[idx].reshape(-1)[offset:offset + length].clone())
        got = builder.finish()
        dst = StageWorker(run, s)
        check_against_reference(got, dst.state_dict())
        dst.load_state_dict(got)
        assert dst.version == src.version
        assert all(torch.equal(p, q) for p, q in zip(dst.parameters(), src.parameters(), strict=True))


@pytest.mark.parametrize("method", ["asyncmesh", "delta", "async-sparta", "wagma", "fullsync"])
def test_simulator_trains_llama_tiny_with_each_method(method):
    from trainer.sim.simulator import SimConfig, run_method

    run = RunConfig.from_toml("trainer/runs/llama-tiny.toml").replace(data={"max_bytes": 100_000, "batch_size": 4})
    sim = SimConfig(run=run, n_replicas=2, steps=24, micro_batches=4, tau=2, eval_every=24, eval_batches=2,
                    methods=(method,))
    out = run_method(sim, method, method, sim.tau)
    assert out["final_val_loss"] < 5.0 and out["steps_skipped"] == 0  # learning: uniform over bytes is 5.55
    if method != "fullsync":
        assert out["averaging_rounds_applied"] > 0


def test_tied_head_trains_as_one_tensor_and_exports_once(tmp_path):
    from trainer.export import gpt_state, load_model, save_model

    run = llama(1, model={"tie_embeddings": True}, averaging={"rule": "ema", "fraction": 0.5})
    w = StageWorker(run, 0)
    assert len(w.parameters()) == len(list(w.model.parameters()))  # the head is not a parameter of its own
    for mb in range(3):
        _pipeline([w], mb)
    assert w.model.lm_head.weight is w.model.model.embed_tokens.weight
    copy = StageWorker(run, 0)
    copy.load_state_dict(w.state_dict())
    assert torch.equal(copy.model.lm_head.weight, w.model.model.embed_tokens.weight)
    assert copy.model.lm_head.weight is copy.model.model.embed_tokens.weight
    state = gpt_state(run, {0: w.model.state_dict()})
    assert "lm_head.weight" not in state
    model, _ = load_model(save_model(tmp_path / "m", run, state))
    x = torch.randint(0, 256, (1, 16))
    torch.testing.assert_close(model(x), w.model.eval()(x))


def test_simulate_takes_the_architecture():
    from peer.cli import build_parser
    from peer.cli.simulate import build_config

    sim = build_config(build_parser().parse_args(["simulate", "--out", "/tmp/x", "--arch", "llama"]))
    assert sim.run.model.arch == "llama" and sim.run.model.kv_heads == sim.run.model.n_head
    assert build_config(build_parser().parse_args(["simulate", "--out", "/tmp/x"])).run.model.arch == "gpt"
