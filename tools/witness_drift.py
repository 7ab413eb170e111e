"""How far apart honest replicas of a stage are, tensor by tensor, as a state's witnesses measure it.

A loaded state is witnessed per tensor (peer.state.witness): its relative distance from a witness's own state,
``|a - b| / max(|a|, |b|, floor x sqrt(numel))``, must stay within ``tensor_tolerance`` (0.5). Early in training
small tensors (zero-initialised biases, a position embedding initialised at 0.02 rms) move far relative to their own
norm, and honest replicas read as far apart. This tool trains replicas with the simulator (the daemon's averaging
code, replicas at different speeds as a daemon's are) and, at every evaluation, reads the exact distance between
replica 0 and every other replica, on every stage, under several floors: the fixed ``RMS_FLOOR`` everywhere, and
(the witnesses' rule, ``peer.state.digest.witness_floors``) k x the run's peak learning rate for the tensors the
seeded init sets to zero. It also measures what a floor lets a liar do: replica 0's validation loss with its
tensors pushed, in a random direction, as far as the tolerance allows (every tensor, or only the zero-initialised
ones: what their floor adds). In a subspace run the embedding tables are measured on their trained part, as the
witnesses measure them (their fixed part F left out of the scale); ``tables_max`` is the largest such distance.

    python tools/witness_drift.py --run tests/runs/tiny.toml --steps 400 --eval-every 20 --speeds 1,0.5 \
        --json docs/bench/witness_drift_tiny.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peer.state.digest import FLOOR_LR_STEPS, RMS_FLOOR  # noqa: E402
from peer.state.sync import StateSyncConfig  # noqa: E402
from peer.state.witness import sanitize  # noqa: E402
from trainer.config import RunConfig  # noqa: E402
from trainer.data import load_corpus, val_batches  # noqa: E402
from trainer.model import starts_at_zero  # noqa: E402
from trainer.sim import simulator as sim_mod  # noqa: E402
from trainer.sim.methods import METHODS  # noqa: E402
from trainer.subspace import fixed_tables  # noqa: E402


def distance(a: torch.Tensor, b: torch.Tensor, floor: float, fixed: torch.Tensor | None = None) -> float:
    """The witness's relative distance of two tensors, exactly (the witness reads it through a sketch); ``fixed``:
    the part both hold that nobody trains (a subspace run's fixed table), left out of the scale as the witness does."""
    a, b = a.double(), b.double()
    fa, fb = (a, b) if fixed is None else (a - fixed.double(), b - fixed.double())
    scale = max(float(fa.norm()), float(fb.norm()), floor * math.sqrt(a.numel()))
    return float((a - b).norm()) / scale if scale > 0 else 0.0


def floor_of(name: str, k: float | None, lr: float) -> float:
    """Tensor ``name``'s floor (rms per coordinate): ``k`` x ``lr`` if the seeded init sets it to zero (the
    witnesses' rule at ``k`` = FLOOR_LR_STEPS), ``RMS_FLOOR`` otherwise or when ``k`` is None (the fixed floor)."""
    return max(RMS_FLOOR, k * lr) if k is not None and starts_at_zero(name) else RMS_FLOOR


def pushed_loss(state: Any, k: float | None, lr: float, tolerance: float, seed: int, *, zero_init_only: bool) -> float:
    """Replica 0's validation loss with tensors of every stage moved by ``tolerance`` x their witness scale (own
    norm, or the floor where larger) in a random direction: the most the witnesses let through on each one, on
    every tensor or only on those the init sets to zero (what a floor of their own adds)."""
    g = torch.Generator().manual_seed(seed)
    saved = [{n: v.detach().clone() for n, v in w.model.state_dict().items()} for w in state.w[0]]
    try:
        for s, w in enumerate(state.w[0]):
            fixed = fixed_tables(state.run, s)
            with torch.no_grad():
                for name, p in w.model.named_parameters():
                    if zero_init_only and not starts_at_zero(name):
                        continue
                    noise = torch.randn(p.shape, generator=g).to(p.dtype)
                    own = p if name not in fixed else p - fixed[name].to(p.device, p.dtype)
                    scale = max(float(own.norm()), floor_of(name, k, lr) * math.sqrt(p.numel()))
                    p.add_(noise * (tolerance * scale / max(float(noise.norm()), 1e-30)))
        return round(float(state._val_loss(0)), 4)
    finally:
        for w, sd in zip(state.w[0], saved, strict=True):
            w.model.load_state_dict(sd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default="tests/runs/tiny.toml")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--speeds", default="1,0.5", help="replica speed factors, comma-separated ('' for all 1)")
    ap.add_argument("--lr-multiples", default=f"10,{FLOOR_LR_STEPS:g},30",
                    help="floors of zero-initialised tensors, k x the run's peak learning rate")
    ap.add_argument("--method", default="asyncmesh")
    ap.add_argument("--load-at", type=int, default=0,
                    help="at the first evaluation past this many samples, every other replica loads replica 0's "
                         "state as a joiner does (witnessed: optimiser moments dropped); 0: never")
    ap.add_argument("--no-rewarm", action="store_true",
                    help="with --load-at: no re-warm-up of the learning rate after the load (as before it existed)")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    run = RunConfig.from_toml(args.run)
    speeds = tuple(float(s) for s in args.speeds.split(",") if s) if args.speeds else ()
    sim = sim_mod.SimConfig(run=run, n_replicas=args.replicas, steps=args.steps, eval_every=args.eval_every,
                            methods=(args.method,), speeds=speeds)
    lr = run.optim.lr
    variants: dict[str, float | None] = {"fixed": None}
    variants.update({f"{float(k):g}x_lr": float(k) for k in args.lr_multiples.split(",") if k})
    tolerance = StateSyncConfig().tensor_tolerance
    torch.manual_seed(run.seed)
    corpus = load_corpus(run.data, run.model.vocab_size)
    val = val_batches(corpus, run.model.block_size, run.data.batch_size, 4)
    state = sim_mod._Run(sim, METHODS[args.method], sim.tau, corpus, val)
    points: list[dict[str, Any]] = []
    record = state.record
    load0 = os.getloadavg()[0]

    loaded: list[int] = []
    fixed = [fixed_tables(run, s) for s in range(run.n_stages)]

    def measured() -> None:
        record()
        if args.load_at and not loaded and state.curve[-1]["samples"] >= args.load_at:
            for r in range(1, state.R):
                for s in range(state.K):
                    state.w[r][s].load_state_dict(sanitize(state.w[0][s].state_dict(), None))
                    if args.no_rewarm:
                        state.w[r][s].rewarm_from = None
            loaded.append(state.curve[-1]["samples"])
        point: dict[str, Any] = {"samples": state.curve[-1]["samples"], "val_loss": state.curve[-1]["val_loss"],
                                 "steps": [[w.local_step for w in row] for row in state.w], "floors": {}}
        for name, k in variants.items():
            worst: dict[str, Any] = {"max": 0.0, "tensor": None, "over_tolerance": 0}
            for s in range(state.K):
                ref = dict(state.w[0][s].model.state_dict())
                for r in range(1, state.R):
                    for key, v in state.w[r][s].model.state_dict().items():
                        d = distance(ref[key], v, floor_of(key, k, lr), fixed[s].get(key))
                        worst["over_tolerance"] += int(d > tolerance)
                        if key in fixed[s]:  # a subspace run's table: measured on its trained part
                            worst["tables_max"] = round(max(worst.get("tables_max", 0.0), d), 4)
                        if d > worst["max"]:
                            worst.update(max=round(d, 4), tensor=f"stage {s} {key}")
            point["floors"][name] = worst
        points.append(point)
        print(json.dumps({"samples": point["samples"], **{n: f["max"] for n, f in point["floors"].items()}}),
              flush=True)

    state.record = measured  # type: ignore[method-assign]
    t0 = time.time()
    state.run_async()
    own = round(float(state._val_loss(0)), 4)
    damage = {name: {"every_tensor": pushed_loss(state, k, lr, tolerance, seed=1, zero_init_only=False),
                     "zero_init_only": pushed_loss(state, k, lr, tolerance, seed=1, zero_init_only=True)}
              for name, k in variants.items()}
    out = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_start": load0,
                    "loadavg_end": os.getloadavg()[0]},
        "seconds": round(time.time() - t0, 1),
        "tolerance": tolerance, "lr": lr, "rms_floor": RMS_FLOOR,
        "zero_init_floors": {n: (None if k is None else max(RMS_FLOOR, k * lr)) for n, k in variants.items()},
        "speeds": list(speeds), "loaded_at_samples": loaded[0] if loaded else None, "rewarm": not args.no_rewarm,
        "points": points,
        "final_val_loss": points[-1]["val_loss"] if points else None,
        "replica0_val_loss": own,
        "val_loss_pushed_to_tolerance": damage,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    print(json.dumps({"replica0_val_loss": own, "pushed": damage}))


if __name__ == "__main__":
    main()
