"""Simulation presets (smoke, paper, stress) and the driver that runs every method and writes the outputs.

* **smoke** — seconds: a 2-stage x 2-replica toy with every method; what CI runs.
* **paper** — the AsyncMesh "4 x 2 mesh" (4 stages x 2 replicas) on a small byte-level GPT of the default corpus,
  3,000 steps, tau 10, p 0.05, every method; sized to finish in about 30 minutes on 2 CPU cores.
* **stress** — 8 stages x 2 replicas, the tau-dependent methods at tau 10 and 50: where each method degrades.
* **base** — AsyncPP's base scale for a GPU (``--device cuda``): 8 layers of width 768 (12 heads), 8 stages of one
  layer, context 512, 8 sequences per micro-batch, lr 3e-4, one replica (a pure pipeline), fullsync vs asyncpp vs
  naive-async. The paper's model with our byte vocabulary (256) instead of GPT-2's, so ~57 M parameters, not 134 M.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import multiprocessing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.config import RunConfig
from trainer.sim.methods import method_names
from trainer.sim.report import write_outputs
from trainer.sim.simulator import SimConfig, run_method

logger = logging.getLogger(__name__)

PRESETS = ("smoke", "paper", "stress", "base")


def _run(n_stages: int, n_layer: int, n_embd: int, n_head: int, block: int, batch: int, lr: float, warmup: int,
         steps: int, max_bytes: int, mu_warmup: int) -> RunConfig:
    return RunConfig.default().replace(
        name="sim", n_stages=n_stages,
        model={"n_layer": n_layer, "n_embd": n_embd, "n_head": n_head, "block_size": block, "vocab_size": 256},
        optim={"lr": lr, "warmup_steps": warmup, "total_steps": steps},
        averaging={"mu_warmup_steps": mu_warmup, "round_steps": 1},  # the paper: a round every local step
        compression={"activations": "none", "gradients": "none", "averaging": "none"},
        data={"batch_size": batch, "max_bytes": max_bytes},
    )


def preset(name: str) -> SimConfig:
    """The named preset's SimConfig (override fields with dataclasses.replace / with_overrides)."""
    if name == "smoke":
        return SimConfig(preset="smoke", run=_run(2, 2, 32, 2, 32, 4, 3e-3, 8, 64, 400_000, 16), n_replicas=2,
                         steps=64, micro_batches=4, tau=4, fraction=0.25, accumulate=2, eval_every=32,
                         eval_batches=2, methods=method_names())
    if name == "paper":
        return SimConfig(preset="paper", run=_run(4, 4, 64, 4, 64, 8, 1e-3, 150, 3000, 8_000_000, 1000),
                         n_replicas=2, steps=3000, micro_batches=4, tau=10, fraction=0.05, accumulate=4,
                         eval_every=250, eval_batches=8, methods=_paper_order())
    if name == "stress":
        return SimConfig(preset="stress", run=_run(8, 8, 64, 4, 64, 8, 1e-3, 100, 1000, 8_000_000, 300),
                         n_replicas=2, steps=1000, micro_batches=4, tau=10, taus=(10, 50), fraction=0.05,
                         accumulate=4, eval_every=200, eval_batches=8,
                         methods=("fullsync", "naive-async", "asyncpp", "asyncmesh", "async-sparta", "delta"))
    if name == "base":
        return SimConfig(preset="base", run=_run(8, 8, 768, 12, 512, 8, 3e-4, 300, 3000, 0, 1000), n_replicas=1,
                         steps=3000, micro_batches=4, tau=10, fraction=0.05, accumulate=4, eval_every=250,
                         eval_batches=16, methods=("fullsync", "asyncpp", "naive-async"))
    raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")


def _paper_order() -> tuple[str, ...]:
    """Methods the claims need first, so a stopped run still answers them."""
    first = ("fullsync", "asyncmesh", "async-sparta", "asyncpp", "naive-async")
    return first + tuple(m for m in method_names() if m not in first)


def with_overrides(sim: SimConfig, *, stages: int | None = None, replicas: int | None = None,
                   steps: int | None = None, tau: int | None = None, taus: tuple[int, ...] | None = None,
                   fraction: float | None = None, methods: tuple[str, ...] | None = None,
                   compression: dict[str, str] | None = None, lr: float | None = None,
                   eval_every: int | None = None, seed: int | None = None, device: str | None = None,
                   byzantine: int | None = None, attack: str | None = None,
                   aggregator: str | None = None) -> SimConfig:
    """Apply command-line overrides; the schedule length follows ``steps`` and the layer count the stages."""
    run = sim.run
    kw: dict[str, Any] = {}  # SimConfig fields to replace (the dataclass checks them)
    if stages is not None:
        run = run.replace(n_stages=stages, model={"n_layer": max(run.model.n_layer, stages)})
    if steps is not None:
        warm = min(run.optim.warmup_steps, max(0, steps // 10))
        run = run.replace(optim={"total_steps": steps, "warmup_steps": warm},
                          averaging={"mu_warmup_steps": min(run.averaging.mu_warmup_steps, steps // 3)})
        kw["steps"] = steps
        kw["eval_every"] = min(sim.eval_every, steps)
    if lr is not None:
        run = run.replace(optim={"lr": lr})
    if compression:
        run = run.replace(compression=compression)
    if seed is not None:
        run = run.replace(seed=seed)
    if aggregator is not None:
        run = run.replace(averaging={"aggregator": aggregator})
    for key, value in (("n_replicas", replicas), ("tau", tau), ("taus", taus), ("fraction", fraction),
                       ("methods", methods), ("eval_every", eval_every), ("device", device),
                       ("byzantine", byzantine), ("attack", attack)):
        if value is not None:
            kw[key] = value
    return dataclasses.replace(sim, run=run, **kw)


def run_simulation(sim: SimConfig, out: Path, *, jobs: int = 1,
                   on_result: Callable[[dict[str, Any]], None] | None = None,
                   wallclock: Callable[[list[dict[str, Any]]], dict[str, Any] | None] | None = None,
                   ) -> list[dict[str, Any]]:
    """Run every method variant (``jobs`` at a time in worker processes) and write the outputs after each."""
    variants = sim.variants()
    results: list[dict[str, Any]] = []
    order = {name: i for i, (name, _, _) in enumerate(variants)}

    def done(rec: dict[str, Any]) -> None:
        results.append(rec)
        results.sort(key=lambda r: order[r["name"]])
        if on_result:
            on_result(rec)
        write_outputs(out, sim.to_dict(), results, wallclock(results) if wallclock else None)

    if jobs <= 1:
        for name, method, tau in variants:
            done(run_method(sim, name, method, tau))
        return results
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futures = [pool.submit(run_method, sim, name, method, tau) for name, method, tau in variants]
        for fut in cf.as_completed(futures):
            done(fut.result())
    return results
