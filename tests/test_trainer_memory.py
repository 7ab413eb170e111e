"""The memory estimate (trainer/memory.py) and `asyncmesh-peer memory`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from peer.cli import main as cli_main
from trainer.config import RunConfig
from trainer.memory import HEADROOM, PRECISIONS, backward_peak, estimate_run, estimate_stage, fits
from trainer.model import build_stage
from trainer.worker import StageWorker

TINY = RunConfig.from_dict({
    "n_stages": 3, "model": {"n_layer": 3, "n_embd": 32, "n_head": 2, "block_size": 16, "vocab_size": 64},
    "data": {"batch_size": 2}})


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_parameters_and_fp32_state_are_counted_from_the_stage_module(stage):
    real = build_stage(TINY, stage)
    n = sum(p.numel() for p in real.parameters())
    e = estimate_stage(TINY, stage)
    assert e.params == n
    assert e.weights == 4 * n  # no buffers in the GPT
    assert e.grads == 4 * n
    assert e.optimizer == 2 * 4 * n  # NAdam: two moments per weight, measured by stepping it
    assert estimate_stage(TINY.replace(optim={"optimizer": "adamw"}), stage).optimizer == 2 * 4 * n


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_subspace_stage_counts_the_moments_its_optimiser_keeps(stage):
    """A constrained stage steps its writers and tables as coordinates: the estimate is the state a real worker
    holds after a step (the last stage is not constrained)."""
    run = TINY.replace(compression={"activations": "subspace", "gradients": "subspace", "subspace_rank": 4})
    w = StageWorker(run, stage)
    w.set_grads([torch.ones_like(p) for p in w.parameters()])
    w.optimizer_step()
    held = sum(v.numel() * v.element_size() for entry in w.optimizer.state.values() for v in entry.values()
               if isinstance(v, torch.Tensor) and v.dim())
    e = estimate_stage(run, stage)
    assert e.optimizer == held
    assert (e.optimizer < estimate_stage(TINY, stage).optimizer) == (stage < 2)
    # the basis, the fixed tables where the worker holds them (stage 0), the coordinates and their gradients
    ss, coords = w.subspace, w._coords
    tensors = [ss.u, ss.tok_table, ss.pos_table] + ([] if coords is None else [c for *_, c in coords.slots])
    w.set_grads([torch.ones_like(p) for p in w.parameters()])
    if coords is not None:
        coords.gather()  # what a step holds: each coordinate tensor and its gradient
        tensors += [c.grad for *_, c in coords.slots]
    assert e.subspace == sum(t.numel() * t.element_size() for t in tensors if t is not None)
    assert (ss.tok_table.numel() > 0) == (stage == 0) and estimate_stage(TINY, stage).subspace == 0
    wire = 4 * (ss.u.numel() + (run.model.vocab_size + run.model.block_size) * run.model.n_embd)
    assert e.host - estimate_stage(TINY, stage).host == wire  # the wire side's own copy, with the tables


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_fake_tensor_measure_equals_the_real_backward(stage, precision):
    """The backward's peak, measured on fake tensors, is what the same backward allocates on real ones."""
    module = build_stage(TINY, stage)
    tensors = {n: p for n, p in module.named_parameters()}
    b, t, c = TINY.data.batch_size, TINY.model.block_size, TINY.model.n_embd
    x = torch.randint(0, 64, (b, t)) if stage == 0 else torch.randn(b, t, c, requires_grad=True)
    targets = torch.randint(0, 64, (b, t)) if stage == 2 else None
    grad_out = None if stage == 2 else torch.randn(b, t, c)
    real = backward_peak(module, tensors, x, targets, grad_out, precision=precision)
    n = sum(p.numel() for p in module.parameters())
    assert real > 4 * n  # at least the weights' gradients
    e = estimate_stage(TINY, stage, precision=precision)
    assert e.backward == real + (0 if stage == 2 else b * t * c * 4)


def test_the_peak_counts_what_is_alive_together():
    """Ten activations kept for the backward count ten times; without autograd they would not be kept."""
    lin = torch.nn.Linear(512, 512, bias=False)
    x = torch.randn(4, 320, 512, requires_grad=True)  # 2.5 MiB in fp32

    class Chain(torch.nn.Module):
        def forward(self, x):
            for _ in range(10):
                x = torch.tanh(x)
            return lin(x)

    peak = backward_peak(Chain(), {"w": lin.weight}, x, None, torch.randn(4, 320, 512), precision="fp32")
    mib = 4 * 320 * 512 * 4
    assert 11 * mib <= peak <= 14 * mib  # ten tanh outputs saved, the output, then gradients as they are freed
    with torch.no_grad():
        x.requires_grad_(False)
    assert backward_peak(Chain(), {"w": lin.weight}, x, None, torch.randn(4, 320, 512), precision="fp32") <= 4 * mib


def test_bf16_keeps_fp32_master_state_and_saves_less_for_the_backward():
    for s in range(TINY.n_stages):
        f, h = estimate_stage(TINY, s, precision="fp32"), estimate_stage(TINY, s, precision="bf16")
        assert (f.weights, f.grads, f.optimizer, f.stash, f.averaging) == \
               (h.weights, h.grads, h.optimizer, h.stash, h.averaging)
        assert h.backward < f.backward


