"""Forward re-checks: stage 1 re-computes a sample of the forwards stage 0 sends it.

Every peer holds a witnessed copy of its neighbour stage (peer.state.spare); the last stage's neighbour is stage 0,
so in a 2-stage run stage 1 re-checks from that copy. In a run of 3 or more stages stage 1's neighbour is stage 2,
and it keeps a second, private copy of stage 0's weights by the same witnessed rules (``peer.state.backup``,
``upstream_stage``). Later stages' inputs are not re-checked here: they come from a middle stage, whose work the
stage before it re-checks with the next stage's testimony (peer/pipeline/testimony.py). A forward carries its
micro-batch's token window, so stage 1 can run the copy on the input ids of a few rows and compare the outputs with
the activations it received, before it computes on them (and, in a longer run, before it sends anything on):
activations not computed by stage 0 (another model's, scaled, random, or inconsistent with their targets) disagree.
The copy is up to a backup period stale and the wire quantizes, so the comparison is a cosine and a norm ratio
(``ForwardCheckConfig``), with the same rule as the gradient re-checks for which copies are used (``HeldCopy``: only
copies first seen once this peer passed 4 x the run's warm-up steps; measured honest disagreement: docs/security.md,
"Forward re-checks"). A sender is re-checked on every micro-batch until it passed ``trust_after`` in a row, then on
``fraction`` of them; a failed one is not trained on and counts as a refusal in the sender's work share
(``peer.pipeline.guard.WorkShare``: its allowance halves, and refusals in a row ban it).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from peer.ids import short_id
from peer.pipeline.recheck import check_figures, check_thresholds
from peer.pipeline.spotcheck import agreement

if TYPE_CHECKING:
    from peer.ops.metrics import PeerMetrics
    from peer.pipeline.boundary import Boundary
    from peer.pipeline.recheck import HeldCopy
    from peer.seams import Compute
    from trainer.model import StageBase

logger = logging.getLogger(__name__)

#: senders whose passed-in-a-row count is remembered (the least recently checked forgotten: a stranger again)
MAX_SENDERS = 4096


@dataclass(frozen=True, kw_only=True)
class ForwardCheckConfig:
    """How often and how strictly stage 1 re-computes stage 0's forwards from its held copy."""

    fraction: float = 0.02
    """Share of a trusted sender's training forwards re-computed (untrusted: every one)."""
    min_cosine: float = 0.2
    """Activations whose cosine similarity to the copy's is lower fail (honest, from copies of step >= 4 x the
    warm-up, up to 2,000 steps stale: lowest 0.32 in the tiny run, 0.71 in the default run; a differently seeded
    stage 0's output for the same two rows: at most 0.12 of 300 samples, which the gradient re-checks' 0.1 would
    let through)."""
    max_norm_ratio: float = 16.0
    """Activations whose norm differs from the copy's by a larger factor fail (honest, same copies: at most 5.1x
    and 1.25x; from the seeded init's copy up to 24x, which the copy rule keeps out)."""
    rows: int = 2
    """Sequences of the micro-batch re-computed, drawn at random: a check costs rows / batch_size of a stage-0
    forward."""
    trust_after: int = 4
    """Passed checks in a row after which a sender is sampled at ``fraction`` only."""
    busy_queue: int = 2
    """A sampled check of a trusted sender is skipped while this many items wait for the compute thread."""

    def __post_init__(self) -> None:
        check_thresholds(self, rows=self.rows, trust_after=self.trust_after, busy_queue=self.busy_queue)


class ForwardChecks:
    """The forward re-checks of stage 1, for the servicer: ``wants`` decides when a forward arrives (so a sender
    cannot tell by timing whether it is checked), ``judge`` runs before the micro-batch is computed.

    Args:
        copy: the held copy of stage 0.
        boundary: what of the activations is compared (``Boundary.sent``: a subspace run's coefficients).
        compute: the compute thread; queued: items waiting for it.
    """

    def __init__(self, config: ForwardCheckConfig, *, copy: HeldCopy, boundary: Boundary, compute: Compute,
                 queued: Callable[[], int], metrics: PeerMetrics, bf16: bool = False,
                 rng: random.Random | None = None) -> None:
        self.config, self.copy, self.boundary, self.compute, self.queued = config, copy, boundary, compute, queued
        self.metrics, self.bf16, self.rng = metrics, bf16, rng or random.Random()
        self._passed: OrderedDict[str, int] = OrderedDict()  # sender -> checks passed in a row
        self.seen: deque[tuple[float, float]] = deque(maxlen=512)  # (cosine, norm ratio): /status
        self.judged = 0
        self.compute_s = 0.0

    def trusted(self, sender: str) -> bool:
        return self._passed.get(sender, 0) >= self.config.trust_after

    def wants(self, sender: str) -> bool:
        """Whether the training forward ``sender`` just sent is re-checked before it is trained on."""
        if not self.copy.available():
            return False
        if not self.trusted(sender):
            return True
        if self.queued() >= self.config.busy_queue:
            return False
        return self.rng.random() < self.config.fraction

    def _recompute(self, module: StageBase, ids: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        device = next(module.parameters()).device
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.bf16):
            y: torch.Tensor = module(ids.to(device)).float().cpu()
        self.compute_s += time.perf_counter() - t0
        return y

    async def judge(self, sender: str, mb_id: int, x: torch.Tensor, window: torch.Tensor | None) -> bool:
        """Whether ``sender``'s activations ``x`` [B, T, d] (as received) agree with the held copy's for the input
        ids of the token ``window`` [B, T+1]; True also when the check cannot run here (the copy went, our own
        error), as the micro-batch would have been trained without re-checks. A forward without its window fails."""
        if window is None:
            ref = None
            cos, ratio = -1.0, float("inf")
        else:
            rows = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(self.rng.getrandbits(62)))
            rows = rows[: self.config.rows]
            loop = asyncio.get_running_loop()
            try:
                module = await loop.run_in_executor(None, self.copy.module)
                if module is None:
                    self.metrics.inc("fwdcheck_unavailable")
                    return True
                ref = await self.compute(self._recompute, module, window[rows, :-1])
            except Exception as e:  # our own failure, never the sender's
                logger.warning("forward re-check of micro-batch %d failed here: %s: %s", mb_id, type(e).__name__, e)
                self.metrics.inc("fwdcheck_errors")
                return True
            cos, ratio = agreement(self.boundary.sent(x[rows], window[rows]), self.boundary.sent(ref, window[rows]))
        self.seen.append((cos, ratio))
        self.judged += 1
        passed = cos >= self.config.min_cosine and ratio <= self.config.max_norm_ratio
        streak = self._passed.pop(sender, 0)
        self._passed[sender] = streak + 1 if passed else 0
        while len(self._passed) > MAX_SENDERS:
            self._passed.popitem(last=False)
        self.metrics.inc("fwdcheck_passed" if passed else "fwdcheck_failed")
        self.metrics.fwdchecks = self.snapshot()
        if not passed:
            logger.warning("forward re-check of micro-batch %d: the activations of %s disagree with the held copy "
                           "of stage 0's (%s); not trained on", mb_id, short_id(sender),
                           "no token window" if window is None else f"cosine {cos:.3f}, norm ratio {ratio:.2f}")
        return passed

    def snapshot(self) -> dict[str, object]:
        """Figures for /status: checks made, the copy's bytes, compute seconds, the cosines' and ratios'
        quantiles."""
        return check_figures("checks", self.judged, self.copy, self.compute_s, self.seen)
