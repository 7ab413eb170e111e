"""Re-checks from the held copy: a sample of the gradients the last stage returns, re-computed here and compared.

Spot checks (peer.pipeline.spotcheck) compare two replicas of the next stage, so a next stage of one replica goes
unchecked and two colluding identities vouch for each other. Every peer also holds a witnessed copy of its neighbour
stage (peer.state.spare); where that neighbour is the next stage and the last one, the copy re-computes a returned
gradient from the micro-batch's activations (decoded as the next stage received them) and targets: forward, loss,
backward to the input. The copy is up to a backup period stale and the wire quantizes, so the two gradients are
compared by cosine and norm ratio, with thresholds set from measured honest disagreement (docs/security.md,
"Re-checks from the held copy"). Verdicts go to the spot checks' bookkeeping: trust, strikes and bans are one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from peer.ids import short_id
from peer.pipeline.crosscheck import ban_hop
from peer.pipeline.spotcheck import agreement, quantiles
from peer.pipeline.work import BackwardWork, Pending
from protocol.codecs.registry import decode, encode
from trainer.model import build_stage

if TYPE_CHECKING:
    from peer.config import PeerConfig
    from peer.membership.routing import Router
    from peer.ops.metrics import PeerMetrics
    from peer.pipeline.boundary import Boundary
    from peer.pipeline.spotcheck import SpotChecker
    from peer.seams import Compute
    from peer.state.spare import SpareStore
    from protocol.messages import Backward, Forward
    from protocol.validation import TensorSpec
    from trainer.config import RunConfig
    from trainer.model import StageBase
    from trainer.worker import StageWorker

logger = logging.getLogger(__name__)

#: a re-check's verdict: ((cosine or share carried, norm ratio) or None when it could not be judged, what disagreed,
#: the step of the copy that judged it or None when it was proven without one)
Judged = tuple[tuple[float, float] | None, str, int | None]


@dataclass(frozen=True, kw_only=True)
class RecheckConfig:
    """How often and how strictly a stage re-computes its next stage's gradients from the held copy."""

    fraction: float = 0.02
    """Share of a trusted hop's micro-batches re-computed (untrusted: every one; each costs a forward and backward
    of the next stage here)."""
    min_cosine: float = 0.1
    """A returned gradient whose cosine similarity to the copy's is lower fails (honest: lowest 0.34 measured, for a
    copy of the seeded init against the tiny run's stage 2,000 steps on; fabricated: noise ~0.02, negated -1)."""
    max_norm_ratio: float = 16.0
    """A returned gradient whose norm differs from the copy's by a larger factor fails (honest: at most 10.4x, same
    measurement; the norm bound and gradient clipping bound the magnitude anyway)."""
    rows: int = 2
    """Sequences of the micro-batch re-computed, drawn at random (a transformer's rows are independent, so their
    gradient rows are exact): the re-check costs rows / batch_size of the last stage's forward and input backward,
    and as much of its activation memory."""
    busy_queue: int = 2
    """A sampled re-check of a trusted hop is skipped while this many items wait for the compute thread."""

    def __post_init__(self) -> None:
        check_thresholds(self, busy_queue=self.busy_queue, rows=self.rows)


def check_thresholds(config: Any, **counts: int) -> None:
    """The validation a re-check config (``RecheckConfig``, ``fwdcheck.ForwardCheckConfig``) shares: ``fraction`` in
    [0, 1], ``min_cosine`` in [-1, 1), ``max_norm_ratio`` >= 1, and every one of ``counts`` >= 1."""
    name = type(config).__name__
    if not 0.0 <= config.fraction <= 1.0:
        raise ValueError(f"{name}: fraction must be in [0, 1], got {config.fraction}")
    if not -1.0 <= config.min_cosine < 1.0 or not config.max_norm_ratio >= 1.0:
        raise ValueError(f"{name}: min_cosine must be in [-1, 1) and max_norm_ratio >= 1")
    if (low := [k for k, v in counts.items() if v < 1]):
        raise ValueError(f"{name}: {', '.join(low)} must be >= 1, got {', '.join(str(counts[k]) for k in low)}")


