"""The wire form of state sync: exact round trip through pieces, and refusal of every malformed piece or skeleton."""

from __future__ import annotations

import json

import pytest
import torch

from peer.state.codec import (
    StateAssembler,
    StateFormatError,
    check_against_reference,
    flatten_state,
    plan_pieces,
)


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "format": 1, "run_id": "abc", "stage": 1,
        "model": {"w": torch.randn(40, 30, generator=g), "b": torch.zeros(30), "scalar": torch.tensor(2.5)},
        "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(40, 30, generator=g)}},
                      "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1, 2], "foreach": None,
                                        "eps": float("inf")}]},
        "averaging": {"ema": [torch.randn(1200, generator=g)]},
        "ints": torch.arange(7, dtype=torch.int64), "empty": torch.zeros(0), "local_step": 5, "grads": None,
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _transfer(state, chunk_bytes=1024, limit=2**30):
    skeleton, tensors = flatten_state(state)
    plan = plan_pieces(tensors, chunk_bytes)
    builder = StateAssembler(skeleton, plan.piece_bytes, limit)
    for chunk in plan.chunks:
        used = sum(length * tensors[i].element_size() for i, _, length in chunk)
        assert used <= chunk_bytes
        for idx, offset, length in chunk:
            builder.put(idx, offset, tensors[idx].reshape(-1)[offset:offset + length].clone())
    return builder, plan


def test_round_trip_through_small_pieces_is_exact():
    state = _state()
    builder, plan = _transfer(state)
    assert plan.n_chunks > 10  # the big tensors really were cut into several pieces
    assert _same(state, builder.finish())


def test_missing_or_repeated_or_misplaced_piece_is_refused():
    state = _state()
    skeleton, tensors = flatten_state(state)
    plan = plan_pieces(tensors, 1024)
    builder = StateAssembler(skeleton, plan.piece_bytes, 2**30)
    pieces = [p for chunk in plan.chunks for p in chunk]
    for idx, offset, length in pieces[:-1]:
        builder.put(idx, offset, tensors[idx].reshape(-1)[offset:offset + length].clone())
    with pytest.raises(StateFormatError, match="pieces arrived"):
        builder.finish()
    idx, offset, length = pieces[0]
    with pytest.raises(StateFormatError, match="repeated"):
        builder.expect(idx, offset)
    idx, offset, length = pieces[-1]
    with pytest.raises(StateFormatError, match="unexpected"):
        builder.expect(idx, offset + 1)
    with pytest.raises(StateFormatError, match="dtype"):
        builder.put(idx, offset, torch.zeros(length, dtype=torch.float64))
    with pytest.raises(StateFormatError, match="unknown tensor"):
        builder.expect(len(tensors), 0)


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.update(format=2), "format"),
    (lambda d: d["specs"].append(["complex64", [2]]), "bad tensor spec"),
    (lambda d: d["specs"][0].__setitem__(1, [-1]), "bad tensor spec"),
    (lambda d: d.update(tree={"T": 0}), "every tensor"),
    (lambda d: d.update(tree={"x": 1}), "unknown tag"),
    (lambda d: d.update(tree=[1, 2]), "untagged"),
    (lambda d: d.update(tree={"d": [[{"T": 0}, 1]]}), "malformed dict"),
    (lambda d: d["specs"].__setitem__(0, ["float32", [2**30, 2**9]]), "exceeds the limit"),
])
def test_malformed_skeleton_is_refused(mutate, match):
    skeleton, _ = flatten_state(_state())
    doc = json.loads(skeleton)
    mutate(doc)
    with pytest.raises(StateFormatError, match=match):
        StateAssembler(json.dumps(doc), 1024, 2**30)


def test_deeply_nested_skeleton_and_non_json_are_refused():
    deep = '{"format":1,"specs":[],"tree":' + '{"l":[' * 100_000 + ']}' * 100_000 + "}"
    with pytest.raises(StateFormatError):
        StateAssembler(deep, 1024, 2**30)
    with pytest.raises(StateFormatError, match="JSON"):
        StateAssembler("{not json", 1024, 2**30)


def test_unsupported_values_are_refused_when_flattening():
    with pytest.raises(TypeError, match="object"):
        flatten_state({"x": object()})


def test_reference_check_catches_other_shapes_and_runs():
    state = _state()
    check_against_reference(state, state)
    other = dict(state, model=dict(state["model"], w=torch.zeros(40, 31)))
    with pytest.raises(StateFormatError, match="parameter w"):
        check_against_reference(other, state)
    with pytest.raises(StateFormatError, match="run_id"):
        check_against_reference(dict(state, run_id="zzz"), state)
    with pytest.raises(StateFormatError, match="names"):
        check_against_reference(dict(state, model={}), state)


def test_many_small_tensors_are_spread_so_no_chunk_exceeds_the_piece_limit():
    tensors = [torch.tensor(float(i)) for i in range(2500)]  # e.g. per-parameter optimiser step counters
    plan = plan_pieces(tensors, 4 * 2**20, max_pieces=1024)
    assert [len(c) for c in plan.chunks] == [1024, 1024, 452]
    skeleton, _ = flatten_state({"steps": tensors})
    builder = StateAssembler(skeleton, plan.piece_bytes, 2**30)
    for chunk in plan.chunks:
        for idx, offset, length in chunk:
            builder.put(idx, offset, tensors[idx].reshape(-1)[offset:offset + length].clone())
    assert all(torch.equal(a, b) for a, b in zip(builder.finish()["steps"], tensors, strict=True))
