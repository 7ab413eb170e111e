"""Sync mode's fork check: every gradient barrier carries a digest of the replica's weights, and a replica whose
weights differ from its stage's adopts the state of a replica that holds the others'.

A barrier that times out (a replica dies mid-exchange, a reply is lost) can give the survivors different means, and
then they differ for the rest of the run. The digest (local step; per tensor the sum and the sum of squares) finds
that within ``rtol`` of device rounding; the stage's weights are those whose digest agrees with the most replicas (the
lowest id on a tie), so with three or more a lone replica cannot make the others load its state. ``resync`` loads
that replica's state through the state transfer once its snapshot holds the barrier's step, after ``vet_resync``
checked it against our own (weights within ``tensor_tolerance``, step near the barrier's, moments an optimiser with
our betas can hold: |m| <= c sqrt(v)). docs/design.md ("The synchronous baseline") gives the reasons and figures.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from peer.ids import short_id
from peer.seams import WorkerCall
from peer.state.digest import RMS_FLOOR
from peer.state.sync import load_state_from_peers
from protocol.rpc import Transport
from trainer.config import RunConfig
from trainer.optim import moments_refused

if TYPE_CHECKING:
    from peer.ops.metrics import PeerMetrics

logger = logging.getLogger(__name__)

__all__ = ["Fork", "digest_len", "digests_agree", "fork_of", "resync", "vet_resync", "weights_digest"]

MAX_STEPS_AHEAD = 4
"""A donor's state may be this many local steps past the barrier that found the fork (it may have gone on alone)."""


def digest_len(n_tensors: int) -> int:
    """Length of the digest of ``n_tensors`` tensors: the local step, then (sum, sum of squares) per tensor."""
    return 1 + 2 * n_tensors


def weights_digest(params: Sequence[torch.Tensor], local_step: int) -> torch.Tensor:
    """[local_step, sum(w_0), sum(w_0^2), sum(w_1), ...] (float64 sums) of a replica's weights."""
    head = torch.tensor([float(local_step)], dtype=torch.float64)
    if not params:
        return head
    with torch.no_grad():  # on the weights' device, one copy back (one synchronisation on a GPU)
        sums = torch.stack([torch.stack((p.sum(dtype=torch.float64), torch.linalg.vector_norm(p, dtype=torch.float64)
                                         ** 2)) for p in params])
    return torch.cat([head, sums.reshape(-1).cpu()])


def digests_agree(a: torch.Tensor, b: torch.Tensor, numels: Sequence[int], rtol: float) -> bool:
    """Whether two digests (``weights_digest``, local step aside) are of the same weights up to rounding:
    per tensor, the sums within ``rtol`` x sqrt(numel x sum of squares) and the sums of squares within ``rtol`` x
    the larger one (with a floor of 1e-12 for tensors at zero)."""
    if a.shape != b.shape or a.numel() != digest_len(len(numels)):
        return False
    a, b = a.double(), b.double()
    for j, n in enumerate(numels):
        s1a, s2a, s1b, s2b = (float(x) for x in (a[1 + 2 * j], a[2 + 2 * j], b[1 + 2 * j], b[2 + 2 * j]))
        sq = max(s2a, s2b, 0.0)
        if abs(s2a - s2b) > rtol * sq + 1e-12 or abs(s1a - s1b) > rtol * math.sqrt(n * sq) + 1e-12:
            return False
    return True


@dataclass(frozen=True)
class Fork:
    """Our weights differ from those the stage's replicas hold: adopt ``donor``'s state once it has made its step
    of this barrier (its local step at least ``min_step``)."""

    donor: str
    min_step: int
    agreeing: int
    """Replicas (of those whose digest we hold) that agree with the donor's."""


