"""Neighbour backups: now and then a peer copies the state of the next stage, so a stage whose every peer dies is
restored from the freshest copy in the swarm instead of the run's seeded init.

Every ``backup_every_s`` (jittered) a peer of stage s fetches stage (s+1) mod n from a training peer of that stage
through the ordinary state-sync client (same chunks, limits and validation as a joiner's) and offers it to its
``SpareStore`` (``peer.state.spare``), which keeps the more advanced of the held copy and the new one. Only a
witnessed state is copied (``peer.state.witness``: the neighbour stage's other replicas vouch for all of it; its
``local_step`` is capped at theirs), since the copy is announced in this peer's own record and may later restore the
stage; a neighbour stage of one replica is copied only when that replica did validated work for this peer. It is low
priority: skipped while the peer is not training, while its compute queue is busy, and when no peer of the neighbour
stage is ahead of the copy held. A re-check that fails against the held copy asks for a fresher one at once
(``SpareStore.want_fresh``; at most every ``REFRESH_MIN_S``, busy or not): failures against two copies ban a hop,
against one they may be the copy's staleness (``peer.pipeline.spotcheck``). The traffic is counted:
``backup_bytes_in``, ``backups_taken`` and ``backups_wanted`` here, ``backup_bytes_out`` and ``backups_served`` at the
serving peer (``peer.state.sync``).

The same loop keeps a second, private copy where a stage re-checks forwards from a stage that is not its neighbour:
stage 1 of a run of three or more stages copies stage 0 (``peer.pipeline.fwdcheck``). That copy holds the weights
only, stays in memory, is neither announced nor served, and is taken by the same witnessed rules.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from peer.state.codec import StateFormatError, check_against_reference
from peer.state.spare import SpareStore
from peer.state.sync import StateSyncConfig, choose_donors, load_state_from_peers, state_nbytes
from peer.state.witness import witness_vetter
from protocol.rpc import Transport
from trainer.model import build_stage
from trainer.worker import STATE_FORMAT

if TYPE_CHECKING:
    from hivemind.p2p import P2P

    from peer.membership.records import PeerRecord
    from peer.ops.metrics import PeerMetrics
    from trainer.config import RunConfig

logger = logging.getLogger(__name__)

MAX_HOLDERS = 2  # neighbour peers tried per backup before waiting for the next period
JITTER = 0.25  # +-25 % on the period, so the peers of a stage do not all fetch at once
REFRESH_MIN_S = 10.0  # a copy asked for early (``SpareStore.want_fresh``) comes at most this often


def neighbour_stage(n_stages: int, stage: int) -> int | None:
    """The stage a peer of ``stage`` keeps a copy of: the next one, wrapping; None with a single stage."""
    return None if n_stages < 2 else (stage + 1) % n_stages


def upstream_stage(n_stages: int, stage: int) -> int | None:
    """The stage whose forwards a peer of ``stage`` re-checks from a private copy (its neighbour copy cannot serve):
    stage 0 for stage 1 of a run of three or more stages, else None (in a 2-stage run the last stage's neighbour copy
    is of stage 0 already; stage 0 receives no forwards; later stages' inputs are re-checked by the stage two
    before, ``peer.pipeline.testimony``)."""
    return 0 if n_stages >= 3 and stage == 1 else None


def weights_of(state: dict[str, Any]) -> dict[str, Any]:
    """What a copy that only re-computes needs of a delivered state: the weights and the step they are of."""
    return {k: state[k] for k in ("format", "run_id", "stage", "model", "local_step") if k in state}


def shape_reference(run: RunConfig, stage: int) -> tuple[dict[str, Any], int]:
    """What a copy of ``stage`` must look like (parameter names, shapes, dtypes as meta tensors, no memory) and the
    bytes of its parameters (blocking: builds the stage's module once)."""
    model = build_stage(run, stage)
    params = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in model.state_dict().items()}
    nbytes = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    return {"format": STATE_FORMAT, "run_id": run.run_id, "stage": stage, "model": params}, nbytes


