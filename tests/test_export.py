"""From swarm to model: export the stages' checkpoints into one safetensors model, load it in plain PyTorch, sample."""

from __future__ import annotations

import json
import math
import signal

import pytest
import torch
from swarm_utils import TINY_RUN, swarm  # noqa: F401  (fixture)

from peer.cli import main
from trainer.config import RunConfig
from trainer.export import gpt_state, load_model, sample, save_model
from trainer.model import build_gpt, build_stage


def test_the_seeded_stages_assemble_into_the_seeded_gpt(tmp_path):
    run = RunConfig.from_toml(TINY_RUN)
    stages = {s: build_stage(run, s).state_dict() for s in range(run.n_stages)}
    state = gpt_state(run, stages)
    reference = build_gpt(run).state_dict()
    assert set(state) == set(reference)
    for k, v in reference.items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=0)
    with pytest.raises(ValueError, match="stage"):
        gpt_state(run, {0: stages[0]})
    model, config = load_model(save_model(tmp_path / "m", run, state))
    assert config["run_id"] == run.run_id and config["tokenizer"] == "bytes"
    x = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(model(x), build_gpt(run).eval()(x))
    out = sample(model, [1, 2, 3], 5, temperature=0)
    assert out[:3] == [1, 2, 3] and len(out) == 8 and out == sample(model, [1, 2, 3], 5, temperature=0)


@pytest.mark.timeout(240)
def test_train_a_two_stage_swarm_export_load_in_plain_pytorch_and_generate(swarm, tmp_path, capsys):  # noqa: F811
    a = swarm.start("a", stage="0", max_steps=20)
    b = swarm.start("b", stage="1", initial=a.wait_maddrs()[:1], max_steps=20)
    assert a.wait_exit(180) == 0
    assert b.wait_exit(60) == 0
    out = tmp_path / "model"
    assert main(["export", "--run", str(TINY_RUN), "--checkpoint-dir", str(a.dir / "ckpt"), str(b.dir / "ckpt"),
                 "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    # the documented lines of plain PyTorch
    from safetensors.torch import load_file

    from trainer.config import ModelConfig
    from trainer.model import GPT

    config = json.load(open(out / "config.json"))
    model = GPT(ModelConfig(**config["model"]))
    model.load_state_dict(load_file(out / "model.safetensors"))
    model.eval()
    # the exported model is exactly the trained stages, chained
    run = RunConfig.from_toml(TINY_RUN)
    chain = []
    for stage, peer in ((0, a), (1, b)):
        m = build_stage(run, stage)
        m.load_state_dict(torch.load(peer.dir / "ckpt" / f"stage-{stage}.pt", weights_only=True)["state"]["model"])
        chain.append(m.eval())
    x = torch.tensor([list(b"def main():\n    return 0\n")])
    with torch.no_grad():
        torch.testing.assert_close(model(x), chain[1](chain[0](x)))
        trained_loss = build_stage(run, 1).loss(model(x[:, :-1]), x[:, 1:])
        init_loss = build_stage(run, 1).loss(build_gpt(run)(x[:, :-1]), x[:, 1:])
    assert trained_loss < init_loss  # 20 steps moved the weights towards the corpus
    assert config["sources"]["stage 0"]["step"] >= 20
    assert main(["generate", "--model", str(out), "--prompt", "def ", "--max-new-tokens", "20", "--seed", "1",
                 "--temperature", "0.8"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("def ") and len(text.encode("utf-8", errors="replace")) >= 4 + 1


def test_export_and_generate_refuse_bad_input_in_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["export", "--run", str(TINY_RUN), "--checkpoint-dir", str(tmp_path / "empty"), "--out",
                 str(tmp_path / "m")]) == 2
    assert "no checkpoint of stage(s) [0, 1]" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path / "nothing"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and len(err.strip().splitlines()) == 1


@pytest.mark.timeout(240)
def test_export_fetches_every_stage_live_from_a_running_swarm(swarm, tmp_path, capsys):  # noqa: F811
    a = swarm.start("a", stage="0")
    b = swarm.start("b", stage="1", initial=a.wait_maddrs()[:1])
    for p in (a, b):
        p.wait_status(lambda s: s.get("state") == "training" and s.get("local_step", 0) >= 15, 150, "15 steps")
    # the swarm has learnt before the export: early on (a few dozen steps) a byte model can be worse than its init on
    # a given text, and stage 1, fetched after stage 0, may be many steps ahead of it (the stages move meanwhile)
    a.wait_status(lambda s: (s.get("val_loss") or math.inf) < math.log(256) - 1.0, 150, "a val loss below init - 1")
    ids = {p.status()["peer_id"]: p.name for p in (a, b)}
    out = tmp_path / "live"
    assert main(["export", "--run", str(TINY_RUN), "--initial-peers", *b.wait_maddrs()[:1], "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    config = json.load(open(out / "config.json"))
    for stage, name in ((0, "a"), (1, "b")):  # each stage came from the peer serving it, at a trained step
        src = config["sources"][f"stage {stage}"]
        assert ids[src["peer"]] == name and src["step"] >= 15, config["sources"]
    model, _ = load_model(out)
    run = RunConfig.from_toml(TINY_RUN)
    x = torch.tensor([list(b"def main():\n    return 0\n")])
    with torch.no_grad():
        trained = build_stage(run, 1).loss(model(x[:, :-1]), x[:, 1:])
        init = build_stage(run, 1).loss(build_gpt(run)(x[:, :-1]), x[:, 1:])
    assert trained < init
    for p in (a, b):
        p.signal(signal.SIGTERM)
        assert p.wait_exit(30) == 0