def test_stash_and_inputs_follow_the_micro_batches_in_flight():
    run = TINY
    e3, e6 = estimate_stage(run, 1, inflight=3), estimate_stage(run, 1, inflight=6)
    assert e3.stash == 3 * e3.weights and e6.stash == 6 * e6.weights
    assert e6.inputs == 2 * e3.inputs == 6 * 2 * 16 * 32 * 4
    assert estimate_stage(run, 0, inflight=3).inputs == 3 * 2 * 16 * 8  # token ids
    last = estimate_stage(run, 2, inflight=6)
    assert last.stash == 0 and last.inputs == 0  # forward and backward at once
    assert estimate_stage(run.replace(optim={"weight_stashing": False}), 1).stash == 0
    assert estimate_stage(run, 1).inflight == run.n_stages + 1


def test_averaging_state_per_rule():
    none = estimate_stage(TINY.replace(averaging={"rule": "none"}), 1)
    assert none.averaging == 0 and none.host == 0
    ema = estimate_stage(TINY, 1)
    avg = estimate_stage(TINY.replace(averaging={"rule": "avg"}), 1)
    assert ema.averaging > avg.averaging + ema.weights - 1  # the EMA buffer and the drift snapshots
    assert ema.host == 2 * ema.params * 2  # two cycles of uint16 partition ids


def test_averaging_state_follows_what_the_rule_declares(monkeypatch):
    """The estimate asks the rule object (trainer/rules.py), not its name: a rule that declares an EMA buffer is
    charged one, and a whole-tensor rule needs no partition cache."""
    import dataclasses

    from trainer import rules

    delta = estimate_stage(TINY.replace(averaging={"rule": "delta"}), 1)
    monkeypatch.setitem(rules.RULES, "delta", dataclasses.replace(rules.RULES["delta"], ema=True))
    assert estimate_stage(TINY.replace(averaging={"rule": "delta"}), 1).averaging == delta.averaging + delta.weights
    full = estimate_stage(TINY.replace(averaging={"rule": "full"}), 1)
    assert full.host == 0 and full.averaging >= full.params * 8  # whole tensors: no partition ids, p = 1 per round


def test_fits_keeps_headroom_and_counts_host_memory_on_the_cpu_only():
    e = estimate_stage(TINY, 1)
    need = e.device_bytes
    assert fits(e, int(need * HEADROOM) + 1, "cuda")
    assert not fits(e, need, "cuda")
    assert not fits(e, int(need * HEADROOM) + 1, "cpu")  # the CPU holds the host-only part too
    assert fits(e, int(e.total_bytes * HEADROOM) + 1, "cpu")


def test_bad_arguments():
    with pytest.raises(ValueError, match="precision"):
        estimate_stage(TINY, 0, precision="fp16")
    with pytest.raises(ValueError, match="stage"):
        estimate_stage(TINY, 3)
    with pytest.raises(ValueError, match="inflight"):
        estimate_stage(TINY, 0, inflight=0)


def test_memory_command_prints_every_stage_in_both_precisions(capsys, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(TINY.to_toml())
    assert cli_main(["memory", "--run", str(path), "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "3 stages" in lines[0] and "4 micro-batches in flight" in lines[0]
    rows = [line.split() for line in lines[2:]]
    assert [(r[0], r[1]) for r in rows[:-1]] == [(str(s), p) for s in range(3) for p in PRECISIONS]
    assert lines[-1].startswith("this machine (cpu, fp32): may use") and "it can serve stages 0, 1, 2" in lines[-1]
    assert cli_main(["memory", "--run", str(path), "--device", "cpu", "--memory-gb", "0.0001"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("it can serve no stage")
    assert cli_main(["memory", "--run", str(path), "--json", "--inflight", "5", "--device", "cpu"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["inflight"] == 5
    assert doc["stages"] == [e.as_dict() for e in estimate_run(TINY, inflight=5)]
    assert doc["here"]["precision"] == "fp32" and doc["here"]["fits"] == [0, 1, 2]
    w = [e["weights"] for e in doc["stages"][::2]]  # the re-checks' held copies: next stage's, and stage 0's at 1
    assert doc["copies_bytes"] == [w[1], w[2] + w[0], 0]
    assert rows[0][-1] != "0.0" and rows[-2][-1] == "0.0"  # the table's copies column: stage 0 holds one, 2 none


def test_memory_command_errors_are_one_line(capsys, tmp_path):
    assert cli_main(["memory", "--run", str(tmp_path / "missing.toml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncmesh-peer memory: error:") and "cannot read run file" in err


RUNS_DIR = Path(__file__).resolve().parent.parent / "trainer" / "runs"
LINE = re.compile(r"^#\s+stage (\d+) needs ([\d.]+ [GM]iB) / ([\d.]+ [GM]iB)$", re.M)


def documented(b: int) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


@pytest.mark.parametrize("name", ["llama-tiny", pytest.param("llama-small", marks=pytest.mark.slow),
                                  pytest.param("llama-125m", marks=pytest.mark.slow),
                                  pytest.param("llama-1b", marks=pytest.mark.slow)])
def test_the_memory_the_run_files_document_is_the_estimate(name):
    """Any architecture the stage builder returns is estimated (here the Llama stages), and the run files' comments
    say what `asyncmesh-peer memory` says."""
    path = RUNS_DIR / f"{name}.toml"
    run = RunConfig.from_toml(path)
    lines = LINE.findall(path.read_text())
    assert [int(s) for s, _, _ in lines] == list(range(run.n_stages))
    for s, fp32, bf16 in lines:
        got = [documented(estimate_stage(run, int(s), precision=p).device_bytes) for p in PRECISIONS]
        assert got == [fp32, bf16], (name, s)
