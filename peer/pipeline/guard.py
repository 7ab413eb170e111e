"""What a stage accepts from strangers on the pipeline: who may send it work, which tensors, which ids, which losses.

- A forward is taken only from a peer announced (signed DHT record) as a training or draining peer of the previous
  stage; one not (yet) in our view gets Busy, not an error, so an honest newcomer is retried, not banned.
- A micro-batch id is trained once: ids of accepted forwards are remembered (bounded), so a replayed or retried
  forward is refused (and a retry is idempotent).
- Activation and gradient norms must lie within ``norm_factor`` of the median of recently accepted ones (after a
  warm-up); what falls outside is refused and counted, and never enters the window (an attacker cannot drag it).
- A loss reported by the last stage is compared with the recent losses of its kind (median of a window); an outlier
  is flagged, counted and not reported as this peer's loss (the gradient, if within bounds, still counts).

Backwards are already accepted only from peers we forwarded that micro-batch to (``Pending.sent_to``).
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from peer.membership.records import PeerRecord

SENDER_STATES = ("training", "draining")


@dataclass(frozen=True, kw_only=True)
class GuardConfig:
    """Bounds on what strangers may feed a stage."""

    remember_ids: int = 65536
    """Micro-batch ids remembered as already trained (oldest forgotten first)."""
    norm_window: int = 128
    """Accepted norms the bounds are learnt from, per kind (activations, gradients)."""
    norm_warmup: int = 16
    """Norms accepted on the static checks alone before the learnt bounds apply."""
    norm_factor: float = 8.0
    """A norm above median x factor or below median / factor is refused."""
    loss_window: int = 64
    """Recent losses (per kind: training, evaluation) an incoming loss is compared with."""
    loss_warmup: int = 8
    """Losses taken before the cross-check applies."""
    loss_tolerance: float = 0.5
    """A loss further than max(tolerance x median, loss_abs_tolerance) from the median is an outlier."""
    loss_abs_tolerance: float = 1.0
    """Absolute floor of the loss tolerance (small medians)."""

    def __post_init__(self) -> None:
        for name in ("remember_ids", "norm_window", "loss_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"GuardConfig.{name} must be >= 1")
        if self.norm_factor <= 1.0 or self.loss_tolerance <= 0 or self.loss_abs_tolerance < 0:
            raise ValueError("GuardConfig: norm_factor must be > 1 and loss tolerances positive")


class _Window:
    """The last ``size`` accepted values and their median."""

    def __init__(self, size: int) -> None:
        self.values: deque[float] = deque(maxlen=size)

    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None


class PipelineGuard:
    """Per-stage checks of incoming pipeline work. ``count(name)`` is told of every refusal (metrics)."""

    def __init__(self, *, stage: int, swarm: Callable[[], dict[str, PeerRecord]], count: Callable[[str], None],
                 config: GuardConfig | None = None) -> None:
        self.stage, self.swarm, self.count = stage, swarm, count
        self.config = config or GuardConfig()
        self._trained: OrderedDict[int, None] = OrderedDict()
        self._norms = {"activations": _Window(self.config.norm_window), "gradients": _Window(self.config.norm_window)}
        self._losses = {False: _Window(self.config.loss_window), True: _Window(self.config.loss_window)}

    # ----- who -----------------------------------------------------------------------------------------------------
    def announced_sender(self, peer_id: str) -> bool:
        """Whether ``peer_id`` is announced as a working peer of the previous stage."""
        record = self.swarm().get(peer_id)
        ok = record is not None and record.stage == self.stage - 1 and record.state in SENDER_STATES
        if not ok:
            self.count("rejected:unannounced_sender")
        return ok

    # ----- which ids -----------------------------------------------------------------------------------------------
    def seen(self, mb_id: int) -> bool:
        """Whether micro-batch ``mb_id`` was already accepted here (a replay or a retry): counted."""
        if mb_id in self._trained:
            self.count("rejected:replayed_microbatch")
            return True
        return False

    def accept_id(self, mb_id: int) -> None:
        self._trained[mb_id] = None
        while len(self._trained) > self.config.remember_ids:
            self._trained.popitem(last=False)

    # ----- which tensors -------------------------------------------------------------------------------------------
    def norm_ok(self, kind: str, t: torch.Tensor) -> bool:
        """Check ``t``'s norm against the learnt bounds of ``kind`` ('activations' or 'gradients'); learn from it
        when accepted."""
        norm = float(torch.linalg.vector_norm(t.float()))
        window = self._norms[kind]
        median = window.median()
        if len(window.values) >= self.config.norm_warmup and median is not None and median > 0:
            f = self.config.norm_factor
            if not (median / f <= norm <= median * f) or not math.isfinite(norm):
                self.count(f"rejected:{kind}_norm")
                return False
        window.values.append(norm)
        return True

    # ----- which losses --------------------------------------------------------------------------------------------
    def loss_ok(self, loss: float, *, is_eval: bool) -> bool:
        """Whether ``loss`` agrees with recent losses of its kind; an outlier is counted. Every loss enters the
        window (its median is what an attacker would have to move, and it follows honest drift)."""
        window = self._losses[is_eval]
        median = window.median()
        ok = True
        if median is not None and len(window.values) >= self.config.loss_warmup:
            tol = max(self.config.loss_tolerance * median, self.config.loss_abs_tolerance)
            ok = abs(loss - median) <= tol
        window.values.append(loss)
        if not ok:
            self.count("flagged:loss_outlier")
        return ok
