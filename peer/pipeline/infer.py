"""The ``infer`` RPC: a forward only, for generation through the live swarm, at low priority against training.

``asyncmesh-peer generate --initial-peers`` sends a sequence through every stage in turn (``Infer``: token ids to
stage 0, activations to a later stage; the last stage answers the logits of the last position). The forward runs on
the compute thread under ``torch.no_grad()`` at the latest weights and changes no training state. Anyone who can reach
the peer may call it, so its cost is bounded, cheapest checks first (``InferLimits``): only while the stage trains, a
rate per caller, a few requests at once and a share of the compute thread (else ``Busy``: training goes first), one
sequence of at most ``block_size`` positions, validated before it is decoded. Malformed requests and rate refusals
raise ``ProtocolError``, so the RPC server charges them to a stranger's refusal budget (docs/security.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from protocol.codecs.registry import CODECS, decode, encode, parse_codec
from protocol.errors import ErrorCode, RateLimited, ValidationError
from protocol.limits import PeerBudgets
from protocol.messages import Busy, Error, Infer, InferResult, Message
from protocol.validation import TensorSpec

if TYPE_CHECKING:
    from peer.ops.metrics import PeerMetrics
    from peer.seams import Compute
    from trainer.config import RunConfig
    from trainer.worker import StageWorker

INFER_RPC = "infer"
MAX_ACT_ABS = 1e6  # as for training activations (boundary.py)
EXTRA_CODECS = ("fp16", "none")  # besides the run's activation codec


@dataclass(frozen=True, kw_only=True)
class InferLimits:
    """What generation requests may cost a stage (all callers together, and each caller)."""

    max_concurrent: int = 2
    """Requests decoded or computed at once; more are answered Busy."""
    busy_queue: int = 4
    """Training items waiting for the compute thread at or above which requests are answered Busy."""
    compute_share: float = 0.25
    """Fraction of the compute thread's time generation may use, all callers together (seconds per second)."""
    share_burst_s: float = 2.0
    """Compute seconds generation may use at once before the share applies (the bucket's depth)."""
    peer_per_s: float = 20.0
    """Requests per second one caller may make (a token through a K-stage swarm costs one per stage)."""
    peer_burst: int = 40
    """Requests one caller may make at once."""

    def __post_init__(self) -> None:
        if self.max_concurrent < 1 or self.busy_queue < 1 or self.peer_burst < 1:
            raise ValueError("InferLimits: max_concurrent, busy_queue and peer_burst must be >= 1")
        if not (0 < self.compute_share <= 1 and self.share_burst_s > 0 and self.peer_per_s > 0):
            raise ValueError("InferLimits: compute_share must be in (0, 1], share_burst_s and peer_per_s positive")


def infer_codecs(run: RunConfig) -> tuple[str, ...]:
    """The codecs a request may ask its reply in (and activations may arrive in): the run's activation codec, fp16,
    none."""
    own = run.compression.activations
    if run.compression.subspace:  # generation sends whole activations: a request carries no token ids to rebuild
        return tuple(EXTRA_CODECS)
    return (own, *(c for c in EXTRA_CODECS if c != own))


