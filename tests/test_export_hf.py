"""The Hugging Face export: transformers loads the folder (LlamaForCausalLM for llama runs, GPT2LMHeadModel for gpt
runs) with the swarm model's logits, AutoTokenizer encodes text to the swarm's byte ids, a run's own tokenizer.json
is copied, the upload goes through huggingface_hub, generate reads the folder, and an error leaves nothing behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from swarm_utils import swarm  # noqa: F401  (fixture)

from peer.cli import main
from peer.state.checkpoint import save_checkpoint
from trainer.config import RunConfig
from trainer.worker import StageWorker

transformers = pytest.importorskip("transformers")
TEXT = "def f(x):\n    return x + 'é'\n"


def _run(arch: str, n_stages: int = 2, **model) -> RunConfig:
    shape = {"arch": arch, "n_layer": 3, "n_embd": 32, "n_head": 4, "block_size": 32, "vocab_size": 256, **model}
    split = (2, 1) if n_stages == 2 else ()
    return RunConfig.default().replace(n_stages=n_stages, layers_per_stage=split, model=shape,
                                       optim={"warmup_steps": 0, "lr": 1e-2})


def _trained_checkpoints(run: RunConfig, folder: Path, steps: int = 3) -> list[StageWorker]:
    """A few optimiser steps (so the weights are not the init), each stage checkpointed in its own folder."""
    workers = [StageWorker(run, s) for s in range(run.n_stages)]
    g = torch.Generator().manual_seed(1)
    for mb in range(steps):
        x, y = torch.randint(0, 256, (2, 32), generator=g), torch.randint(0, 256, (2, 32), generator=g)
        h = workers[0].forward(mb, x)
        _, grad = workers[1].forward_loss(mb, h, y)
        workers[0].backward(mb, grad)
    with torch.no_grad():  # weights far from the init, so that every nonlinearity's exact form shows in the logits
        for p in (p for w in workers for p in w.parameters()):
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    for s, w in enumerate(workers):
        save_checkpoint(folder / f"peer{s}", run, s, w.state_dict())
    return workers


def _swarm_logits(workers: list[StageWorker], ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        h = ids
        for w in workers:
            h = w.model.eval()(h)
    return h


@pytest.mark.parametrize("arch,model,cls", [("llama", {"n_kv_head": 2}, "LlamaForCausalLM"),
                                            ("gpt", {}, "GPT2LMHeadModel")])
def test_transformers_loads_the_export_with_the_swarm_s_logits_and_tokens(tmp_path, capsys, arch, model, cls):
    run = _run(arch, **model)
    (tmp_path / "run.toml").write_text(run.to_toml())
    workers = _trained_checkpoints(run, tmp_path)
    out = tmp_path / "hf"
    assert main(["export", "--run", str(tmp_path / "run.toml"), "--checkpoint-dir", str(tmp_path / "peer0"),
                 str(tmp_path / "peer1"), "--format", "hf", "--out", str(out)]) == 0
    assert "Hugging Face folder" in capsys.readouterr().out
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert type(hf).__name__ == cls
    ids = tok(TEXT)["input_ids"]
    assert ids == list(TEXT.encode()) and tok.decode(ids) == TEXT  # the swarm's byte ids, both ways
    x = torch.tensor([ids])
    with torch.no_grad():
        theirs = hf.eval()(x).logits
    torch.testing.assert_close(theirs, _swarm_logits(workers, x), rtol=0, atol=1e-4)
    assert theirs.std() > 1  # logits far from uniform: the comparison means something
    meta = json.loads((out / "asyncmesh.json").read_text())
    assert meta["run_id"] == run.run_id and meta["sources"]["stage 1"]["step"] == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial folder left

    assert main(["generate", "--model", str(out), "--prompt", "def", "--max-new-tokens", "5",
                 "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("def")
    greedy = hf.generate(torch.tensor([list(b"def")]), max_new_tokens=5, do_sample=False)
    assert printed.rstrip("\n") == tok.decode(greedy[0])


def test_a_run_s_tokenizer_json_is_copied_and_an_upload_goes_through_the_hub(tmp_path, monkeypatch, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    run = _run("llama", vocab_size=300).replace(data={"source": "tokens", "bin_vocab_size": 300})
    (tmp_path / "run.toml").write_text(run.to_toml())
    _trained_checkpoints(run, tmp_path, steps=1)
    vocab = {f"w{i}": i for i in range(298)} | {"<|endoftext|>": 298, "[UNK]": 299}  # the run's data.eot_token
    words = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(tmp_path / "tokenizer.json"))
    calls = []

    class FakeApi:
        def __init__(self, token=None):
            calls.append(("token", token))

        def create_repo(self, **kw):
            calls.append(("create_repo", kw))

        def upload_folder(self, **kw):
            calls.append(("upload_folder", kw))
            assert (Path(kw["folder_path"]) / "model.safetensors").exists()
            return "https://huggingface.co/me/m/commit/abc"

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    args = ["export", "--run", str(tmp_path / "run.toml"), "--checkpoint-dir", str(tmp_path / "peer0"),
            str(tmp_path / "peer1"), "--format", "hf", "--out", str(tmp_path / "hf")]
    assert main(args) == 2  # a token-id run needs its tokenizer
    assert "--tokenizer" in capsys.readouterr().err
    assert main([*args, "--tokenizer", str(tmp_path / "tokenizer.json"), "--push-to-hub", "me/m", "--private"]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok("w5 w7")["input_ids"] == [5, 7]
    # generation stops where training joined documents: the run's end-of-text token
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 298
    assert transformers.AutoConfig.from_pretrained(tmp_path / "hf").eos_token_id == 298
    assert [c[0] for c in calls] == ["token", "create_repo", "upload_folder"]
    assert calls[1][1]["repo_id"] == "me/m" and calls[1][1]["private"] is True
    assert Path(calls[2][1]["folder_path"]) == tmp_path / "hf"
    assert "pushed" in capsys.readouterr().out


def test_an_error_leaves_no_folder_and_a_missing_extra_says_what_to_install(tmp_path, monkeypatch, capsys):
    import importlib.util

    import trainer.hf

    run = _run("llama")
    (tmp_path / "run.toml").write_text(run.to_toml())
    _trained_checkpoints(run, tmp_path, steps=1)
    args = ["export", "--run", str(tmp_path / "run.toml"), "--checkpoint-dir", str(tmp_path / "peer0"),
            str(tmp_path / "peer1"), "--format", "hf", "--out", str(tmp_path / "hf")]

    def half_then_fail(directory, *a, **kw):
        (Path(directory) / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(trainer.hf, "save_hf", half_then_fail)
    assert main(args) == 2
    assert "disk full" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["peer0", "peer1", "run.toml"]  # nothing half-written
    monkeypatch.undo()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    assert main(args) == 2
    assert "pip install 'asyncmesh[hf]'" in capsys.readouterr().err
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    monkeypatch.undo()
    assert main([*args[:-1], str(tmp_path / "mine")]) == 2  # a folder that is not an export is not replaced
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_llama_swarm_exported_for_transformers_has_the_swarm_s_validation_loss(swarm, tmp_path, capsys):  # noqa: F811
    """The user's path end to end: a 2-peer llama-tiny swarm trains, export --format hf, transformers' loss on the
    peers' own validation batches equals the final validation loss the stage-0 peer reported."""
    import torch.nn.functional as F

    from trainer.data import load_corpus, val_batches

    run_file = Path(__file__).resolve().parent.parent / "trainer" / "runs" / "llama-tiny.toml"
    a = swarm.start("a", stage="0", run=run_file, max_steps=60)
    b = swarm.start("b", stage="1", run=run_file, initial=a.wait_maddrs()[:1], max_steps=60)
    assert a.wait_exit(240) == 0 and b.wait_exit(60) == 0
    out = tmp_path / "hf"
    assert main(["export", "--run", str(run_file), "--checkpoint-dir", str(a.dir / "ckpt"), str(b.dir / "ckpt"),
                 "--format", "hf", "--out", str(out)]) == 0
    reported = json.loads((a.dir / "summary.json").read_text())["final_val_loss"]
    run = RunConfig.from_toml(run_file)
    val = val_batches(load_corpus(run.data, 256), run.model.block_size, run.data.batch_size, 2)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        loss = sum(F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()).item() for x, y in val) / len(val)
    # stage 1 may still step on the last in-flight micro-batches after stage 0's final evaluation, hence not exact
    assert reported < 5.0 and loss == pytest.approx(reported, abs=0.05)


def test_a_tied_head_exports_as_transformers_tied_llama(tmp_path):
    from trainer.export import gpt_state
    from trainer.hf import load_hf, save_hf
    from trainer.model import build_model

    run = _run("llama", n_stages=1, tie_embeddings=True)
    ours = build_model(run.model, seed=4).eval()
    save_hf(tmp_path / "hf", run, gpt_state(run, {0: ours.state_dict()}))
    model, tok, block = load_hf(tmp_path / "hf")
    assert model.config.tie_word_embeddings and block == 32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    x = torch.tensor([tok(TEXT)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, ours(x), rtol=0, atol=1e-4)