async def take_backup(*, run: RunConfig, stage: int, my_id: str, records: dict[str, PeerRecord], spares: SpareStore,
                      metrics: PeerMetrics, p2p: P2P | None, reference: tuple[dict[str, Any], int] | None = None,
                      transport: Transport | None = None, config: StateSyncConfig | None = None,
                      trusted: list[str] | None = None, of: int | None = None, weights_only: bool = False) -> bool:
    """Fetch the neighbour stage of ``stage`` (or stage ``of``) from one of its training peers and offer it to
    ``spares``. Returns whether a new copy is kept (False: no neighbour, nobody ahead of the held copy, no peer
    delivered, or less advanced than the held copy, or not witnessed). reference: ``shape_reference`` of the copied
    stage (built when None). trusted: the peers this peer has validated work from (preferred as witnesses).
    weights_only: keep the weights and step only (``weights_of``), for a copy that only re-computes."""
    neighbour = neighbour_stage(run.n_stages, stage) if of is None else of
    if neighbour is None:
        return False
    replicas = holders = choose_donors(records, neighbour, my_id)
    held = spares.info
    if held is not None and held.stage == neighbour:
        holders = [h for h in holders if records[h].version > held.step]
    if not holders:
        return False
    loop = asyncio.get_running_loop()
    if reference is None:
        reference = await loop.run_in_executor(None, shape_reference, run, neighbour)
    shapes, param_bytes = reference
    # parameters + two optimiser moments + averaging state, with room: what state sync bounds a joiner's download by
    config = config or StateSyncConfig(max_state_bytes=max(4 * param_bytes + 64 * 2**20, 1024 * 1024))
    for holder in holders[:MAX_HOLDERS]:
        vet = witness_vetter(run=run, stage=neighbour, config=config, metrics=metrics, announced=replicas,
                             trusted=trusted, allow_alone=holder in (trusted or []), what="a copy")
        state = await load_state_from_peers(p2p=p2p, run=run, stage=neighbour, metrics=metrics, donors=[holder],
                                            config=config, transport=transport, vet=vet)
        if state is None:
            continue
        try:
            check_against_reference(state, shapes)
        except StateFormatError as e:
            metrics.inc("rejected:backup_shape")
            logger.debug("a copy of stage %d from %s does not fit the stage: %s", neighbour, holder[:16], e)
            continue
        nbytes = await loop.run_in_executor(None, state_nbytes, state)
        metrics.inc("backup_bytes_in", nbytes)
        metrics.inc("backups_taken")
        if weights_only:
            state = weights_of(state)
        try:
            kept = await loop.run_in_executor(None, functools.partial(spares.offer, neighbour, state, source=holder,
                                                                      taken_at=time.time()))
        except OSError as e:
            text = f"keeping a copy of stage {neighbour} failed: {e}; check free space of --checkpoint-dir"
            logger.warning("%s", text)
            metrics.warn(text)
            return False
        step = state.get("local_step", -1)
        logger.info("copy of %s stage %d at step %s from %s: %d bytes, %s", "neighbour" if of is None else "checked",
                    neighbour, step, holder[:16], nbytes,
                    "kept" if kept else "less advanced than the one held, dropped")
        return kept
    return False


async def backup_loop(*, run: RunConfig, stage: int, my_id: str, period_s: float, spares: SpareStore,
                      metrics: PeerMetrics, p2p: P2P, swarm: Callable[[], dict[str, PeerRecord]],
                      busy: Callable[[], bool], trusted: Callable[[], list[str]] | None = None,
                      of: int | None = None, weights_only: bool = False) -> None:
    """Take a backup of the neighbour stage (or stage ``of``) every ``period_s`` (jittered) unless ``busy()``; runs
    until cancelled. trusted: the peers this peer has validated work from, read at each backup. weights_only: as
    ``take_backup``."""
    neighbour = neighbour_stage(run.n_stages, stage) if of is None else of
    if neighbour is None or period_s <= 0:
        return
    reference = await asyncio.get_running_loop().run_in_executor(None, shape_reference, run, neighbour)
    last = time.monotonic()
    while True:
        try:
            await asyncio.wait_for(spares.fresh_wanted.wait(), period_s * random.uniform(1 - JITTER, 1 + JITTER))
            wanted = True  # a re-check doubts the held copy (peer.pipeline.recheck): a fresher one, soon
            await asyncio.sleep(max(0.0, min(period_s, REFRESH_MIN_S) - (time.monotonic() - last)))
        except TimeoutError:
            wanted = False
        spares.fresh_wanted.clear()
        last = time.monotonic()
        if wanted:
            metrics.inc("backups_wanted")
        elif busy():
            metrics.inc("backups_skipped_busy")
            continue
        try:
            await take_backup(run=run, stage=stage, my_id=my_id, records=swarm(), spares=spares, metrics=metrics,
                              p2p=p2p, reference=reference, trusted=trusted() if trusted is not None else None,
                              of=of, weights_only=weights_only)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a failed backup costs the next period, never the peer
            metrics.inc("backups_failed")
            logger.warning("taking a copy of stage %d failed: %s: %s", neighbour, type(e).__name__, e)
