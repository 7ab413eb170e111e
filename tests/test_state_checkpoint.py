"""Checkpoints: atomic round trip, refusal of another run's or stage's file, damaged files."""

from __future__ import annotations

import os

import pytest
import torch

from peer.state.checkpoint import CheckpointError, checkpoint_path, checkpoint_steps, load_checkpoint, save_checkpoint
from trainer.config import RunConfig


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "params": [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)],
        "optimizer": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(3, 4, generator=g)}},
                      "param_groups": [{"lr": 1e-3, "betas": (0.99, 0.999), "params": [0, 1]}]},
        "averaging": {"ema": [torch.zeros(12), torch.ones(5)], "rounds": 3},
        "local_step": 42,
    }


def _assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def test_round_trip_is_exact_and_leaves_no_temp_files(tmp_path):
    run = RunConfig.default()
    state = _state(0)
    path = save_checkpoint(tmp_path, run, 1, state)
    assert path == checkpoint_path(tmp_path, 1)
    _assert_same(state, load_checkpoint(tmp_path, run, 1))
    # overwrite with a newer state: the file is replaced (the old one kept as the previous checkpoint), not
    # appended to, and no temporary file is left behind
    newer = _state(1)
    save_checkpoint(tmp_path, run, 1, newer)
    _assert_same(newer, load_checkpoint(tmp_path, run, 1))
    assert sorted(os.listdir(tmp_path)) == ["stage-1.prev.pt", "stage-1.pt"]
    assert checkpoint_steps(tmp_path, run) == {1: 42}


def test_missing_checkpoint_is_none(tmp_path):
    assert load_checkpoint(tmp_path / "nowhere", RunConfig.default(), 0) is None


def test_checkpoint_of_another_run_is_refused_with_both_run_ids(tmp_path):
    run = RunConfig.default()
    other = run.replace(seed=run.seed + 1)
    save_checkpoint(tmp_path, other, 0, _state(0))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path, run, 0)
    assert other.run_id in str(e.value) and run.run_id in str(e.value) and "--checkpoint-dir" in str(e.value)
    assert checkpoint_steps(tmp_path, run) == {}


def test_renamed_checkpoint_of_another_stage_is_refused(tmp_path):
    run = RunConfig.default()
    save_checkpoint(tmp_path, run, 0, _state(0))
    os.replace(checkpoint_path(tmp_path, 0), checkpoint_path(tmp_path, 1))
    with pytest.raises(CheckpointError, match="holds stage 0, not stage 1"):
        load_checkpoint(tmp_path, run, 1)


def test_damaged_or_foreign_file_is_refused(tmp_path):
    run = RunConfig.default()
    checkpoint_path(tmp_path, 0).write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        load_checkpoint(tmp_path, run, 0)
    torch.save({"weights": torch.zeros(2)}, checkpoint_path(tmp_path, 1))
    with pytest.raises(CheckpointError, match="not an asyncmesh checkpoint"):
        load_checkpoint(tmp_path, run, 1)


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    run = RunConfig.default()
    save_checkpoint(tmp_path, run, 0, _state(0))

    def broken_save(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, run, 0, _state(1))
    monkeypatch.undo()
    _assert_same(_state(0), load_checkpoint(tmp_path, run, 0))
    assert sorted(os.listdir(tmp_path)) == ["stage-0.pt"]


def test_a_restarted_worker_resumes_from_its_checkpoint_exactly(tmp_path):
    from trainer.worker import StageWorker

    run = RunConfig.default()
    torch.manual_seed(0)
    worker = StageWorker(run, 1)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        worker.set_grads([torch.randn(p.shape, generator=g) for p in worker.parameters()])
        worker.optimizer_step()
    save_checkpoint(tmp_path, run, 1, worker.state_dict())
    restarted = StageWorker(run, 1)  # the seeded init, as after a restart
    restarted.load_state_dict(load_checkpoint(tmp_path, run, 1))
    assert restarted.local_step == 2
    for name, t in worker.state_dict()["model"].items():
        assert torch.equal(t, restarted.state_dict()["model"][name])
    # both take the same next step: optimiser state came back too, not only the weights
    grads = [torch.randn(p.shape, generator=g) for p in worker.parameters()]
    for w in (worker, restarted):
        w.set_grads([x.clone() for x in grads])
        w.optimizer_step()
    for p, q in zip(worker.parameters(), restarted.parameters(), strict=True):
        assert torch.equal(p, q)
