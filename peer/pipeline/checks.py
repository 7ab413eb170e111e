"""The checks a stage runs on its neighbours' work, built once for the servicer (docs/security.md).

* Spot checks (peer/pipeline/spotcheck.py, crosscheck.py): some micro-batches also go to a second replica of the
  next stage, whose gradients must agree. Not in sync mode, whose flushes pin each micro-batch to one replica.
* Re-checks (peer/pipeline/recheck.py): the next stage's gradients re-computed from the held copy of it; a middle
  next stage's with the testimony of the peer it sent the micro-batch on to (peer/pipeline/testimony.py). Where both
  run, a disagreeing spot check is decided by the copy when it can judge.
* Testimony: what this stage received and returned (stages from 2 on, the witness of the stage two before), and what
  it sent on and got back (middle stages, their own record for the stage before when a witness is silent), signed by
  their senders (peer/pipeline/attest.py).
* Forward re-checks (stage 1, peer/pipeline/fwdcheck.py): stage 0's forwards re-computed from a copy of stage 0, the
  neighbour copy in a 2-stage run, a private one in longer runs.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from peer.config import Mode
from peer.pipeline.crosscheck import CrossChecks
from peer.pipeline.fwdcheck import ForwardCheckConfig, ForwardChecks
from peer.pipeline.recheck import HeldCopy, RecheckConfig, Rechecks
from peer.pipeline.spotcheck import SpotCheckConfig, SpotChecker
from peer.pipeline.testimony import MiddleRechecks, TestimonyStore

if TYPE_CHECKING:

    from peer.config import PeerConfig
    from peer.membership.routing import Router
    from peer.ops.metrics import PeerMetrics
    from peer.pipeline.attest import Notary
    from peer.pipeline.boundary import Boundary
    from peer.pipeline.hops import Hops
    from peer.pipeline.work import BackwardWork, Pending
    from peer.seams import Compute, Send
    from peer.state.spare import SpareStore
    from protocol.validation import TensorSpec
    from trainer.config import RunConfig
    from trainer.worker import StageWorker


class Stage(Protocol):
    """What the checks use of the stage's servicer (``peer.pipeline.servicer.PipelineServicer``)."""

    run: RunConfig
    stage: int
    cfg: PeerConfig
    worker: StageWorker
    metrics: PeerMetrics
    hops: Hops
    router: Router
    boundary: Boundary
    tok_spec: TensorSpec
    my_id: str
    notary: Notary | None
    compute: Compute
    send: Send
    is_first: bool
    is_last: bool
    vouch: Callable[[str], None]
    revoke: Callable[[str], None]

    def holds(self, mb_id: int, pending: Pending) -> bool: ...

    def queue_backward(self, work: BackwardWork) -> None: ...

    def drop(self, mb_id: int, *, notify: bool) -> Awaitable[None]: ...

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]: ...

    def queued(self) -> int: ...


@dataclass(frozen=True)
class NeighbourChecks:
    """What a stage checks of its neighbours' work; None where that check does not run at this stage."""

    spot: SpotChecker | None
    cross: CrossChecks | None
    recheck: Rechecks | None
    testimony: TestimonyStore | None
    fwdcheck: ForwardChecks | None


def neighbour_checks(pipe: Stage, *, spares: SpareStore | None,
                     upstream: SpareStore | None) -> NeighbourChecks:
    """The checks of ``pipe``'s stage under its peer's settings. spares: the held copy of the neighbour stage (None:
    re-checks off); upstream: stage 1 of a run of 3+ stages, its private copy of stage 0."""
    run, stage, cfg, worker, metrics = pipe.run, pipe.stage, pipe.cfg, pipe.worker, pipe.metrics
    sync = cfg.mode == Mode.SYNC
    bf16 = worker.precision == "bf16"
    spot = None if not cfg.spot_checks or sync else SpotChecker(
        SpotCheckConfig(fraction=cfg.spot_check_fraction, min_cosine=cfg.spot_check_min_cosine), count=metrics.inc)
    cross = None if spot is None else CrossChecks(
        spot, stage=stage, hops=pipe.hops, router=pipe.router, metrics=metrics, held=pipe.holds,
        requeue=pipe.queue_backward, drop=lambda mb_id: pipe.drop(mb_id, notify=not pipe.is_first),
        vouch=lambda peer: pipe.vouch(peer), revoke=lambda peer: pipe.revoke(peer))
    kind: Callable[..., Rechecks] = (functools.partial(MiddleRechecks, send=pipe.send, notary=pipe.notary)
                                     if stage < run.n_stages - 2 else Rechecks)
    recheck = None if spot is None or spares is None or stage > run.n_stages - 2 else kind(
        spot, RecheckConfig(fraction=cfg.recheck_fraction, min_cosine=cfg.recheck_min_cosine), stage=stage,
        copy=HeldCopy.of(run, stage + 1, spares, worker, cfg), boundary=pipe.boundary, tok_spec=pipe.tok_spec,
        my_id=pipe.my_id, compute=pipe.compute, queued=pipe.queued, router=pipe.router, metrics=metrics,
        spawn=pipe.spawn, held=pipe.holds, requeue=pipe.queue_backward, vouch=lambda peer: pipe.vouch(peer),
        revoke=lambda peer: pipe.revoke(peer), bf16=bf16)
    if cross is not None and recheck is not None:
        cross.arbiter = recheck.arbitrate  # a disagreement decided by the copy, not by history
    # a witness (stage 2 on) keeps what it received and returned; a middle stage what it sent on and got back
    testimony = None if stage < 1 or pipe.is_last and stage < 2 or sync or pipe.notary is None else TestimonyStore(
        run_id=run.run_id, stage=stage, my_id=pipe.my_id, notary=pipe.notary, count=metrics.inc)
    source = spares if run.n_stages == 2 and pipe.is_last else upstream  # upstream: stage 1 of 3+ stages only
    fwdcheck = None if source is None or sync else ForwardChecks(
        ForwardCheckConfig(fraction=cfg.recheck_fraction), copy=HeldCopy.of(run, 0, source, worker, cfg),
        boundary=pipe.boundary, compute=pipe.compute, queued=pipe.queued, metrics=metrics, bf16=bf16)
    return NeighbourChecks(spot, cross, recheck, testimony, fwdcheck)
