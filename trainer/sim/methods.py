"""The methods the simulator compares, each a (schedule, replica-combination, run overrides) triple.

Every method trains the same model from the same seeded init on the same per-replica token streams; only the
schedule, the optimiser and the data-parallel rule differ. Choices the papers leave open, stated here once:

* **fullsync** — GPipe with ``M`` micro-batches and a flush per step; gradients summed over the ``M`` micro-batches,
  averaged over the replicas every step (one shared model); AdamW, beta1 0.9. It makes ``M x`` fewer optimiser steps
  than the asynchronous methods for the same samples, exactly as the papers' GPipe baseline does, so its warm-up and
  schedule length are counted in its own steps (``warmup / M``, ``steps / M``).
* **naive-async** — the asynchronous 1F1B pipeline with no delay correction at all: AdamW, beta1 0.9 on every stage,
  no weight stashing (backward through the latest weights), no look-ahead.
* **asyncpp** — AsyncPP: NAdam beta1 0.99 (the Nesterov look-ahead) with weight stashing.
* **asyncpp-nows** — AsyncPP without stashing, stage-dependent beta1 (0.99 at stage 0 down to 0.9 at the last).
* For these pure pipeline methods (and **accum**) the replicas are combined by **synchronous gradient averaging**
  every optimiser step (PipeDream's hybrid with DDP): replicas stay identical, so the asynchrony measured is the
  pipeline's alone. (Parameter averaging with p = 1, tau = 0 is the separate method full-avg.)
* **asyncmesh** — asyncpp + sparse averaging of p = 5 % of each stage's weights per step, applied tau steps late with
  the EMA drift correction (rule 'ema'). **async-sparta** (rule 'avg', stale overwrite) and **delta** (rule 'delta',
  a + lam * drift) differ from it only in the rule; **full-avg** averages all weights every step with no delay.
* **wagma** — asyncpp + WAGMA group model averaging (Li et al.): each round every replica publishes its weights, and
  tau steps later (the network's delay) takes the mean of its *current* weights and its group partners' published
  ones, w <- (w + sum of the partners') / G; every ``wagma_global_every``-th round (tau + 1 = 11 in the paper) is a
  global average over all replicas, applied as a correction (mean then + own drift since), as the daemon must.
* **accum** — Aji & Heafield: AdamW (beta1 0.9) with weight stashing (the gradient is computed at the weights the
  forward saw, as a parameter server's stale fetch), each stage summing ``A`` asynchronous gradients before one
  optimiser step; replicas combined by gradient averaging at each applied step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from trainer.config import OptimConfig, RunConfig

#: the synchronous baseline's beta1 for each optimiser it may use: AdamW's usual 0.9 (the papers' GPipe baseline),
#: NAdam's 0.99 (the asynchronous methods' look-ahead, for a sweep that gives the baseline every chance)
FULLSYNC_BETA1 = {"adamw": 0.9, "nadam": 0.99}


class SimKnobs(Protocol):
    """The simulation knobs a method's ``configure`` reads (the simulator's SimConfig provides them; a Protocol so
    this module need not import the simulator, which imports it)."""

    @property
    def micro_batches(self) -> int: ...
    @property
    def accumulate(self) -> int: ...
    @property
    def fraction(self) -> float: ...
    @property
    def sync_optimizer(self) -> str: ...
    @property
    def sync_lr(self) -> float | None: ...


class Combine(StrEnum):
    """How a method's replicas are brought together (not to be read as an averaging rule: ``rule`` names that)."""

    GRADIENTS = "gradients"
    """Synchronous gradient averaging at every applied step."""
    PARAMETERS = "parameters"
    """Parameter averaging by the method's averaging ``rule`` (trainer/rules.py)."""


@dataclass(frozen=True)
class MethodSpec:
    """How one method trains: schedule ('sync' GPipe or 'async' 1F1B) and replica combination (``Combine``);
    ``configure(run, sim)`` returns the method's run config from the simulation's base run."""

    name: str
    schedule: str
    combine: Combine
    configure: Callable[[RunConfig, SimKnobs], RunConfig]
    summary: str
    rule: str = "none"
    """The averaging rule of PARAMETERS methods (trainer/rules.py), whose flags say what the simulator does with it."""


def _pipeline_only(run: RunConfig, **optim: object) -> RunConfig:
    return run.replace(optim=optim, averaging={"rule": "none"})


