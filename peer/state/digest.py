"""Per-tensor digests of a stage's state: what a witness sends so that a joiner can compare a whole state cheaply.

A digest covers every tensor that a loaded state keeps (``witnessed_tensors``: the model weights; the optimiser
moments, the averaging EMA and pending gradients are not kept, see ``peer.state.witness``). For each one it
holds the tensor's exact norm and a count sketch of ``dims`` coordinates: every coordinate is added, with a random
sign, into one of ``dims`` buckets, both drawn from a generator seeded by the *joiner's* seed and the tensor's index.
The sketch is linear, so the sketch of a difference is the difference of the sketches, and its norm estimates the
tensor's norm (relative error about ``sqrt(2 / dims)``): the joiner computes the same sketch of a delivered state and
reads, per tensor, how far it is from each witness's, without either side sending the weights. A witness that does
not know the seed beforehand cannot craft a state whose sketches match while its weights do not.

The reply is a ``StateChunk`` (chunk 0 of 1) with ``meta`` ``{"digest": dims, "local_step": ...}`` and the tensors
``sketch`` [n, dims] and ``norms`` [n] (float32) and ``numel`` [n] (int64): 280 bytes per tensor at 64 dims.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from protocol.codecs.registry import decode, encode
from protocol.errors import ProtocolError
from protocol.messages import StateChunk
from protocol.validation import TensorSpec
from trainer.model import starts_at_zero

BLOCK = 1 << 22  # coordinates drawn and added at once (bounds the memory of the random draws)
MAX_DIMS = 256
RMS_FLOOR = 0.002
"""Distances are relative to at least this rms per coordinate (a tenth of the GPT init std): a tensor that starts at
zero (a bias, a LayerNorm shift) differs between honest replicas by a large fraction of its own small norm."""
FLOOR_LR_STEPS = 20.0
"""A tensor that starts at zero is measured relative to at least this many optimiser steps' movement at the run's
peak learning rate (``witness_floors``): early in training honest replicas' biases and LayerNorm shifts read
0.7-1.1 apart under the fixed floor alone, and at most 0.45 under this one (``tools/witness_drift.py``;
docs/security.md, "Witnesses vote")."""


def witness_floors(names: list[str], lr: float) -> torch.Tensor:
    """Per witnessed tensor (``names``: the state's model keys, in order), the rms per coordinate its distance is
    relative to at least: ``FLOOR_LR_STEPS`` x ``lr`` for a tensor the seeded init sets to zero (0.06 in the tiny
    run, 0.02 in the default; a liar may then shift a bias by up to half that, rms), else ``RMS_FLOOR``."""
    high = max(RMS_FLOOR, FLOOR_LR_STEPS * lr)
    return torch.tensor([high if starts_at_zero(n) else RMS_FLOOR for n in names], dtype=torch.float64)


@dataclass(frozen=True)
class Digest:
    """One state's digest: per witnessed tensor its sketch, norm and size, and the state's ``local_step``."""

    sketch: torch.Tensor  # [n, dims] float32
    norms: torch.Tensor  # [n] float32
    numel: torch.Tensor  # [n] int64
    local_step: int


def witnessed_tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors of a worker state dict that a load keeps and a witness vouches for: the model's weights, in
    state-dict order (the averaging EMA, like the optimiser moments, is per-replica bookkeeping reset on load)."""
    return list(state["model"].values())


def witnessed_from_flat(skeleton: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``witnessed_tensors`` of a flattened state (``peer.state.codec.flatten_state``'s skeleton and tensors), as a
    state server holds its snapshot. ValueError when the skeleton is not a worker state's."""
    tree = json.loads(skeleton)["tree"]
    top = {k: v for k, v in tree.get("d", [])}
    model = top.get("model")
    if not isinstance(model, dict) or "d" not in model:
        raise ValueError("the snapshot holds no model weights")
    return [tensors[v["T"]] for _, v in model["d"]]


def sketch(t: torch.Tensor, *, seed: int, index: int, dims: int) -> torch.Tensor:
    """The count sketch of ``t`` (float32 [dims]) under ``seed`` and the tensor's ``index`` (see the module doc)."""
    x = t.detach().reshape(-1)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + index * 7919) % (2**63 - 1))
    out = torch.zeros(dims, dtype=torch.float64)
    for start in range(0, x.numel(), BLOCK):
        part = x[start:start + BLOCK].double()
        buckets = torch.randint(0, dims, (part.numel(),), generator=gen)
        signs = torch.randint(0, 2, (part.numel(),), generator=gen, dtype=torch.int8).double().mul_(2).sub_(1)
        out.index_add_(0, buckets, part * signs)
    return out.float()


def digest(tensors: list[torch.Tensor], *, seed: int, dims: int, local_step: int) -> Digest:
    """The digest of ``tensors`` (``witnessed_tensors`` of a state) under ``seed`` (blocking: one pass over them)."""
    if not 1 <= dims <= MAX_DIMS:
        raise ValueError(f"dims must be in [1, {MAX_DIMS}], got {dims}")
    sketches = [sketch(t, seed=seed, index=i, dims=dims) for i, t in enumerate(tensors)]
    return Digest(sketch=torch.stack(sketches) if sketches else torch.zeros(0, dims),
                  norms=torch.tensor([float(t.double().norm()) for t in tensors], dtype=torch.float32),
                  numel=torch.tensor([t.numel() for t in tensors], dtype=torch.int64), local_step=int(local_step))


def tensor_distances(a: Digest, b: Digest, floor: float | torch.Tensor = RMS_FLOOR,
                     fixed: torch.Tensor | None = None) -> torch.Tensor:
    """Per tensor, ``|S(a) - S(b)| / max(|S(a) - S(F)|, |S(b) - S(F)|, floor sqrt(numel))`` with S the sketch:
    about the relative distance of the two tensors, exactly 0 for equal ones, 1 for zeros against anything far above
    the floor and 2 for a sign flip. The floor (rms per coordinate, one or per tensor: ``witness_floors``) keeps
    tensors that are small next to how far training moves them (biases that start at zero) from reading small honest
    differences as far. ``fixed``: the sketches [n, dims] (same seed) of a part F every replica's tensor holds and
    nobody trains (a subspace run's fixed embedding tables, ``trainer.subspace.fixed_tables``; zeros elsewhere), so
    that the distance is relative to the trained part alone: a shared F in the denominator would let a state replace
    the whole trained part of a table and read as near."""
    diff = (a.sketch - b.sketch).double().norm(dim=1)
    sa, sb = a.sketch.double(), b.sketch.double()
    if fixed is not None:
        sa, sb = sa - fixed.double(), sb - fixed.double()
    scale = torch.maximum(sa.norm(dim=1), sb.norm(dim=1))
    scale = torch.maximum(scale, floor * a.numel.double().sqrt())
    return torch.where(scale > 0, diff / scale.clamp_min(1e-30), torch.zeros_like(diff)).float()


def digest_chunk(*, run_id: str, stage: int, version: int, skeleton: str, tensors: list[torch.Tensor],
                 local_step: int, seed: int, dims: int) -> StateChunk:
    """A state server's reply to a ``StateDigestRequest`` for its snapshot (blocking: run it in an executor)."""
    d = digest(witnessed_from_flat(skeleton, tensors), seed=seed, dims=dims, local_step=local_step)
    return StateChunk(run_id=run_id, stage=stage, version=version, chunk=0, n_chunks=1,
                      meta={"digest": dims, "local_step": d.local_step},
                      tensors={"sketch": encode(d.sketch, "none"), "norms": encode(d.norms, "none"),
                               "numel": encode(d.numel, "none")})


def read_digest(reply: StateChunk, *, dims: int, n_tensors: int | None, peer: str) -> Digest:
    """The digest a witness sent, checked: ``n_tensors`` tensors (None: as many as it holds, at most 4096) of ``dims``
    coordinates, finite, non-negative norms. ValueError when it is not one (the witness then counts as silent)."""
    if n_tensors is None:
        env = reply.tensors.get("norms")
        n_tensors = env.shape[0] if env is not None and len(env.shape) == 1 and env.shape[0] <= 4096 else 0
    step = reply.meta.get("local_step")
    if reply.meta.get("digest") != dims or type(step) is not int or step < 0:
        raise ValueError("not a digest of the asked size")
    missing = {"sketch", "norms", "numel"} - set(reply.tensors)
    if missing:
        raise ValueError(f"the digest lacks {sorted(missing)}")
    try:
        sk = decode(reply.tensors["sketch"], TensorSpec(shape=(n_tensors, dims), dtype=torch.float32), peer=peer)
        norms = decode(reply.tensors["norms"], TensorSpec(shape=(n_tensors,), dtype=torch.float32), peer=peer)
        numel = decode(reply.tensors["numel"], TensorSpec(shape=(n_tensors,), dtype=torch.int64), peer=peer)
    except ProtocolError as e:
        raise ValueError(f"the digest does not fit this stage: {e}") from e
    if not bool(torch.isfinite(sk).all()) or not bool(torch.isfinite(norms).all()) or bool((norms < 0).any()):
        raise ValueError("the digest holds NaN, Inf or negative norms")
    return Digest(sketch=sk, norms=norms, numel=numel, local_step=step)