def check_figures(count_key: str, judged: int, copy: HeldCopy, compute_s: float,
                  seen: Iterable[tuple[float, float]]) -> dict[str, object]:
    """What /status shows of a kind of re-check: how many (under ``count_key``), the copy's weights in bytes, the
    compute seconds, and the quantiles of the recent (cosine, norm ratio) pairs ``seen``."""
    pairs = list(seen)
    out: dict[str, object] = {count_key: judged, "copy_bytes": copy.nbytes(), "compute_s": round(compute_s, 3)}
    for i, name in enumerate(("cosine", "norm_ratio")):
        out.update(quantiles(name, [v[i] for v in pairs]))
    return out


def judgeable(*tensors: torch.Tensor) -> bool:
    """Whether the held copy's own results can judge a hop: finite and not zero (a copy of a diverged state cannot;
    a hop's zero or non-finite answer is then proven wrong whatever the copy's staleness: ``Rechecks.record``)."""
    for t in tensors:
        n = float(torch.linalg.vector_norm(t.float()))
        if not 0.0 < n < float("inf"):
            return False
    return True


def input_gradient(module: StageBase, x: torch.Tensor, targets: torch.Tensor, *, bf16: bool = False) -> torch.Tensor:
    """The gradient of the last stage's mean loss w.r.t. its input ``x`` [B, T, d], as ``StageWorker.forward_loss``
    computes it, at ``module``'s weights (fp32 result; the weights' own gradients are not computed)."""
    device = next(module.parameters()).device
    x = x.detach().to(device, torch.float32).requires_grad_(True)
    with torch.enable_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        loss = module.loss(module(x), targets.to(device, torch.long))
    (grad,) = torch.autograd.grad(loss, [x])
    return grad.float()


def as_sent(boundary: Boundary, g: torch.Tensor, share: float = 1.0) -> torch.Tensor:
    """The copy's gradient of some rows as the wire would carry it: scaled to the mean over all the micro-batch's
    tokens (``share``: the rows' part of them), then through the run's codec, or, in a subspace run, projected into
    its subspace (exactly: the coefficient codec's rounding, a few percent, is left out, which the re-checks'
    thresholds dwarf)."""
    g = g.cpu() * share
    sub = boundary.subspace
    if sub is not None:
        return sub.grad_rebuild(sub.grad_coefficients(g))
    return decode(encode(g, boundary.run.compression.gradients))