def fork_of(me: str, digests: dict[str, torch.Tensor], numels: Sequence[int], rtol: float) -> Fork | None:
    """``digests`` by peer id (ours among them, taken before the barrier's step): None when ours agrees with the
    stage's weights (the digest that agrees with the most, the lowest id on a tie), else where to resync from."""
    order = sorted(digests)
    agree = {p: {q for q in order if digests_agree(digests[p], digests[q], numels, rtol)} for p in order}
    best = max(order, key=lambda p: (len(agree[p]), -order.index(p)))
    if me in agree[best]:
        return None
    step = float(digests[best][0])  # finite (the exchange checked it), but the donor's word: kept >= 1
    return Fork(donor=best, min_step=max(1, int(step) + 1), agreeing=len(agree[best]))


def vet_resync(state: dict[str, Any], own: dict[str, Any], *, min_step: int, tolerance: float) -> str | None:
    """Why the donor's ``state`` may not replace ``own`` (this worker's ``state_dict()``), or None; see the module
    docstring. Shapes, dtypes and finite values are the worker's own check at the load."""
    step = state.get("local_step")
    if not isinstance(step, int) or not min_step <= step <= min_step + MAX_STEPS_AHEAD:
        return f"its local step {step!r} is not within {MAX_STEPS_AHEAD} of the barrier's {min_step}"
    theirs, ours = state.get("model"), own["model"]
    if not isinstance(theirs, dict) or set(theirs) != set(ours):
        return "its weights are not this stage's"
    for name, mine in ours.items():
        t, m = theirs[name], mine.detach().float().cpu()
        if not isinstance(t, torch.Tensor) or t.shape != m.shape:
            return f"its weights {name} are not this stage's"
        scale = max(float(m.norm()), RMS_FLOOR * math.sqrt(m.numel()))
        distance = float((t.float() - m).norm()) / scale
        if not distance <= tolerance:
            return f"its weights {name} are {distance:.3f} from ours (at most {tolerance} is taken)"
    opt = state.get("optimizer")
    entries = opt.get("state") if isinstance(opt, dict) else None
    if not isinstance(entries, dict):
        return "it holds no optimiser state"
    beta1, beta2 = own["optimizer"]["param_groups"][0]["betas"]
    for idx, entry in entries.items():
        why = moments_refused(entry, float(beta1), float(beta2))
        if why is not None:
            return f"its optimiser state of parameter {idx!r} {why}"
    return None


async def resync(fork: Fork, *, transport: Transport, run: RunConfig, stage: int, worker_call: WorkerCall,
                 metrics: PeerMetrics, timeout_s: float, tolerance: float = 0.5, poll_s: float = 0.1) -> bool:
    """Load ``fork.donor``'s state into our worker once its snapshot has reached ``fork.min_step``; True when
    loaded, False (counted as ``sync_resync_failed``) when it could not be had within ``timeout_s``: the next
    barrier's digests tell again."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    reference: dict[str, Any] = await worker_call(lambda w: w.state_dict())
    delay = poll_s
    while True:
        state = await load_state_from_peers(p2p=None, run=run, stage=stage, metrics=metrics, reference=reference,
                                            donors=[fork.donor], transport=transport, min_step=fork.min_step)
        if state is not None:
            break
        if loop.time() + delay > deadline:
            metrics.inc("sync_resync_failed")
            logger.warning("resync from %s failed: no state of local step %d or later within %.0f s",
                           short_id(fork.donor), fork.min_step, timeout_s)
            return False
        await asyncio.sleep(delay)  # the donor is still making the barrier's step
        delay = min(2 * delay, 2.0)
    refused = vet_resync(state, reference, min_step=fork.min_step, tolerance=tolerance)
    if refused is not None:
        metrics.inc("sync_resync_refused")
        logger.warning("resync: the state %s delivered is not loaded: %s", short_id(fork.donor), refused)
        return False
    # what the donor accumulated since is its own next flush's; sync mode keeps no averaging EMA to take
    state["grads"], state["accumulated"], state["averaging"] = None, 0, None
    try:
        await worker_call(lambda w: w.load_state_dict(state))
    except (TypeError, ValueError) as e:
        metrics.inc("sync_resync_failed")
        logger.warning("resync from %s: its state does not load: %s", short_id(fork.donor), e)
        return False
    metrics.inc("sync_resync_ok")
    logger.info("resynchronised with %s at local step %s", short_id(fork.donor), state.get("local_step"))
    return True
