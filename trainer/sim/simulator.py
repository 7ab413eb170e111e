"""The mesh simulator: K stages x R replicas of StageWorkers in one process, with exact, configurable delays.

It drives the same ``StageWorker`` the daemon drives (docs/design.md, "One trainer, two drivers") through an event
schedule, so what it shows about convergence holds for the daemon's code:

* **async** methods (PipeDream 1F1B steady state, docs/design.md, "Pipeline axis"): at global tick t, stage s of every
  replica forwards micro-batch ``t - s`` and backwards micro-batch ``t - (K - 1)``, whose forward ran
  ``tau_s = K - 1 - s`` ticks earlier at that stage; the worker steps after the backward. Within a tick the last stage
  runs ``forward_loss`` (forward and backward at once, delay 0), the other stages their forwards, then the gradient
  sweeps from stage K - 2 down to 0. Ticks ``0 .. K - 2`` fill the pipe and the last ``K - 1`` drain it, so every
  micro-batch is trained on and a stage makes exactly one step per micro-batch (fewer with accumulation). With
  ``pipeline_extra`` E > 0 the sweep of a micro-batch runs E ticks after its loss, as in a daemon whose stage 0 keeps
  more micro-batches in flight than there are stages: stage s then sees a delay of K - 1 - s + E.
* **sync** (GPipe with M micro-batches and a flush): all micro-batches of a step see the same weights, so running
  each one's forward and backward back to back is numerically identical to GPipe's all-forwards-then-all-backwards.
  The replicas' gradients are combined as the daemon's sync barrier combines them (``trainer.aggregate.barrier_mean``:
  a far outlier among three or more dropped, the plain mean of the rest).
* **Replicas**: 'grad' averages the replicas' summed gradients before every optimiser step (they stay identical);
  'avg' runs the worker's averaging hooks with the run's cadence, the daemon's: every ``averaging.round_steps``
  local steps a round begins (``averaging_begin`` on every replica of the stage, a partition of
  ``fraction * round_steps`` of every tensor), the mean over replicas of the partition's values (each replica's
  payload through the averaging codec) is applied with ``averaging_finish`` tau local steps later (at once when tau
  is 0), i.e. the daemon's code path with the network replaced by a delay. tau is fixed (``tau``) or drawn per round
  from ``tau_samples``, e.g. the delays a daemon measured (its summary's ``avg_delay_hist``). One difference stays:
  the daemon numbers rounds by its wall clock and skips ticks when it is not due, so its partitions are drawn from
  the cycle out of order, where the simulator takes them in order. 'wagma' is the same with WAGMA groups
  (trainer/averaging.py).
* **Compression**: activations and gradients crossing a stage boundary, and averaging payloads, go through
  ``protocol.codecs.registry.roundtrip`` with the chosen codec, so quantisation error enters training as it
  would on the wire. Subspace runs (trainer/subspace.py) send a boundary's coefficients through the coefficient
  codec and rebuild the activations from them and the micro-batch's token ids, as peer/pipeline/boundary.py does.
* **Byzantine replicas** (``byzantine``, ``attack``): the last ``byzantine`` replicas train honestly but put an
  attacked part on the wire (``trainer.attacks``: zeros, x-10, sign flip, noise, 'a little is enough' from the honest
  parts); every replica combines the parts with the run's ``averaging.aggregator`` (``trainer.robust``), so the
  sparse averaging sees the attack as the daemon's would. The validation loss is then that of the honest replicas'
  averaged weights. Applies to the parameter-averaging methods only.
* **Same samples**: replica r of every method reads the same stream (``BatchStream`` seeded by
  ``shard_seed(run.seed, r)``), one micro-batch per tick (async) or M per step (sync); a digest of every token batch
  read is reported so this is checked, not assumed.

Validation uses a fixed set of batches (``val_batches``) and, for parameter-averaging methods, the model averaged over
replicas (as the AsyncMesh code evaluates), without compression; or (``eval_replicas = 'each'``) the mean of every
replica's own loss, as the daemon's replicas report it.
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from trainer.aggregate import OUTLIER_FACTOR, OUTLIER_RMS, barrier_mean, robust_combine
from trainer.attacks import ATTACKS, byzantine_part
from trainer.config import RunConfig
from trainer.data import BatchStream, Corpus, corpus_identity, load_corpus, shard_seed, val_batches
from trainer.rules import rule_of, wagma_members
from trainer.sim.methods import METHODS, Combine, MethodSpec
from trainer.subspace import Subspace
from trainer.worker import StageWorker, use_tf32_on_gpu

logger = logging.getLogger(__name__)


EVAL_REPLICAS = ("averaged", "each")


class SimulationError(RuntimeError):
    """A simulation that cannot run as configured (e.g. a codec the protocol package does not provide)."""


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """One simulation: the base run (model, data, optimiser schedule) and the knobs every method shares."""

    preset: str = "custom"
    """Name shown in the outputs."""
    run: RunConfig = field(default_factory=RunConfig.default)
    """Base run: model, data, seed, lr and warm-up; n_stages is the pipeline depth K; compression the codecs."""
    n_replicas: int = 2
    """Data-parallel replicas R of every stage."""
    steps: int = 200
    """Micro-batches each replica trains on (= local steps of an async stage without accumulation)."""
    micro_batches: int = 4
    """M: micro-batches per fullsync (GPipe) step; must divide steps."""
    tau: int = 10
    """Averaging delay in local steps (asyncmesh, async-sparta, delta, wagma)."""
    taus: tuple[int, ...] = ()
    """Several delays: every tau-dependent method runs once per value (named 'method@tauN'); empty uses tau."""
    tau_samples: tuple[int, ...] = ()
    """Measured delays in local steps: each round's tau is drawn from them (seeded by the run seed) instead of tau."""
    fraction: float = 0.05
    """p: fraction of each tensor averaged per local step (a round averages p * run.averaging.round_steps)."""
    accumulate: int = 4
    """A: gradients summed per step by 'accum'; must divide steps."""
    eval_every: int = 100
    """Evaluate every this many micro-batches per replica (and once at the end)."""
    eval_batches: int = 8
    """Validation batches per evaluation (a fixed set, the same for every method)."""
    methods: tuple[str, ...] = ("fullsync", "asyncpp", "asyncmesh")
    """Methods to run, in order."""
    byzantine: int = 0
    """The last this many replicas send attacked averaging parts (parameter-averaging methods); 0: all honest."""
    attack: str = "zeros"
    """What the Byzantine replicas send: one of trainer.attacks.ATTACKS."""
    pipeline_extra: int = 0
    """Async schedules: every stage's gradient arrives this many ticks later than in PipeDream's 1F1B, so stage s sees
    a delay of K - 1 - s + pipeline_extra (a daemon's stage 0 keeping W micro-batches in flight on K stages sees about
    W - 1, i.e. pipeline_extra = W - K; its summary's pipeline_delay_steps says what it saw)."""
    eval_replicas: str = "averaged"
    """'averaged': validate replica 0 holding the weights averaged over the honest replicas (as the AsyncMesh code
    evaluates); 'each': the mean over honest replicas r of the validation loss of replica r's own stages (as the
    daemon's stage-0 replicas each report theirs)."""
    speeds: tuple[float, ...] = ()
    """Async schedules: replica r's speed factor in (0, 1] (empty: all 1). Replica r works at a share ``speeds[r]``
    of the ticks (spread evenly) and trains on ``round(steps * speeds[r])`` micro-batches, so that all finish
    together, as replicas of a daemon trained for the same wall time; averaging rounds follow the fastest replica's
    local steps, as the daemon's do (a replica pulled into its partners' rounds averages more per step)."""
    device: str = "cpu"
    """Torch device of every worker ('cpu', 'cuda', 'cuda:1'; resolve 'auto' with trainer.worker.resolve_device).
    On CUDA, float32 matrix products use TF32 (``torch.set_float32_matmul_precision('high')``)."""
    sync_optimizer: str = "adamw"
    """fullsync's optimiser: 'adamw' (beta1 0.9, the papers' baseline) or 'nadam' (beta1 0.99); a sweep's knob."""
    sync_lr: float | None = None
    """fullsync's peak learning rate (None: the run's); a sweep's knob."""

    def __post_init__(self) -> None:
        if self.n_replicas < 1 or self.steps < 1 or self.micro_batches < 1 or self.accumulate < 1:
            raise ValueError("n_replicas, steps, micro_batches and accumulate must be >= 1")
        if self.steps % self.micro_batches or self.steps % self.accumulate:
            raise ValueError(f"steps ({self.steps}) must be a multiple of micro_batches ({self.micro_batches}) and "
                             f"of accumulate ({self.accumulate}) so every method sees the same samples")
        if self.tau < 0 or any(t < 0 for t in (*self.taus, *self.tau_samples)):
            raise ValueError("tau must be >= 0")
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")
        if self.eval_every < 1 or self.eval_batches < 1:
            raise ValueError("eval_every and eval_batches must be >= 1")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
        if not 0 <= self.byzantine < self.n_replicas or self.attack not in ATTACKS:
            raise ValueError(f"byzantine must be in [0, n_replicas) and attack one of {ATTACKS}, "
                             f"got {self.byzantine}, {self.attack!r}")
        if self.pipeline_extra < 0 or self.eval_replicas not in EVAL_REPLICAS:
            raise ValueError(f"pipeline_extra must be >= 0 and eval_replicas one of {EVAL_REPLICAS}, "
                             f"got {self.pipeline_extra}, {self.eval_replicas!r}")
        if self.speeds and (len(self.speeds) != self.n_replicas or not all(0 < f <= 1 for f in self.speeds)
                            or max(self.speeds) != 1):
            raise ValueError(f"speeds must give one factor in (0, 1] per replica, the fastest 1, got {self.speeds}")
        if not self.device.startswith(("cpu", "cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.sync_optimizer not in ("adamw", "nadam") or not (self.sync_lr is None or self.sync_lr > 0):
            raise ValueError(f"sync_optimizer must be 'adamw' or 'nadam' and sync_lr positive, got "
                             f"{self.sync_optimizer!r}, {self.sync_lr}")

    def variants(self) -> list[tuple[str, str, int]]:
        """(result name, method, tau) for every run: tau-dependent methods once per tau when taus is set."""
        out = []
        for m in self.methods:
            if m == "full-avg":  # no delay by definition
                out.append((m, m, 0))
            elif self.taus and METHODS[m].combine == Combine.PARAMETERS:
                out.extend((f"{m}@tau{t}", m, t) for t in self.taus)
            else:
                out.append((m, m, self.tau))
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SimConfig:
        """Inverse of to_dict (reads the 'config' of a results.json)."""
        d = dict(d)
        d.setdefault("device", "cpu")  # results written before the field existed ran on the CPU
        run = dict(d["run"])
        if "averaging" in run:  # results written before the cadence was the run's: a round every every_steps
            avg = dict(run["averaging"])
            if "every_steps" in avg:
                avg["round_steps"] = avg.pop("every_steps")
            avg.pop("delay_steps", None)  # the delay was always the simulation's tau
            run["averaging"] = avg
        d.setdefault("byzantine", 0)
        d.setdefault("pipeline_extra", 0)  # results written before these fields ran 1F1B and the averaged evaluation
        d.setdefault("eval_replicas", "averaged")
        d.setdefault("attack", "zeros")
        d["run"] = RunConfig.from_dict(run)
        d["methods"], d["taus"] = tuple(d["methods"]), tuple(d["taus"])
        d["tau_samples"] = tuple(d.get("tau_samples", ()))
        d["speeds"] = tuple(d.get("speeds", ()))
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["run"] = self.run.to_dict()
        d["methods"], d["taus"] = list(self.methods), list(self.taus)
        d["tau_samples"] = list(self.tau_samples)
        d["speeds"] = list(self.speeds)
        return d


def speeds_from_steps(steps: list[int]) -> tuple[float, ...]:
    """``SimConfig.speeds`` for replicas that made ``steps`` local steps each in the same wall time (a daemon's
    stage-0 summaries): each one's share of the fastest's. Train the simulation for ``max(steps)`` micro-batches."""
    if not steps or min(steps) < 1:
        raise ValueError(f"every replica must have made at least one step, got {steps}")
    return tuple(s / max(steps) for s in steps)


def _codec(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name == "none":
        return lambda t: t
    try:
        from protocol.codecs.registry import roundtrip
    except ImportError as e:  # pragma: no cover - the protocol package ships codecs
        raise SimulationError(f"compression '{name}' needs the codec registry's roundtrip: {e}") from e
    return lambda t: roundtrip(t, name)


class _Run:
    """One method's simulation state: the R x K workers, the data streams and the curve."""

    def __init__(self, sim: SimConfig, spec: MethodSpec, tau: int, corpus: Corpus,
                 val: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.sim, self.spec, self.tau = sim, spec, tau
        self.run = spec.configure(sim.run, _Knobs(sim, tau))
        self.rule = rule_of(self.run.averaging)
        self.K, self.R = self.run.n_stages, sim.n_replicas
        auto = spec.combine != Combine.GRADIENTS
        self.w = [[StageWorker(self.run, s, device=sim.device, replica=r, auto_step=auto) for s in range(self.K)]
                  for r in range(self.R)]
        b, t = self.run.data.batch_size, self.run.model.block_size
        self.streams = [BatchStream(corpus.train, t, b, shard_seed(self.run.seed, r)) for r in range(self.R)]
        self.digests = [hashlib.sha256() for _ in range(self.R)]
        self.val = val
        comp = self.run.compression
        self.codec_errors: dict[str, list[float]] = {"act": [], "grad": []}  # relative L2 error per hop, since record
        # subspace runs: the boundary's coefficients through the coefficient codec (and back), as the wire does
        self.subspace = Subspace(self.run, device=sim.device) if comp.subspace else None
        self.act = self._measured(comp.subspace_codec if comp.subspace else comp.activations, "act")
        self.grad = self._measured(comp.subspace_codec if comp.subspace else comp.gradients, "grad")
        self.ids: list[dict[int, torch.Tensor]] = [{} for _ in range(self.R)]  # micro-batch -> its input token ids
        self.avg_codec = _codec(comp.averaging)
        self.consumed = 0  # micro-batches per replica read so far (a speed-1 replica's, with speeds)
        self.trained: list[int] = []  # async schedule: micro-batches each replica has read
        self.losses: list[float] = []
        self.curve: list[dict[str, float]] = []
        # per stage: (apply at step, round, each replica's means)
        self.fifo: list[list[tuple[int, int, list[list[torch.Tensor]]]]] = [[] for _ in range(self.K)]
        self.rounds = [0] * self.K
        self.seen_steps = [0] * self.K
        self.last_begun = [0] * self.K  # local step of the stage's last round begin
        self.rounds_applied = 0
        self.fraction_applied = 0.0  # sum over applied rounds (of replica 0, stage 0) of the fraction they averaged
        self.delays: list[int] = []  # tau of every round begun (stage 0)
        self._tau_rng = random.Random(self.run.seed)
        self.honest = self.R - (sim.byzantine if spec.combine != Combine.GRADIENTS else 0)  # replicas 0 .. honest-1
        self.attack_rng = torch.Generator().manual_seed(self.run.seed + 7)

    def _measured(self, name: str, kind: str) -> Callable[..., torch.Tensor]:
        """The codec's round trip ``(t, ids) -> t'``, recording ||q(t) - t|| / ||t|| of every hop (the curve reports
        their mean). Subspace runs send a boundary's coefficients (activations: of ``t`` less the micro-batch
        ``ids``' fixed embeddings) and rebuild the full tensor from what arrived (trainer/subspace.py)."""
        codec, ss = _codec(name), self.subspace
        if name == "none" and ss is None:
            return lambda t, ids=None: t

        def apply(t: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
            if ss is None:
                q = codec(t)
            elif kind == "act":
                if ids is None:
                    raise SimulationError("a subspace run's activations need their micro-batch's token ids")
                q = ss.rebuild(codec(ss.coefficients(t, ids)), ids).to(t.dtype)
            else:  # measured against U U^T g, all any upstream weight sees of g, so only the codec's error counts
                gc = ss.grad_coefficients(t)
                t, q = ss.grad_rebuild(gc).to(t.dtype), ss.grad_rebuild(codec(gc)).to(t.dtype)
            self.codec_errors[kind].append(float((q - t).norm() / t.norm().clamp_min(1e-30)))
            return q
        return apply

    # --- data -------------------------------------------------------------------------------------------------------
    def next_batch(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.streams[r].next()
        self.digests[r].update(x.numpy().tobytes())
        return x, y

    # --- replicas ---------------------------------------------------------------------------------------------------
    def combine_grads(self, s: int) -> None:
        """'grad': replace every replica's summed gradient by the mean over replicas, then step."""
        ws = [self.w[r][s] for r in range(self.R)]
        if ws[0].accumulated < self.run.optim.accumulate:
            return
        if self.R > 1:
            per = [w.grads() for w in ws]
            mean = [torch.stack(gs).mean(0) for gs in zip(*per, strict=True)]
            for w in ws:
                w.set_grads(mean)
        for w in ws:
            w.optimizer_step()

    def _draw_tau(self) -> int:
        if self.sim.tau_samples and self.spec.name != "full-avg":
            return self._tau_rng.choice(self.sim.tau_samples)
        return self.tau

    def average(self, s: int) -> None:
        """'avg'/'wagma': after a local step, apply the rounds whose delay has passed, and begin a round on every
        replica when round_steps local steps have passed since the last one began."""
        ws = [self.w[r][s] for r in range(self.R)]
        step = max(w.local_step for w in ws)  # the fastest replica's steps set the rounds' pace
        if step == self.seen_steps[s] or self.R == 1:
            return
        self.seen_steps[s] = step
        cfg = self.run.averaging
        if step - self.last_begun[s] >= cfg.round_steps:
            self.last_begun[s] = step
            self._begin(s, ws, step)
        due = [item for item in self.fifo[s] if item[0] <= step]
        self.fifo[s] = [item for item in self.fifo[s] if item[0] > step]
        for _, rn, means in due:
            self._finish(s, ws, rn, means)

    def _begin(self, s: int, ws: list[StageWorker], step: int) -> None:
        cfg = self.run.averaging
        rn = self.rounds[s]
        self.rounds[s] += 1
        sent = [[self.avg_codec(v) for v in w.averaging_begin(rn)] for w in ws]  # what each replica puts on the wire
        self._attack(sent)
        tau = self._draw_tau()
        if s == 0:
            self.delays.append(tau)
        if self.rule.groups:  # rounds are numbered consecutively here: the phase is the round number
            groups = [wagma_members(r, rn, self.R, cfg) for r in range(self.R)]
            means = [self._combine([sent[j] for j in grp], grp.index(r)) for r, grp in enumerate(groups)]
        elif (cfg.aggregator == "centered_clip" and cfg.clip_start == "own") or self.honest < self.R:
            means = [self._combine(sent, r) for r in range(self.R)]  # each replica judges the parts from its own
        else:  # honest replicas holding the same parts compute the same aggregate
            means = [self._combine(sent, 0)] * self.R
        if tau == 0:
            self._finish(s, ws, rn, means)
        else:
            self.fifo[s].append((step + tau, rn, means))

    def _finish(self, s: int, ws: list[StageWorker], rn: int, means: list[list[torch.Tensor]]) -> None:
        for w, m in zip(ws, means, strict=True):
            w.averaging_finish(rn, m)
        self.rounds_applied += 1
        if s == 0:
            self.fraction_applied += self.rule.round_fraction(self.run.averaging)

    def _attack(self, sent: list[list[torch.Tensor]]) -> None:
        """Replace the Byzantine replicas' parts (in place) by the configured attack."""
        for j in range(self.honest, self.R):
            for i in range(len(sent[j])):
                honest = torch.stack([sent[h][i] for h in range(self.honest)])
                sent[j][i] = byzantine_part(self.sim.attack, sent[j][i], honest, generator=self.attack_rng)

    def _combine(self, parts: list[list[torch.Tensor]], own: int) -> list[torch.Tensor]:
        """The daemon's round aggregation (trainer/aggregate.py: outliers dropped, honest-looking parts averaged as
        they are, the run's aggregator otherwise) over ``parts`` (one list of tensors per replica), seen by the
        replica at ``own``; every replica takes part, so the round has its full quorum."""
        ids = [f"{i:04d}" for i in range(len(parts))]
        others = {ids[i]: p for i, p in enumerate(parts) if i != own}
        values, _, _ = robust_combine(ids[own], parts[own], others, self.run.averaging, outlier_factor=OUTLIER_FACTOR,
                                      outlier_rms=OUTLIER_RMS, quorum=len(parts))
        return values

    def barrier(self, grads: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """What each replica steps with after the daemon's sync barrier (trainer/aggregate.py ``barrier_mean``: a
        far outlier among three or more dropped, the plain mean of the rest), given every replica's gradients. Every
        replica judges its own part like the others', so all of them step with the same mean."""
        if self.R == 1:
            return [grads[0]]
        ids = [f"{i:04d}" for i in range(self.R)]
        mean = barrier_mean(ids[0], grads[0], {ids[j]: g for j, g in enumerate(grads) if j}, self.run.averaging)[0]
        return [mean] * self.R

    def after_backward_sweep(self) -> None:
        for s in range(self.K):
            if self.spec.combine == Combine.GRADIENTS:
                self.combine_grads(s)
            else:
                self.average(s)

    # --- evaluation -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss (SimConfig.eval_replicas): of replica 0 holding the weights averaged over the honest
        replicas when replicas may differ, or the mean over honest replicas of each one's own."""
        if self.sim.eval_replicas == "each" and self.R > 1:
            return sum(self._val_loss(r) for r in range(self.honest)) / self.honest
        swap = self.R > 1 and self.spec.combine != Combine.GRADIENTS
        saved: list[list[torch.Tensor]] = []
        if swap:
            for s in range(self.K):
                ps = [self.w[r][s].parameters() for r in range(self.honest)]
                saved.append([p.detach().clone() for p in ps[0]])
                for j, p in enumerate(ps[0]):
                    p.copy_(torch.stack([ps[r][j] for r in range(self.honest)]).mean(0))
        try:
            return self._val_loss(0)
        finally:
            for s, copies in enumerate(saved):
                for p, v in zip(self.w[0][s].parameters(), copies, strict=True):
                    p.copy_(v)

    def _val_loss(self, r: int) -> float:
        total = 0.0
        for x, y in self.val:
            h = x
            for s in range(self.K - 1):
                h = self.w[r][s].evaluate(h)
            total += float(self.w[r][self.K - 1].evaluate(h, y))
        return total / len(self.val)

    def record(self) -> None:
        val = self.evaluate()
        train = sum(self.losses) / len(self.losses) if self.losses else float("nan")
        self.losses.clear()
        samples = sum(self.trained) * self.run.data.batch_size if self.trained else \
            self.consumed * self.R * self.run.data.batch_size
        point = {"samples": samples, "train_loss": train, "val_loss": val}
        for kind, errs in self.codec_errors.items():
            if errs:
                point[f"{kind}_codec_rel_err"] = sum(errs) / len(errs)
                errs.clear()
        self.curve.append(point)
        logger.info("%s: %d samples, train %.4f, val %.4f", self.spec.name, samples, train, val)

    # --- schedules --------------------------------------------------------------------------------------------------
    def run_async(self) -> None:
        K, N, E = self.K, self.sim.steps, self.sim.pipeline_extra
        speeds = self.sim.speeds or (1.0,) * self.R
        quota = [max(1, round(N * f)) for f in speeds]  # micro-batches replica r trains on
        clock = [0] * self.R  # replica r's own tick
        self.trained = [0] * self.R
        outs: list[list[Any]] = [[None] * K for _ in range(self.R)]  # stage s's output of the previous tick
        targets: list[dict[int, torch.Tensor]] = [{} for _ in range(self.R)]
        # the last stage's input gradients, held E ticks
        held: list[dict[int, torch.Tensor | None]] = [{} for _ in range(self.R)]
        T = 0
        while any(clock[r] < quota[r] + K - 1 + E for r in range(self.R)):
            for r in range(self.R):
                f = speeds[r]
                if clock[r] >= quota[r] + K - 1 + E or int((T + 1) * f + 1e-9) == int(T * f + 1e-9):
                    continue  # done, or idle at this tick (a slower replica)
                t, n_r = clock[r], quota[r]
                clock[r] += 1
                self.trained[r] = min(t + 1, n_r)
                w = self.w[r]
                mb = t - (K - 1)
                if 0 <= mb < n_r:  # last stage: forward + loss + backward of micro-batch t - (K - 1), delay 0
                    if K == 1:
                        x, y = self.next_batch(r)
                    else:
                        x, y = outs[r][K - 2], targets[r].pop(mb)
                        self.ids[r].pop(mb)
                    loss, held[r][mb] = w[K - 1].forward_loss(mb, x, y)
                    self.losses.append(loss)
                for s in range(K - 2, -1, -1):  # forwards, deepest first so each reads the previous tick's output
                    m = t - s
                    if 0 <= m < n_r:
                        if s == 0:
                            inp, targets[r][m] = self.next_batch(r)
                            self.ids[r][m] = inp
                        else:
                            inp = outs[r][s - 1]
                        outs[r][s] = self.act(w[s].forward(m, inp), self.ids[r][m])
                back = t - (K - 1) - E
                if back >= 0:  # backward sweep of micro-batch ``back``: stage s's forward ran K - 1 - s + E ticks ago
                    grad = held[r].pop(back)
                    for s in range(K - 2, -1, -1):
                        assert grad is not None  # stage 0, the only one to return None, is the last to run
                        grad = w[s].backward(back, self.grad(grad))
            self.after_backward_sweep()
            if T < N:
                self.consumed = T + 1
                if self.consumed % self.sim.eval_every == 0 and self.consumed < N:
                    self.record()
            T += 1
        self.record()

    def run_sync(self) -> None:
        K, M = self.K, self.sim.micro_batches
        for step in range(self.sim.steps // M):
            for r in range(self.R):
                w = self.w[r]
                for i in range(M):
                    mb = step * M + i
                    h, y = self.next_batch(r)
                    ids = h
                    for s in range(K - 1):
                        h = self.act(w[s].forward(mb, h), ids)
                    loss, grad = w[K - 1].forward_loss(mb, h, y)
                    self.losses.append(loss)
                    for s in range(K - 2, -1, -1):
                        assert grad is not None  # stage 0, the only one to return None, is the last to run
                        grad = w[s].backward(mb, self.grad(grad))
            for s in range(K):  # flush: the barrier's mean over replicas of the micro-batch means, then one step
                ws = [self.w[r][s] for r in range(self.R)]
                for worker, mean in zip(ws, self.barrier([w.mean_grads() for w in ws]), strict=True):
                    worker.set_grads(mean)
                    worker.optimizer_step()
            before = self.consumed
            self.consumed += M
            if self.consumed // self.sim.eval_every > before // self.sim.eval_every and self.consumed < self.sim.steps:
                self.record()
        self.record()


@dataclass(frozen=True)
class _Knobs:
    """What a method's configure() may read: the simulation knobs with this variant's tau."""

    sim: SimConfig
    tau: int

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sim, name)


def run_method(sim: SimConfig, name: str, method: str, tau: int) -> dict[str, Any]:
    """Train one method (variant ``name``) and return its result record (JSON-able)."""
    torch.set_num_threads(1)
    use_tf32_on_gpu(sim.device)
    torch.manual_seed(sim.run.seed)
    corpus = load_corpus(sim.run.data, sim.run.model.vocab_size)
    val = val_batches(corpus, sim.run.model.block_size, sim.run.data.batch_size, sim.eval_batches)
    spec = METHODS[method]
    t0 = time.perf_counter()
    state = _Run(sim, spec, tau, corpus, val)
    state.run_async() if spec.schedule == "async" else state.run_sync()
    final = state.curve[-1]
    first = state.curve[0]
    return {
        "name": name, "method": method, "tau": tau if spec.combine == Combine.PARAMETERS else None,
        "summary": spec.summary,
        "final_val_loss": final["val_loss"], "first_val_loss": first["val_loss"],
        "final_train_loss": final["train_loss"],
        "samples": final["samples"], "updates": state.w[0][0].local_step,
        "averaging_rounds_applied": state.rounds_applied,
        "avg_fraction_per_step": (state.fraction_applied / state.w[0][0].local_step
                                  if spec.combine == Combine.PARAMETERS and state.w[0][0].local_step else None),
        "avg_delay_steps": (sum(state.delays) / len(state.delays)) if state.delays else None,
        "steps_skipped": sum(w.steps_skipped for row in state.w for w in row),
        "compute_s": round(time.perf_counter() - t0, 2),
        "data_digests": [d.hexdigest()[:16] for d in state.digests],
        "data": corpus_identity(corpus),
        "curve": state.curve,
    }