class HeldCopy:
    """The held copy of stage ``stage`` (``spares``) as a module on ``device``, rebuilt when the copy changes and
    freed when it is gone. ``module()`` is blocking (it may read the copy from disk and build the module): call it in
    an executor, not on the compute thread; it is thread-safe.

    A copy first seen before this peer's own ``local_step()`` reached ``min_step`` is not used: early in training a
    stage moves so fast that an honest gradient can disagree with a copy a few dozen steps old (the tiny run: 2 of
    392 comparisons failed the thresholds, copies of steps 0 and 20 against the stage at step 40, none with a copy
    of step 40 or later; docs/security.md). Our own step, not the copy's announced one, decides: the replica
    that served the copy could announce any step."""

    def __init__(self, run: RunConfig, stage: int, spares: SpareStore, *, device: torch.device | str = "cpu",
                 local_step: Callable[[], int] = lambda: 0, min_step: int = 0) -> None:
        self.run, self.stage, self.spares, self.device = run, stage, spares, torch.device(device)
        self.local_step, self.min_step = local_step, min_step
        self._module: StageBase | None = None
        self._key: tuple[int, float] | None = None
        self._lock = threading.Lock()  # two re-checks in executor threads build one module
        self._seen: tuple[int, float] | None = None  # the copy last seen, and whether we had made min_step then
        self._mature = False
        self._seen_step = 0  # our own step when the copy held now was first seen

    @classmethod
    def of(cls, run: RunConfig, stage: int, spares: SpareStore, worker: StageWorker, cfg: PeerConfig) -> HeldCopy:
        """The copy of ``stage`` a peer training ``worker`` re-checks with: on its device, used once the peer's own
        step reached ``cfg.recheck_after_warmups`` x the run's warm-up steps."""
        return cls(run, stage, spares, device=worker.device, local_step=lambda: worker.local_step,
                   min_step=math.ceil(cfg.recheck_after_warmups * run.optim.warmup_steps))

    def available(self) -> bool:
        """Whether a copy of the stage is held and usable (cheap: read from the store's announcement): one first seen
        once our step reached ``min_step``, of a step that high too. A copy of the step already held, taken again
        (a replica serves one snapshot for a while), keeps the step at which that state was first seen: a red-team
        run had stage 0 take the copy of stage 1's step 2 again and again while both trained on, then judge stage 1
        at step 150 by it."""
        info = self.spares.info
        if info is None or info.stage != self.stage:
            return False
        key = (info.step, info.taken_at)
        if key != self._seen:
            if self._seen is None or info.step != self._seen[0]:
                self._seen_step = self.local_step()
            self._seen = key
            self._mature = self._seen_step >= self.min_step and info.step >= self.min_step
        return self._mature

    def recent(self, growth: float, *, after: int = 0) -> bool:
        """Whether the state held now was first seen once our own step reached ``after``, is of a step that high
        too, and our step is at most ``growth`` times what it was then (our step stands for the copied stage's
        progress: a hop's announced step is its own word)."""
        step = self._seen[0] if self._seen is not None else -1
        return (self._seen_step >= after and step >= after
                and self.local_step() <= growth * max(self._seen_step, 1))

    def module(self) -> StageBase | None:
        """The copy as a module without gradients of its own, or None when none is held (or it cannot be read)."""
        built = self.judge()
        return None if built is None else built[0]

    def judge(self) -> tuple[StageBase, int] | None:
        """The copy as ``module()`` gives it and the step it is of (which copy judged a re-check: failures against
        two copies ban where failures against one may be its staleness), or None."""
        with self._lock:
            info = self.spares.info
            if info is None or info.stage != self.stage or not self.available():
                self._module = self._key = None
                return None
            key = (info.step, info.taken_at)
            if key != self._key:
                state = self.spares.read(self.stage)
                if state is None or not isinstance(state.get("model"), dict):
                    return None
                module = build_stage(self.run, self.stage)
                # assign: the module takes the copy's tensors instead of filling its own (no second copy on the CPU)
                module.load_state_dict(state["model"], assign=True)
                module.requires_grad_(False)
                self._module, self._key = module.to(self.device).eval(), key
            assert self._module is not None
            return self._module, key[0]

    def want_fresh(self) -> None:
        """Ask for a fresher copy than the one held, soon (the backup loop takes one within its refresh bound)."""
        self.spares.want_fresh()

    def nbytes(self) -> int:
        """Bytes of the module's weights (0 while none is built)."""
        m = self._module
        return 0 if m is None else sum(t.numel() * t.element_size() for t in m.state_dict().values())


