"""The memory a peer may use and the stages that fit in it.

The limit is, in this order: ``--memory-gb`` given by the operator; on a CUDA device the GPU's free memory
(``torch.cuda.mem_get_info``, read once before the peer allocates anything); on the CPU the machine's available
memory (``MemAvailable``). A stage fits when ``trainer.memory.HEADROOM`` times its estimate (``trainer.memory``, at
this peer's precision and micro-batches in flight) is at most the limit: on a GPU only what the device holds counts;
on the CPU the host-only part too, and the copy of the neighbour stage's state (weights, optimiser and EMA state)
that a peer without a checkpoint folder keeps in memory for the swarm (peer/state/spare.py). With re-checks on,
the held copies a stage re-computes its neighbours' work with are built on its device and count too
(``recheck_stages``: the next stage's weights for every stage but the last, stage 0's for stage 1); on the CPU a
copy that is also the neighbour copy kept in memory shares its tensors and counts once. Stage choice and
rebalancing never pick a stage outside ``fitting`` (``peer.membership.stage_choice``); a fixed ``--stage`` that does
not fit, or a run of which no stage fits, is refused at start with what fits and what to do.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from peer.errors import UserError
from trainer.config import RunConfig
from trainer.memory import HEADROOM, GiB, StageMemory, estimate_stage
from trainer.rules import rule_of

logger = logging.getLogger(__name__)


def memory_limit(device: str, memory_gb: float) -> tuple[int | None, str]:
    """(bytes this peer may use, where the figure comes from); None when it cannot be known (no check then)."""
    if memory_gb > 0:
        return int(memory_gb * GiB), "--memory-gb"
    if device.startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        return int(free), "free GPU memory"
    available = _available_ram()
    return (available, "available RAM") if available is not None else (None, "unknown")


def _available_ram() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def gib(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / GiB:.2f} GiB" if n >= GiB // 10 else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class MemoryBudget:
    """Every stage's estimate at this peer's precision against the memory it may use."""

    limit_bytes: int | None
    source: str
    device_type: str
    precision: str
    estimates: tuple[StageMemory, ...]
    spare_bytes: tuple[int, ...] = ()
    """Per stage: the neighbour stage's state kept in host memory while serving it (0: kept on disk, or none)."""
    copy_bytes: tuple[int, ...] = ()
    """Per stage: the weights of the held copies its re-checks compute with, on its device (none: re-checks off)."""
    shared_bytes: tuple[int, ...] = ()
    """Per stage, on the CPU: the part of ``copy_bytes`` that is the neighbour copy kept in memory (counted once)."""

    def needs(self, stage: int) -> int:
        """Bytes ``stage`` needs on this peer (before the headroom)."""
        cpu = self.device_type == "cpu"
        spare = self.spare_bytes[stage] if cpu and self.spare_bytes else 0
        copies = self.copy_bytes[stage] if self.copy_bytes else 0
        shared = self.shared_bytes[stage] if cpu and self.spare_bytes and self.shared_bytes else 0
        return self.estimates[stage].needs(self.device_type) + spare + copies - shared

    def fits(self, stage: int) -> bool:
        return self.limit_bytes is None or self.needs(stage) * HEADROOM <= self.limit_bytes

    @property
    def fitting(self) -> tuple[int, ...] | None:
        """The stages this peer can hold; None when there is no estimate (every stage is taken to fit)."""
        if not self.estimates:
            return None
        return tuple(s for s in range(len(self.estimates)) if self.fits(s))

    def describe_limit(self) -> str:
        return f"{gib(self.limit_bytes)} ({self.source})"

    def check_stage(self, stage: int | None) -> None:
        """UserError when ``stage`` (None: any stage) cannot be held, naming what fits and what to do."""
        fitting = self.fitting
        if fitting is None:
            return
        need = {s: gib(int(self.needs(s) * HEADROOM)) for s in range(len(self.estimates))}
        needs = ", ".join(f"stage {s} {n}" for s, n in need.items())
        remedies = ("free memory on this machine, use --precision bf16 (autocast; on a GPU by default), lower "
                    "max_inflight (--set max_inflight=N), or set --memory-gb if the detected figure is wrong")
        if not fitting:
            raise UserError(f"no stage of this run fits in the memory this peer may use, {self.describe_limit()}; "
                            f"needed at {self.precision} with {round(HEADROOM * 100 - 100)} % headroom: {needs}. "
                            f"Run on a machine with more memory, {remedies}; or ask the organiser for a run with more "
                            "stages (asyncmesh-peer memory --run FILE shows the estimate)")
        if stage is not None and not self.fits(stage):
            ok = ", ".join(map(str, fitting))
            raise UserError(f"--stage {stage} needs {need[stage]} at {self.precision} (with "
                            f"{round(HEADROOM * 100 - 100)} % headroom) but this peer may use "
                            f"{self.describe_limit()}; "
                            f"stages that fit: {ok}. Pass --stage {fitting[0]} or --stage auto, or {remedies}")

    def as_dict(self, stage: int | None = None) -> dict[str, object]:
        """The figures the dashboard and ``/status`` show (``stage``: the one served now)."""
        return {"limit_bytes": self.limit_bytes, "limit_source": self.source, "precision": self.precision,
                "device_type": self.device_type, "headroom": HEADROOM,
                "stage_bytes": [self.needs(s) for s in range(len(self.estimates))],
                "fits": None if self.fitting is None else list(self.fitting),
                "estimate_bytes": None if stage is None or not 0 <= stage < len(self.estimates) else self.needs(stage)}


