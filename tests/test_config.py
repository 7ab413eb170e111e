"""Run config: strict loading, a stable run id, and the stage partition."""

from __future__ import annotations

import tomllib

import pytest

from trainer.config import RunConfig, stage_layer_ranges


def test_default_run_loads_and_round_trips_through_toml():
    run = RunConfig.default()
    again = RunConfig.from_dict(tomllib.loads(run.to_toml()))
    assert again == run
    assert again.run_id == run.run_id
    assert len(run.run_id) == 16


def test_run_id_changes_with_any_setting():
    run = RunConfig.default()
    assert run.replace(optim={"lr": run.optim.lr * 2}).run_id != run.run_id
    assert run.replace(averaging={"fraction": 0.1}).run_id != run.run_id
    assert run.replace(seed=run.seed + 1).run_id != run.run_id


def test_unknown_keys_are_refused_with_their_name(tmp_path):
    with pytest.raises(ValueError, match="lrr"):
        RunConfig.from_dict({"optim": {"lrr": 1.0}})
    with pytest.raises(ValueError, match="stagez"):
        RunConfig.from_dict({"stagez": 3})
    bad = tmp_path / "bad.toml"
    bad.write_text("n_stages = [")
    with pytest.raises(ValueError, match="not valid TOML"):
        RunConfig.from_toml(bad)
    with pytest.raises(ValueError, match="cannot read run file"):
        RunConfig.from_toml(tmp_path / "missing.toml")


@pytest.mark.parametrize(
    "section, values, message",
    [
        ("model", {"n_embd": 130, "n_head": 4}, "divisible"),
        ("optim", {"optimizer": "sgd"}, "optimizer"),
        ("averaging", {"fraction": 0.0}, "fraction"),
        ("averaging", {"rule": "mean"}, "rule"),
        ("compression", {"activations": "int2"}, "activations"),
        ("compression", {"averaging": "topk:0.1"}, "not deltas"),
        ("averaging", {"round_steps": 0}, "round_steps"),
        ("averaging", {"period_s": 0.0}, "period_s"),
        ("data", {"batch_size": 0}, "batch_size"),
        ("model", {"vocab_size": "32000"}, r"model.vocab_size must be an integer, got '32000' \(str\).*quotes"),
        ("model", {"n_layer": 2.5}, "model.n_layer must be an integer"),
        ("optim", {"lr": "1e-3"}, "optim.lr must be a number"),
        ("data", {"batch_size": True}, "data.batch_size must be an integer"),
        ("data", {"bin_vocab_size": 128256}, "at most 65536"),
    ],
)
def test_invalid_values_say_what_is_wrong(section, values, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.from_dict({section: values})


def test_wrong_kinds_are_refused_by_replace_too_and_byte_level_documents_need_the_bytes(tmp_path):
    with pytest.raises(ValueError, match="model.vocab_size must be an integer"):
        RunConfig.default().replace(model={"vocab_size": "300"})
    assert RunConfig.default().replace(optim={"lr": 1}).optim.lr == 1  # an integer is a number
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="at least 256"):
        RunConfig.default().replace(model={"vocab_size": 128}, data={"source": str(docs)})


def test_partitions_count_is_ceil_of_inverse_fraction():
    assert RunConfig.from_dict({"averaging": {"fraction": 0.05}}).averaging.n_partitions == 20
    assert RunConfig.from_dict({"averaging": {"fraction": 0.3}}).averaging.n_partitions == 4
    assert RunConfig.from_dict({"averaging": {"fraction": 1.0}}).averaging.n_partitions == 1
    batched = RunConfig.from_dict({"averaging": {"fraction": 0.05, "round_steps": 10}}).averaging
    assert batched.round_fraction == pytest.approx(0.5) and batched.n_partitions == 2
    assert RunConfig.from_dict({"averaging": {"fraction": 0.3, "round_steps": 5}}).averaging.round_fraction == 1.0
    for gone in ("every_steps", "delay_steps"):  # the cadence is round_steps; the delay is measured, not set
        with pytest.raises(ValueError, match="unknown key"):
            RunConfig.from_dict({"averaging": {gone: 1}})


def test_stage_ranges_cover_all_layers_and_first_stages_take_the_remainder():
    run = RunConfig.from_dict({"n_stages": 3, "model": {"n_layer": 8}})
    assert stage_layer_ranges(run) == [(0, 3), (3, 6), (6, 8)]
    run = RunConfig.from_dict({"n_stages": 4, "model": {"n_layer": 4}})
    assert stage_layer_ranges(run) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    explicit = RunConfig.from_dict({"n_stages": 2, "layers_per_stage": [3, 1], "model": {"n_layer": 4}})
    assert stage_layer_ranges(explicit) == [(0, 3), (3, 4)]


def test_bad_stage_splits_are_refused():
    with pytest.raises(ValueError, match="sum to"):
        RunConfig.from_dict({"n_stages": 2, "layers_per_stage": [1, 1], "model": {"n_layer": 4}})
    with pytest.raises(ValueError, match="middle stage"):
        RunConfig.from_dict({"n_stages": 3, "layers_per_stage": [2, 0, 2], "model": {"n_layer": 4}})
    with pytest.raises(ValueError, match="cannot split"):
        RunConfig.from_dict({"n_stages": 8, "model": {"n_layer": 2}})