class Rechecks:
    """The re-checks stage ``stage`` runs on its next hops, for the servicer: which micro-batches, holding their
    gradient until re-computed, the verdict.

    Args:
        spot: the hops' trust, strikes and bans (shared with the spot checks).
        copy: the held copy of the next (last) stage.
        boundary: decodes the activations as the next stage did, and quantizes the copy's gradient as the wire does.
        tok_spec: the targets' wire spec.
        compute: the compute thread; queued: items waiting for it (a sampled re-check is skipped while busy).
        spawn: runs a re-check's task (the servicer's, cancelled when the stage leaves).
        held, requeue, vouch, revoke: as ``CrossChecks``'.
    """

    def __init__(self, spot: SpotChecker, config: RecheckConfig, *, stage: int, copy: HeldCopy, boundary: Boundary,
                 tok_spec: TensorSpec, my_id: str, compute: Compute, queued: Callable[[], int], router: Router,
                 metrics: PeerMetrics, spawn: Callable[[Awaitable[None]], object],
                 held: Callable[[int, Pending], bool], requeue: Callable[[BackwardWork], None],
                 vouch: Callable[[str], None], revoke: Callable[[str], None], bf16: bool = False) -> None:
        self.spot, self.config, self.stage, self.copy, self.boundary = spot, config, stage, copy, boundary
        self.tok_spec, self.my_id, self.compute, self.queued = tok_spec, my_id, compute, queued
        self.router, self.metrics, self.spawn, self.held, self.requeue = router, metrics, spawn, held, requeue
        self.vouch, self.revoke, self.bf16 = vouch, revoke, bf16
        self.seen: deque[tuple[float, float]] = deque(maxlen=512)  # (cosine, norm ratio): /status
        self.judged = 0
        self.compute_s = 0.0  # seconds the re-computations took on the compute thread

    def untrusted(self, peer: str) -> bool:
        """Whether every micro-batch sent to ``peer`` is re-computed here (it has not yet passed ``trust_after``
        re-checks in a row): a spot check would then let a colluding partner vouch for it, so none is sent."""
        return self.usable() and not self.spot.recheck_trusted(peer)

    def usable(self) -> bool:
        """Whether the held copy can judge the next stage's work now."""
        return self.copy.available()

    def answer(self, p: Pending, peer: str, msg: Backward, grad: torch.Tensor | None, learning: bool) -> bool:
        """``peer``'s answer to a micro-batch sent with a copy held: whether it is held here until re-computed
        (decided now, so a hop cannot tell by its timing whether it is re-checked; ``learning``: the gradient norm
        bound is being learnt, everything is re-checked)."""
        fwd, p.recheck = p.recheck, None
        if fwd is None or grad is None or not self.usable():
            return False
        busy = self.queued() >= self.config.busy_queue
        if not self.spot.wants_recheck(peer, fraction=self.config.fraction, learning=learning, busy=busy):
            return False
        self.metrics.inc("recheck_sampled")
        self.spawn(self._judge(p, peer, fwd, msg, grad))
        return True

    def _recompute(self, module: StageBase, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        grad = input_gradient(module, x, targets, bf16=self.bf16)
        self.compute_s += time.perf_counter() - t0
        return grad

    def _inputs(self, fwd: Forward) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sampled rows' activations as the next stage received them, their targets, and which rows."""
        x, window = self.boundary.decode_forward(fwd, self.my_id)
        if window is not None:  # subspace runs: the targets are the token window's last T ids
            targets = window[:, 1:]
        else:
            assert fwd.targets is not None  # every plain training forward to the last stage carries them
            targets = decode(fwd.targets, self.tok_spec, peer=self.my_id, field="targets").long()
        rows = torch.randperm(x.shape[0])[: self.config.rows]
        return x[rows], targets[rows], rows

    async def _reference(self, fwd: Forward, mb_id: int,
                         batch: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(the copy's gradient of a few rows as the wire delivers it, which rows, the copy's step), or None when
        the copy cannot judge now (it went, or our own error: never the hop's fault)."""
        loop = asyncio.get_running_loop()
        try:
            x, targets, rows = await loop.run_in_executor(None, self._inputs, fwd)
            # a new copy is read and built off the compute thread, which only runs the re-computation
            built = await loop.run_in_executor(None, self.copy.judge)
            if built is None:
                return None
            ref = await self.compute(self._recompute, built[0], x, targets)
            if not judgeable(ref):
                raise ValueError("the held copy's own gradient is zero or not finite: it judges nothing")
            return await loop.run_in_executor(None, as_sent, self.boundary, ref, len(rows) / batch), rows, built[1]
        except Exception as e:
            logger.warning("re-check of micro-batch %d failed here: %s: %s", mb_id, type(e).__name__, e)
            self.metrics.inc("recheck_errors")
            return None

    async def _judge(self, p: Pending, peer: str, fwd: Forward, msg: Backward, grad: torch.Tensor) -> None:
        ref = await self._reference(fwd, msg.mb_id, grad.shape[0])
        verdict = None if ref is None else agreement(grad[ref[1]], ref[0])
        if verdict is not None:
            self.seen.append(verdict)
        self.conclude(p, peer, msg, grad, verdict,
                      "" if verdict is None else f"cosine {verdict[0]:.3f}, norm ratio {verdict[1]:.2f}",
                      copy=None if ref is None else ref[2])

    def arbitrate(self, p: Pending, answers: dict[str, tuple[Backward, torch.Tensor]]) -> bool:
        """A spot check's two answers disagree: whether the held copy decides who is wrong, instead of the spot
        checks' history (``SpotChecker.blame``, which a liar with a longer record than its honest partner turns
        against the partner). Then the copy re-computes a few rows, each hop takes a re-check verdict of its own (a
        failure costs it its trust and counts towards its ban; a pass, a passed check), and the micro-batch is
        trained on the answer the copy agrees with when exactly one does, else dropped. False (the history decides)
        when no copy can judge now or the micro-batch was sent without a copy held."""
        fwd, p.recheck = p.recheck, None
        if fwd is None or not self.usable():
            return False
        self.metrics.inc("spotcheck_arbitrated")
        self.spawn(self._arbitrate(p, fwd, answers))
        return True

    async def _arbitrate(self, p: Pending, fwd: Forward, answers: dict[str, tuple[Backward, torch.Tensor]]) -> None:
        msg, grad0 = next(iter(answers.values()))
        ref = await self._reference(fwd, msg.mb_id, grad0.shape[0])
        if not self.held(msg.mb_id, p):
            return
        if ref is None:  # the copy went meanwhile: the history decides after all
            caught, ban = self.spot.blame(*answers)
            self._banned(caught, ban, "another replica", kind="spotcheck")
            self.requeue(BackwardWork(msg, None))
            return
        verdicts: dict[str, Judged] = {}
        for peer, (_, grad) in answers.items():
            cos, ratio = verdict = agreement(grad[ref[1]], ref[0])
            self.seen.append(verdict)
            verdicts[peer] = verdict, f"cosine {cos:.3f}, norm ratio {ratio:.2f}", ref[2]
        self.decide(p, answers, verdicts)

    def passes(self, verdict: tuple[float, float]) -> bool:
        """Whether a (cosine or share carried, norm ratio) verdict passes the thresholds."""
        return verdict[0] >= self.config.min_cosine and verdict[1] <= self.config.max_norm_ratio

    def decide(self, p: Pending, answers: dict[str, tuple[Backward, torch.Tensor]],
               verdicts: dict[str, Judged]) -> None:
        """The end of an arbitration: each answer judged by the copy takes its re-check verdict (``Judged``; None: it
        could not be judged, neither held against it nor trained on), and the micro-batch is trained on the one
        answer that passed, or dropped when none or both did."""
        msg = next(iter(answers.values()))[0]
        if not self.held(msg.mb_id, p):
            return
        passing = [peer for peer, (verdict, _, _) in verdicts.items() if verdict is not None and self.passes(verdict)]
        # they disagree, and the copy finds both right: neither is credited (the passes would earn a liar whose
        # colluding witness vouched for it the trust that spares it checks) nor blamed (an honest replica's witness
        # vouched for it as well), and neither is trained on
        unresolved = len(passing) > 1
        right = []
        for peer, (verdict, why, copy) in verdicts.items():
            if verdict is None:
                continue
            self.judged += 1
            if unresolved:
                continue
            passed, ban = self.record(peer, verdict, copy)
            if passed:
                right.append(peer)
            else:
                logger.warning("spot check of micro-batch %d decided by the held copy: the work of %s disagrees with "
                               "it (%s)%s", msg.mb_id, short_id(peer), why, ", banned" if ban else "")
                self._banned(peer, ban, "the held copy of its stage")
        self.metrics.rechecks = self.snapshot()
        if unresolved:
            self.metrics.inc("spotcheck_unresolved")
            logger.warning("spot check of micro-batch %d: %s disagree, and the held copy finds each right by its own "
                           "witnesses (a hop and its witness colluding, or replicas far apart); dropped, neither "
                           "credited", msg.mb_id, " and ".join(short_id(peer) for peer in passing))
        if len(right) != 1:  # both wrong, both right by the copy while they disagree, or unjudged: none to train on
            self.requeue(BackwardWork(msg, None))
            return
        self.vouch(right[0])
        p.trained_from = right  # named in the gradient we return: the one replica trained on
        self.requeue(BackwardWork(*answers[right[0]]))

    def _banned(self, peer: str, ban: bool, by: str, *, kind: str = "recheck") -> None:
        if ban:
            ban_hop(peer, stage=self.stage, spot=self.spot, router=self.router, metrics=self.metrics,
                    revoke=self.revoke, kind=kind, contradicted_by=by)

    def record(self, peer: str, verdict: tuple[float, float], copy: int | None) -> tuple[bool, bool]:
        """A re-check ``verdict`` on ``peer`` into the hops' bookkeeping (``copy``: the step of the copy that judged
        it, None when proven without one); (whether it passed, whether the hop is now to be banned). A zero or
        non-finite answer (norm ratio inf: a hop that added nothing, or a gradient of nothing) is proven whatever
        the copy: no staleness explains it. A failure that only one copy judged so far asks for a fresher copy: a
        stale copy and a liar part there."""
        passed = self.passes(verdict)
        if math.isinf(verdict[1]):
            copy = None
        ban = self.spot.recheck_verdict(peer, passed, copy=copy)
        if not passed and not ban and self.spot.one_copy_only(peer):
            self.copy.want_fresh()
        return passed, ban

    def conclude(self, p: Pending, peer: str, msg: Backward, grad: torch.Tensor,
                 verdict: tuple[float, float] | None, why: str, *, copy: int | None, unheard: bool = False) -> None:
        """Pass the re-checked gradient on, or drop it and hold it against ``peer``: ``verdict`` is the (cosine,
        norm ratio) judged (None: nothing could be judged, trained as before re-checks; ``why`` says what
        disagreed; ``copy``: the step of the copy that judged it, None when proven without one). ``unheard``:
        nothing could be judged because someone the hop named did not answer: dropped, not held against the
        hop."""
        if not self.held(msg.mb_id, p):  # the id held here (a later stage sends under ids of its own)
            return
        if verdict is None:  # the copy went (the peer moved, a newer one unreadable): trained as before re-checks
            self.metrics.inc("recheck_unavailable")
            self.requeue(BackwardWork(msg, None if unheard else grad))
            return
        self.judged += 1
        passed, ban = self.record(peer, verdict, copy)
        self.metrics.rechecks = self.snapshot()
        if passed:
            self.vouch(peer)
            self.requeue(BackwardWork(msg, grad))
            return
        logger.warning("re-check of micro-batch %d: the work of %s disagrees with the held copy's (%s; the copy's "
                       "step %s, ours %d); not trained on%s", msg.mb_id, short_id(peer), why, copy,
                       self.copy.local_step(), ", banned" if ban else "")
        self._banned(peer, ban, "the held copy of its stage")
        self.requeue(BackwardWork(msg, None))  # dropped here and upstream (stage 0 re-sends its sample)

    def snapshot(self) -> dict[str, object]:
        """Figures for /status: how many re-checks, the copy's weights in bytes, the cosines' and norm ratios'
        quantiles."""
        return check_figures("rechecks", self.judged, self.copy, self.compute_s, self.seen)

