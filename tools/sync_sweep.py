#!/usr/bin/env python3
"""The synchronous baseline's best shot: the simulator's ``fullsync`` over learning rates and optimisers.

``python tools/sync_sweep.py --run tests/runs/tiny.toml --steps 800 --json docs/bench/sync_sweep.json`` trains the
run's model as GPipe (M micro-batches per flush, gradients averaged over R replicas every step) once per
(optimiser, lr): AdamW beta1 0.9 (the papers' baseline) and NAdam beta1 0.99 (the asynchronous methods' optimiser),
each at every ``--lrs`` value, with the warm-up and schedule counted in samples as the daemon's ``--mode sync`` does
(trainer.sim.methods.fullsync_optim). It reports each variant's final validation loss and the best; the daemon takes
the chosen values with ``--set sync_optimizer=... --set sync_lr=...``. In-process and exact, so a sweep takes
minutes where the daemon would take hours.

``--method asyncmesh`` sweeps the asynchronous side the same way, for a comparison that tunes both sides: the run's
own optimiser (NAdam beta1 0.99 in the shipped runs) at every ``--lrs`` value, PipeDream's 1F1B staleness plus
``--pipeline-extra`` ticks, and averaging rounds delayed by ``--tau`` local steps (a daemon's summaries say what its
peers measured: ``avg_delay_steps``); ``--optimizers`` does not apply there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.config import RunConfig  # noqa: E402
from trainer.sim.simulator import SimConfig, run_method  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, required=True, help="run TOML (the daemon's)")
    p.add_argument("--replicas", type=int, default=2, help="replicas R per stage")
    p.add_argument("--steps", type=int, default=800, help="micro-batches per replica (a multiple of M)")
    p.add_argument("--micro-batches", type=int, default=4, help="M, micro-batches per flush (sync_microbatches)")
    p.add_argument("--lrs", type=float, nargs="+", default=None, help="peak learning rates (default: run's x 1/3..3)")
    p.add_argument("--optimizers", nargs="+", default=["adamw", "nadam"], choices=["adamw", "nadam"])
    p.add_argument("--method", default="fullsync", choices=["fullsync", "asyncmesh"],
                   help="the simulator's method to sweep (asyncmesh: the run's optimiser, --lrs only)")
    p.add_argument("--tau", type=int, default=1, help="asyncmesh: averaging delay in local steps")
    p.add_argument("--pipeline-extra", type=int, default=0,
                   help="asyncmesh: ticks of staleness beyond 1F1B's K - 1 - s (stage 0 keeping W in flight: W - K)")
    p.add_argument("--eval-batches", type=int, default=4, help="validation batches per evaluation")
    p.add_argument("--device", default="cpu", help="torch device of every simulated worker ('cpu', 'cuda')")
    p.add_argument("--seed", type=int, default=None, help="the run's seed (init and data; default: the run file's)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = RunConfig.from_toml(args.run)
    if args.seed is not None:
        run = run.replace(seed=args.seed)
    lrs = args.lrs or [run.optim.lr * f for f in (1 / 3, 2 / 3, 1.0, 1.5, 3.0)]
    steps = args.steps // args.micro_batches * args.micro_batches
    results = []
    started = time.time()
    asynchronous = args.method != "fullsync"
    for opt in [run.optim.optimizer] if asynchronous else args.optimizers:
        for lr in lrs:
            sim = SimConfig(preset="sync-sweep", run=run.replace(optim={"lr": lr}) if asynchronous else run,
                            n_replicas=args.replicas, steps=steps, micro_batches=args.micro_batches,
                            accumulate=args.micro_batches,
                            eval_every=max(args.micro_batches, steps // 8 // args.micro_batches * args.micro_batches),
                            eval_batches=args.eval_batches, methods=(args.method,), sync_optimizer=opt, sync_lr=lr,
                            device=args.device, tau=args.tau, pipeline_extra=args.pipeline_extra)
            rec = run_method(sim, args.method, args.method, args.tau)
            results.append({"optimizer": opt, "lr": lr, "final_val_loss": rec["final_val_loss"],
                            "curve": [(p["samples"], p["val_loss"]) for p in rec["curve"]],
                            "compute_s": rec["compute_s"]})
            print(f"{args.method} {opt:5s} lr {lr:.2e}: final val loss {rec['final_val_loss']:.4f}", flush=True)
    best = min(results, key=lambda r: r["final_val_loss"])
    doc = {"run": str(args.run), "method": args.method, "seed": run.seed, "run_id": run.run_id,
           "replicas": args.replicas, "n_stages": run.n_stages, "steps_per_replica": steps, "device": args.device,
           "micro_batches": args.micro_batches, "results": results,
           **({"tau": args.tau, "pipeline_extra": args.pipeline_extra} if asynchronous else {}),
           "best": {k: best[k] for k in ("optimizer", "lr", "final_val_loss")},
           "meta": {"command": " ".join(["python tools/sync_sweep.py", *(argv if argv is not None else sys.argv[1:])]),
                    "nproc": os.cpu_count(), "loadavg_end": os.getloadavg(), "elapsed_s": time.time() - started}}
    print(json.dumps(doc["best"]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