def recheck_stages(n_stages: int, stage: int) -> tuple[int, ...]:
    """The stages whose held copies a peer of ``stage`` re-computes with: the next stage's work (gradient and
    middle-stage re-checks, every stage but the last) and stage 0's forwards (stage 1): the copies
    ``peer.pipeline.checks.neighbour_checks`` builds."""
    return tuple(s for s in ((stage + 1) if stage <= n_stages - 2 else None, 0 if stage == 1 else None)
                 if s is not None)


def plan(run: RunConfig, *, device: str, precision: str, inflight: int, memory_gb: float = 0.0,
         spare_in_memory: bool = False, rechecks: bool = True) -> MemoryBudget:
    """Estimate every stage for this peer and read its limit (``precision`` resolved already: 'fp32' or 'bf16');
    ``spare_in_memory``: the peer keeps its copy of the neighbour stage in memory (backups on, no checkpoint
    folder); ``rechecks``: it re-checks its neighbours' work from held copies (on by default, as in the peer)."""
    limit, source = memory_limit(device, memory_gb)
    try:
        estimates = tuple(estimate_stage(run, s, precision=precision, inflight=inflight) for s in range(run.n_stages))
    except Exception as e:  # a model the meta/fake-tensor build cannot handle: train unchecked rather than not at all
        logger.warning("memory estimate failed (%r): every stage is taken to fit; check with asyncmesh-peer memory", e)
        estimates, limit, source = (), None, "unknown: the estimate failed"
    spare: tuple[int, ...] = ()
    if spare_in_memory and estimates and run.n_stages > 1:
        def state_bytes(e: StageMemory) -> int:
            return e.weights + e.optimizer + (e.weights if rule_of(run.averaging).ema else 0)
        spare = tuple(state_bytes(estimates[(s + 1) % run.n_stages]) for s in range(run.n_stages))
    copies: tuple[int, ...] = ()
    shared: tuple[int, ...] = ()
    if rechecks and estimates:
        n = run.n_stages
        copies = tuple(sum(estimates[k].weights for k in recheck_stages(n, s)) for s in range(n))
        shared = tuple(estimates[(s + 1) % n].weights if (s + 1) % n in recheck_stages(n, s) else 0 for s in range(n))
    budget = MemoryBudget(limit, source, "cuda" if device.startswith("cuda") else "cpu", precision, estimates, spare,
                          copies, shared)
    if estimates:
        logger.info("memory: may use %s; stages need %s at %s; fitting: %s", budget.describe_limit(),
                    ", ".join(gib(budget.needs(s)) for s in range(run.n_stages)), precision, budget.fitting)
    return budget
