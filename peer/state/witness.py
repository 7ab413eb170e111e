"""Before a joiner loads a donor's state, other replicas of the stage witness its weights.

A joiner takes the most advanced state a donor offers, and "most advanced" is what the donor *announces*: a liar that
announces the highest version would hand every joiner zeros, a scaled model or noise. The averaging rounds do not
repair that reliably: a state far from everyone's fails the distance check of every part the honest replicas send,
so it is never pulled back. So, before loading, the joiner asks up to ``witnesses`` other training peers of the stage
(picked at random by the joiner, not by announced progress) for pieces of their own model weights through the same
state RPC a transfer uses: chunk 0 of their snapshot (it starts with the first weights) and ``probe_chunks`` more
chunks drawn at random among those that hold weights. It compares each witness's pieces with the same pieces of the
delivered state by relative distance, ``|a - w| / max(|a|, |w|)`` over all probed coordinates (0 for equal
vectors, 1 for zeros against anything, 2 for a sign flip).

Honest replicas of a stage are close: they start from the run's seeded init and every averaging round pulls them
together. The delivered state is **outvoted** (not loaded, ``state_sync_outvoted``; the next donor is tried and
witnessed in turn) when two or more witnesses answered, each is farther from it than ``disagree_factor`` times the
witnesses' distance from one another plus ``disagree_floor``, and so they agree with each other far better than with
the donor. One witness alone cannot outvote a donor (one word against another), nor can witnesses that disagree
among themselves: the state is loaded, and a witness far from it is counted (``state_sync_disputed``) and logged.
A witness that fails to answer, or whose weights have other shapes, is skipped. The cost is chunk 0 plus
``probe_chunks`` chunks from each witness.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from peer.state.codec import StateFormatError, flatten_state, plan_pieces
from peer.state.sync import (
    SKELETON_KEY,
    StateSyncConfig,
    StateSyncError,
    Vet,
    decode_piece,
    open_snapshot,
    request_chunk,
)

if TYPE_CHECKING:
    from peer.ops.metrics import PeerMetrics
    from protocol.messages import StateChunk
    from protocol.rpc import Transport
    from trainer.config import RunConfig

logger = logging.getLogger(__name__)

ALONE_FAR = 0.5
"""A lone witness (or witnesses that disagree among themselves) this far from a delivered state is counted as a
dispute: honest replicas, started from one init and pulled together by averaging, are far closer."""

Pieces = dict[tuple[int, int], torch.Tensor]
"""(tensor index, offset) -> a flat float piece of a model weight."""


@dataclass(frozen=True)
class Verdict:
    """What the witnesses said of a delivered state: ``outvoted`` (do not load it), the state's distance from each
    witness that answered, the witnesses' largest distance from one another (None with fewer than two), and the
    witnesses far from the state."""

    outvoted: bool
    distances: dict[str, float]
    spread: float | None
    disputed: list[str]


def relative_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / max(|a|, |b|)``: 0 for equal vectors, 1 for zeros against anything, 2 for ``b = -a``."""
    scale = max(float(a.norm()), float(b.norm()))
    return float((a - b).norm()) / scale if scale > 0 else 0.0


def _distance(a: Pieces, b: Pieces) -> float | None:
    """Distance over the pieces both hold (None if none)."""
    keys = sorted(set(a) & set(b))
    if not keys:
        return None
    return relative_distance(torch.cat([a[k] for k in keys]), torch.cat([b[k] for k in keys]))


def _weight_chunks(tensors: list[torch.Tensor], n_model: int, config: StateSyncConfig) -> list[int]:
    """The chunks after chunk 0 that hold model weights, as a witness with our chunk size cuts the state."""
    plan = plan_pieces(tensors, config.chunk_bytes)
    return [c for c in range(1, plan.n_chunks) if any(i < n_model for i, _, _ in plan.chunks[c])]


def _same_pieces(tensors: list[torch.Tensor], pieces: Pieces) -> Pieces:
    """The delivered state's coordinates at the pieces a witness sent."""
    return {(i, o): tensors[i].reshape(-1)[o:o + p.numel()].float() for (i, o), p in pieces.items()}