class _ComputeShare:
    """A bucket of compute seconds: refills at ``share`` per second up to ``burst``; spent after each request."""

    def __init__(self, share: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.share, self.burst, self.clock = share, burst, clock
        self.level, self.at = burst, clock()

    def _refill(self) -> float:
        now = self.clock()
        self.level, self.at = min(self.burst, self.level + (now - self.at) * self.share), now
        return self.level

    def wait_s(self) -> float:
        """0 when a request may start now, else the seconds until the bucket is positive again."""
        level = self._refill()
        return 0.0 if level > 0 else -level / self.share + 0.01

    def spend(self, seconds: float) -> None:
        self._refill()
        self.level -= seconds


class InferService:
    """The ``infer`` handler of one stage (owned by ``peer.stage.StageService``, dropped with it).

    Args:
        run, stage, worker: the run, the stage served and its worker (touched only through ``compute``).
        compute: runs a function on the compute thread.
        metrics: counters of served and refused requests.
        queued: training items waiting for the compute thread now (``PipelineServicer.queued``).
        serving: whether the stage trains now (not joining, loading or draining).
    """

    def __init__(self, *, run: RunConfig, stage: int, worker: StageWorker, compute: Compute, metrics: PeerMetrics,
                 queued: Callable[[], int], serving: Callable[[], bool], limits: InferLimits | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.run, self.stage, self.worker, self.compute, self.metrics = run, stage, worker, compute, metrics
        self.queued, self.serving = queued, serving
        self.limits = limits = limits or InferLimits()
        self.is_first, self.is_last = stage == 0, stage == run.n_stages - 1
        self.codecs = infer_codecs(run)
        self._codec_ids = {parse_codec(c).id for c in self.codecs}
        self._peers = PeerBudgets(limits.peer_per_s, limits.peer_burst, clock=clock)
        self._share = _ComputeShare(limits.compute_share, limits.share_burst_s, clock)
        self.active = 0
        t, d = run.model.block_size, run.model.n_embd
        self.spec = TensorSpec((1, -1), torch.int64) if self.is_first else \
            TensorSpec((1, -1, d), torch.float32, max_abs=MAX_ACT_ABS)
        self.max_positions = t

    def _refuse(self, reason: str, code: ErrorCode, message: str) -> Error:
        self.metrics.inc(f"rejected:infer_{reason}")
        return Error(code=code, message=message)

    def _busy(self, retry_after_s: float) -> Busy:
        self.metrics.inc("infer_busy")
        return Busy(retry_after_s=min(max(retry_after_s, 0.05), 30.0))

    async def rpc_infer(self, msg: Message, peer_id: str) -> Message:
        """Answer one ``Infer``; raises ``ValidationError``/``RateLimited`` for the RPC server to answer."""
        assert isinstance(msg, Infer)  # the server admits only Infer here (sizes.HANDLER_KINDS)
        if msg.run_id != self.run.run_id:
            return self._refuse("wrong_run", ErrorCode.WRONG_RUN, f"this peer trains run {self.run.run_id}")
        if msg.stage != self.stage:
            return self._refuse("wrong_stage", ErrorCode.WRONG_STAGE, f"this peer serves stage {self.stage}")
        if not self.serving():
            return self._refuse("not_ready", ErrorCode.NOT_READY, "this peer is not training now (joining, loading "
                                "or draining); ask another peer of the stage")
        if self._peers.empty(peer_id):
            self.metrics.inc("rejected:infer_rate_limited")
            raise RateLimited(f"at most {self.limits.peer_per_s:g} generation requests per second per caller")
        self._peers.spend(peer_id)
        self._check_request(msg, peer_id)
        if self.active >= self.limits.max_concurrent or self.queued() >= self.limits.busy_queue:
            return self._busy(0.1 * (1 + self.queued()))  # training goes first
        if (wait := self._share.wait_s()) > 0:
            return self._busy(wait)  # generation used its share of the compute thread
        self.active += 1
        try:
            x = await self._decode(msg, peer_id)
            out, seconds, version = await self.compute(self._forward, x)
            self._share.spend(seconds)
            self.metrics.inc("infer_compute_ms", round(1000 * seconds))
            env = await asyncio.get_running_loop().run_in_executor(None, encode, out, msg.codec)
        finally:
            self.active -= 1
        self.metrics.inc("infer_served")
        return InferResult(stage=self.stage, version=version, outputs=env)

    def _check_request(self, msg: Infer, peer_id: str) -> None:
        """What can be refused before decoding: the reply codec, the input's codec, dtype and shape."""
        env = msg.inputs
        try:
            if msg.codec not in self.codecs:
                raise ValidationError("codec", peer_id, f"replies are encoded with one of {list(self.codecs)}, "
                                      f"not {msg.codec[:32]!r}")
            allowed = {CODECS["none"].id} if self.is_first else self._codec_ids
            if env.codec not in allowed:
                raise ValidationError("inputs.codec", peer_id, f"codec id {env.codec!r} not among {sorted(allowed)}")
            if len(env.shape) == len(self.spec.shape) and not 1 <= env.shape[1] <= self.max_positions:
                raise ValidationError("inputs.shape", peer_id, f"one sequence of 1 to {self.max_positions} "
                                      f"positions, got {tuple(env.shape)}")
        except ValidationError:
            self.metrics.inc("rejected:infer_bad_request")
            raise

    async def _decode(self, msg: Infer, peer_id: str) -> torch.Tensor:
        try:
            x = await asyncio.get_running_loop().run_in_executor(
                None, lambda: decode(msg.inputs, self.spec, peer=peer_id, field="inputs"))
            if self.is_first and x.numel() and (int(x.min()) < 0 or int(x.max()) >= self.run.model.vocab_size):
                raise ValidationError("inputs", peer_id, f"token ids must be in [0, {self.run.model.vocab_size})")
        except ValidationError:
            self.metrics.inc("rejected:infer_bad_request")
            raise
        return x

    def _forward(self, x: torch.Tensor) -> tuple[torch.Tensor, float, int]:
        """On the compute thread: (output, compute seconds, weight version)."""
        t0 = time.perf_counter()
        out = self.worker.evaluate(x, last_only=True)
        return out, time.perf_counter() - t0, int(self.worker.local_step)