def fullsync_optim(optim: OptimConfig, micro_batches: int, *, optimizer: str = "adamw",
                   lr: float | None = None) -> OptimConfig:
    """The synchronous baseline's optimiser from the run's: ``optimizer`` with its beta1 (FULLSYNC_BETA1), no
    stashing, one step per flush of ``micro_batches``, so the warm-up and the schedule are the run's divided by M:
    the same samples per replica as the asynchronous methods' (one step per micro-batch). ``lr``: the peak learning
    rate (None: the run's). The simulator's fullsync and the daemon's ``--mode sync`` both use it."""
    if optimizer not in FULLSYNC_BETA1:
        raise ValueError(f"the synchronous baseline's optimizer must be one of {sorted(FULLSYNC_BETA1)}, "
                         f"got {optimizer!r}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    m = micro_batches
    beta1 = FULLSYNC_BETA1[optimizer]  # on every stage: without stashing the run's beta1 would depend on the stage
    return dataclasses.replace(optim, optimizer=optimizer, beta1=beta1, nows_beta1_first=beta1, nows_beta1_last=beta1,
                               weight_stashing=False, accumulate=1, lr=optim.lr if lr is None else lr,
                               warmup_steps=optim.warmup_steps // m, total_steps=max(1, optim.total_steps // m))


def _fullsync(run: RunConfig, sim: SimKnobs) -> RunConfig:
    optim = fullsync_optim(run.optim, sim.micro_batches, optimizer=sim.sync_optimizer, lr=sim.sync_lr)
    return run.replace(optim=optim, averaging={"rule": "none"})


def _naive(run: RunConfig, sim: SimKnobs) -> RunConfig:
    return _pipeline_only(run, optimizer="adamw", beta1=0.9, weight_stashing=False, accumulate=1,
                          nows_beta1_first=0.9, nows_beta1_last=0.9)


def _asyncpp(run: RunConfig, sim: SimKnobs) -> RunConfig:
    return _pipeline_only(run, optimizer="nadam", beta1=0.99, weight_stashing=True, accumulate=1)


def _asyncpp_nows(run: RunConfig, sim: SimKnobs) -> RunConfig:
    return _pipeline_only(run, optimizer="nadam", weight_stashing=False, accumulate=1,
                          nows_beta1_first=0.99, nows_beta1_last=0.9)


def _sparse(rule: str, *, full: bool = False) -> Callable[[RunConfig, SimKnobs], RunConfig]:
    def configure(run: RunConfig, sim: SimKnobs) -> RunConfig:
        run = run.replace(optim={"optimizer": "nadam", "beta1": 0.99, "weight_stashing": True, "accumulate": 1})
        # the cadence (round_steps) is the base run's, as the daemon runs it; full-avg averages everything each step
        avg: dict[str, Any] = {"rule": rule, "fraction": 1.0 if full else sim.fraction}
        return run.replace(averaging=avg | ({"round_steps": 1} if full else {}))
    return configure


def _accum(run: RunConfig, sim: SimKnobs) -> RunConfig:
    a = sim.accumulate
    return _pipeline_only(run, optimizer="adamw", beta1=0.9, weight_stashing=True, accumulate=a,
                          warmup_steps=run.optim.warmup_steps // a, total_steps=max(1, run.optim.total_steps // a))


GRADIENTS, PARAMETERS = Combine.GRADIENTS, Combine.PARAMETERS
METHODS: dict[str, MethodSpec] = {m.name: m for m in (
    MethodSpec("fullsync", "sync", GRADIENTS, _fullsync,
               "GPipe M micro-batches + flush, gradient all-reduce, AdamW 0.9"),
    MethodSpec("naive-async", "async", GRADIENTS, _naive, "async 1F1B, AdamW 0.9, no stashing, no look-ahead"),
    MethodSpec("asyncpp", "async", GRADIENTS, _asyncpp, "async 1F1B, NAdam 0.99 + weight stashing"),
    MethodSpec("asyncpp-nows", "async", GRADIENTS, _asyncpp_nows, "async 1F1B, NAdam, no stashing, beta1 0.99->0.9"),
    MethodSpec("asyncmesh", "async", PARAMETERS, _sparse("ema"), "asyncpp + sparse averaging, EMA drift correction",
               "ema"),
    MethodSpec("async-sparta", "async", PARAMETERS, _sparse("avg"), "asyncpp + sparse averaging, stale overwrite",
               "avg"),
    MethodSpec("delta", "async", PARAMETERS, _sparse("delta"), "asyncpp + sparse averaging, a + lambda * drift",
               "delta"),
    MethodSpec("full-avg", "async", PARAMETERS, _sparse("full", full=True),
               "asyncpp + full averaging every step, tau 0", "full"),
    MethodSpec("wagma", "async", PARAMETERS, _sparse("wagma"), "asyncpp + WAGMA group averaging, global every 11",
               "wagma"),
    MethodSpec("accum", "async", GRADIENTS, _accum, "async 1F1B, AdamW 0.9 + stashing, sum A gradients per step"),
)}


def method_names() -> tuple[str, ...]:
    return tuple(METHODS)


def parse_methods(text: str) -> tuple[str, ...]:
    """'all' or a comma-separated list of method names; raises ValueError naming the unknown ones."""
    if text.strip() == "all":
        return method_names()
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in METHODS]
    if unknown or not names:
        raise ValueError(f"unknown method(s) {unknown or [text]}; choose from {', '.join(METHODS)} or 'all'")
    return names