async def _probe(transport: Transport, witness: str, run: RunConfig, stage: int, config: StateSyncConfig,
                 ours: list[torch.Tensor], n_model: int, chunks: list[int], limit: int) -> Pieces:
    """Pieces of ``witness``'s model weights from its chunk 0 and ``chunks``. Raises StateSyncError or
    StateFormatError when it cannot serve them."""
    first, builder = await open_snapshot(transport, witness, run, stage, config, limit)
    if len(builder.shapes) < n_model or any(builder.shapes[i] != tuple(ours[i].shape)
                                            or builder.dtypes[i] != ours[i].dtype for i in range(n_model)):
        raise StateSyncError("its model weights have other shapes")
    replies: list[StateChunk] = [first]
    for c in chunks:
        if c < first.n_chunks:
            reply = await request_chunk(transport, witness, run, stage, c, config, first.version)
            if reply.version != first.version:
                raise StateSyncError("it replaced its snapshot while witnessing")
            replies.append(reply)
    pieces: Pieces = {}
    for reply in replies:
        for key, env in reply.tensors.items():
            if key == SKELETON_KEY:
                continue
            idx, offset, piece = decode_piece(builder, key, env, witness)
            if idx < n_model and piece.is_floating_point():
                pieces[(idx, offset)] = piece.float()
    return pieces


async def witness_state(*, transport: Transport, state: dict[str, Any], donor: str, witnesses: list[str],
                        run: RunConfig, stage: int, config: StateSyncConfig, limit: int,
                        rng: random.Random | None = None) -> Verdict:
    """Ask ``config.witnesses`` of ``witnesses`` (drawn at random, never ``donor``) about ``state``, delivered by
    ``donor``, all at once; see the module docstring for the verdict."""
    rng = rng or random.Random()
    _, tensors = flatten_state(state)
    n_model = len(state["model"])  # the worker's state dict lists ``model`` before any other tensor
    weighted = _weight_chunks(tensors, n_model, config)
    pool = [w for w in dict.fromkeys(witnesses) if w != donor]
    asked = rng.sample(pool, min(config.witnesses, len(pool)))
    chunks = sorted(rng.sample(weighted, min(config.probe_chunks, len(weighted))))

    async def ask(w: str) -> Pieces | None:
        try:
            return await asyncio.wait_for(_probe(transport, w, run, stage, config, tensors, n_model, chunks, limit),
                                          config.witness_timeout_s)
        except (StateSyncError, StateFormatError, TimeoutError) as e:
            logger.info("witness %s could not answer: %s", w[:16], e or type(e).__name__)
            return None

    replies = await asyncio.gather(*(ask(w) for w in asked))
    answered = {w: p for w, p in zip(asked, replies, strict=True) if p}
    distances = {w: d for w, p in answered.items() if (d := _distance(_same_pieces(tensors, p), p)) is not None}
    names = sorted(distances)
    spreads = [s for i, a in enumerate(names) for b in names[i + 1:]
               if (s := _distance(answered[a], answered[b])) is not None]
    spread = max(spreads, default=None)
    far = config.disagree_factor * spread + config.disagree_floor if spread is not None else None
    outvoted = far is not None and len(distances) >= 2 and all(d > far for d in distances.values())
    disputed = [w for w, d in distances.items() if d > (far if outvoted else ALONE_FAR)]
    return Verdict(outvoted=outvoted, distances=distances, spread=spread, disputed=disputed)


def witness_vetter(*, run: RunConfig, stage: int, config: StateSyncConfig, metrics: PeerMetrics,
                   witnesses: list[str]) -> Vet:
    """The ``vet`` hook of ``load_state_from_peers``: False (and counted, logged, shown on the dashboard) when the
    witnesses among ``witnesses`` outvote a delivered state."""

    async def vet(transport: Transport, donor: str, state: dict, limit: int) -> bool:
        if config.witnesses == 0:
            return True
        verdict = await witness_state(transport=transport, state=state, donor=donor, witnesses=witnesses, run=run,
                                      stage=stage, config=config, limit=limit)
        figures = ", ".join(f"{w[:16]} {d:.3f}" for w, d in sorted(verdict.distances.items()))
        spread = f"{verdict.spread:.3f}" if verdict.spread is not None else "-"
        if verdict.disputed:
            metrics.inc("state_sync_disputed", len(verdict.disputed))
        if verdict.outvoted:
            metrics.inc("state_sync_outvoted")
            text = (f"stage {stage}: the state delivered by {donor[:16]} was outvoted by its witnesses (distance "
                    f"{figures}; between witnesses {spread}): not loaded, trying the next donor")
            logger.warning("%s", text)
            metrics.warn(text)
            return False
        if verdict.disputed:
            logger.warning("stage %d: witnesses %s are far from the state delivered by %s (distance %s; between "
                           "witnesses %s) but do not outvote it; loading it", stage,
                           ", ".join(w[:16] for w in verdict.disputed), donor[:16], figures, spread)
        elif verdict.distances:
            logger.info("stage %d: the state from %s agrees with its witnesses (distance %s; between witnesses %s)",
                        stage, donor[:16], figures, spread)
        return True

    return vet
