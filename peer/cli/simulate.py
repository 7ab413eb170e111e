"""`asyncmesh-peer simulate`: reproduce the papers' comparisons in one process, with exact delays.

Builds a SimConfig from a preset plus overrides, runs every method (trainer/sim/simulator.py), models each method's
wall-clock on a stated network (trainer/sim/wallclock.py) and writes results.json, curves.csv, curves.png and table.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peer.errors import UserError, user_input
from protocol.codecs.names import RUN_CODECS
from trainer.config import ARCHITECTURES

if TYPE_CHECKING:
    from trainer.sim.simulator import SimConfig

HELP = "Compare the asynchronous methods with the synchronous baseline in one process (exact delays)."
EPILOG = """examples:
  asyncmesh-peer simulate --preset smoke --out /tmp/sim            # every method, seconds (what CI runs)
  asyncmesh-peer simulate --preset paper --out docs/sim/paper --jobs 2   # 4 stages x 2 replicas, ~30 min
  asyncmesh-peer simulate --preset stress --out /tmp/stress        # 8 stages, tau 10 and 50
  asyncmesh-peer simulate --preset base --device cuda --jobs 3 --out /tmp/base   # AsyncPP base scale on a GPU
  asyncmesh-peer simulate --preset paper --methods fullsync,asyncmesh --compression int8 --out /tmp/int8
  asyncmesh-peer simulate --preset smoke --stages 4 --replicas 4 --tau 2,8 --p 0.1 --steps 128 --out /tmp/x
  asyncmesh-peer simulate --preset smoke --arch llama --out /tmp/llama   (the Llama-style model, same shape)
  asyncmesh-peer simulate --preset smoke --methods asyncmesh --subspace-rank 16 --subspace-codec int4 --out /tmp/ss

methods: fullsync, naive-async, asyncpp, asyncpp-nows, asyncmesh, async-sparta, delta, full-avg, wagma, accum
(see trainer/sim/methods.py for exactly what each one does)."""

CODECS = RUN_CODECS  # the run file's codecs, from the one table (protocol/codecs/names.py)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=("smoke", "paper", "stress", "base"), default="smoke",
                        help="base configuration (default: smoke)")
    parser.add_argument("--out", type=Path, required=True, help="output folder (created; files are overwritten)")
    parser.add_argument("--methods", default=None, help="comma-separated methods, or 'all' (default: the preset's)")
    parser.add_argument("--stages", type=int, default=None, help="pipeline stages K")
    parser.add_argument("--replicas", type=int, default=None, help="data-parallel replicas R")
    parser.add_argument("--steps", type=int, default=None, help="micro-batches per replica (local steps)")
    parser.add_argument("--tau", default=None,
                        help="averaging delay in local steps; a comma-separated list runs each delay")
    parser.add_argument("--p", type=float, default=None, dest="fraction",
                        help="fraction of every tensor averaged per local step")
    parser.add_argument("--round-steps", type=int, default=None,
                        help="local steps one averaging round stands for (the run's averaging.round_steps)")
    parser.add_argument("--delays-from", type=Path, action="append", default=[], metavar="SUMMARY_JSON",
                        help="draw every round's delay from the taus a daemon measured (its --summary-json's "
                        "avg_delay_hist; repeatable) instead of --tau")
    parser.add_argument("--pipeline-extra", type=int, default=None, metavar="E",
                        help="hold every stage's gradient E more ticks than 1F1B (a daemon's stage 0 with W "
                        "micro-batches in flight on K stages: E = W - K; default 0)")
    parser.add_argument("--speeds", default=None, metavar="F0,F1,...",
                        help="replicas' speed factors in (0, 1], one per replica, the fastest 1 (async methods; "
                        "default: all 1)")
    parser.add_argument("--eval-replicas", choices=("averaged", "each"), default=None,
                        help="validate the replicas' averaged weights (default, as the AsyncMesh code) or each "
                        "replica's own, mean over replicas (as the daemon's replicas report)")
    parser.add_argument("--arch", choices=tuple(ARCHITECTURES), default=None,
                        help="the model architecture, at the preset's shape (default: the preset's, gpt)")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate")
    parser.add_argument("--compression", choices=CODECS, default=None,
                        help="codec for activations (and gradients, unless --grad-compression) between stages "
                        "(default: none)")
    parser.add_argument("--grad-compression", choices=CODECS, default=None,
                        help="codec for the gradients only (default: as --compression)")
    parser.add_argument("--avg-compression", choices=CODECS, default=None, help="codec for averaging payloads")
    parser.add_argument("--subspace-rank", type=int, default=None, metavar="K",
                        help="subspace compression (trainer/subspace.py): the residual stream confined to a fixed "
                        "rank-K subspace, K coefficients per token crossing each boundary (instead of --compression)")
    parser.add_argument("--subspace-codec", choices=CODECS, default=None,
                        help="with --subspace-rank: the coefficients' codec (default: none, fp32)")
    parser.add_argument("--eval-every", type=int, default=None, help="evaluate every N micro-batches per replica")
    parser.add_argument("--seed", type=int, default=None, help="run seed (init, data shards, partitions)")
    parser.add_argument("--aggregator", choices=("mean", "trimmed", "centered_clip"), default=None,
                        help="how replicas combine averaging parts (default: the run's, 'trimmed')")
    parser.add_argument("--byzantine", type=int, default=None, metavar="N",
                        help="the last N replicas send attacked averaging parts (red-team measurement)")
    parser.add_argument("--attack", choices=("zeros", "scale", "signflip", "noise", "alie"), default=None,
                        help="what the --byzantine replicas send (default: zeros)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"),
                        help="where the workers compute (default: cpu; auto takes a GPU when torch sees one)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="methods trained in parallel processes (1 thread each); use only on an idle machine")
    parser.add_argument("--no-wallclock", action="store_true", help="skip the wall-clock model")
    parser.add_argument("--wallclock-only", action="store_true",
                        help="train nothing: measure the preset's compute and write the speedup tables "
                        "(wallclock.md, wallclock.json) for 10/50/100 ms links")
    parser.add_argument("--report-only", action="store_true",
                        help="train nothing: re-render DIR's outputs from its results.json (re-measures the "
                        "wall-clock model)")
    parser.add_argument("--merge", type=Path, action="append", default=[], metavar="DIR",
                        help="with --report-only: add the methods of another run's DIR/results.json (same config "
                        "apart from the method list; repeatable)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every evaluation")


def _taus(text: str | None) -> tuple[int | None, tuple[int, ...] | None]:
    if text is None:
        return None, None
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as e:
        raise UserError(f"--tau takes integers separated by commas, got {text!r}") from e
    if not values or min(values) < 0:
        raise UserError(f"--tau needs non-negative integers, got {text!r}")
    return values[0], (values if len(values) > 1 else ())


def build_config(args: argparse.Namespace) -> SimConfig:
    """The SimConfig the arguments describe (UserError with advice on bad combinations)."""
    with user_input():
        return _build_config(args)


def _build_config(args: argparse.Namespace) -> SimConfig:
    from trainer.sim.methods import parse_methods
    from trainer.sim.presets import preset, with_overrides
    from trainer.worker import resolve_device

    tau, taus = _taus(args.tau)
    compression = None
    if args.compression or args.grad_compression or args.avg_compression:
        compression = {"activations": args.compression or "none",
                       "gradients": args.grad_compression or args.compression or "none",
                       "averaging": args.avg_compression or "none"}
    sim = with_overrides(
        preset(args.preset), stages=args.stages, replicas=args.replicas, steps=args.steps, tau=tau, taus=taus,
        fraction=args.fraction, methods=parse_methods(args.methods) if args.methods else None,
        compression=compression, lr=args.lr, eval_every=args.eval_every, seed=args.seed,
        device=resolve_device(args.device), byzantine=args.byzantine, attack=args.attack, aggregator=args.aggregator,
    )
    if args.arch is not None:
        sim = dataclasses.replace(sim, run=sim.run.replace(model={"arch": args.arch}))
    if args.subspace_codec is not None and args.subspace_rank is None:
        raise UserError("--subspace-codec needs --subspace-rank K (the subspace the coefficients are of)")
    if args.subspace_rank is not None:
        if args.compression or args.grad_compression:
            raise UserError("--subspace-rank replaces --compression and --grad-compression: the boundary sends "
                            "subspace coefficients (give their codec with --subspace-codec)")
        sim = dataclasses.replace(sim, run=sim.run.replace(compression={
            "activations": "subspace", "gradients": "subspace", "subspace_rank": args.subspace_rank,
            "subspace_codec": args.subspace_codec or "none"}))
    if args.round_steps is not None:
        sim = dataclasses.replace(sim, run=sim.run.replace(averaging={"round_steps": args.round_steps}))
    if args.delays_from:
        sim = dataclasses.replace(sim, tau_samples=measured_delays(args.delays_from))
    if args.pipeline_extra is not None:
        sim = dataclasses.replace(sim, pipeline_extra=args.pipeline_extra)
    if args.eval_replicas is not None:
        sim = dataclasses.replace(sim, eval_replicas=args.eval_replicas)
    if args.speeds is not None:
        try:
            speeds = tuple(float(f) for f in args.speeds.split(","))
            sim = dataclasses.replace(sim, speeds=speeds)
        except ValueError as e:
            raise UserError(f"--speeds: {e}") from e
    return sim


def measured_delays(paths: list[Path]) -> tuple[int, ...]:
    """Every tau the daemons of ``paths`` (summary JSON files) measured, one entry per round."""
    taus: list[int] = []
    for path in paths:
        try:
            hist = json.loads(path.read_text()).get("avg_delay_hist") or {}
        except (OSError, ValueError, AttributeError) as e:
            raise UserError(f"--delays-from {path}: not a readable daemon summary ({e})") from e
        taus.extend(int(t) for t, n in hist.items() for _ in range(int(n)))
    if not taus:
        raise UserError(f"--delays-from: no averaging round was measured in {', '.join(map(str, paths))}")
    return tuple(taus)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    from trainer.sim.presets import run_simulation
    from trainer.sim.timing import WallclockReport

    torch.set_num_threads(1)
    if args.jobs < 1:
        raise UserError(f"--jobs must be >= 1, got {args.jobs}")
    if args.report_only:
        return _report_only(args.out, args.merge, wallclock=not args.no_wallclock)
    sim = build_config(args)
    if args.wallclock_only:
        return _wallclock_only(sim, args.out)
    variants = sim.variants()
    print(f"simulate {sim.preset}: {sim.run.n_stages} stages x {sim.n_replicas} replicas, {sim.steps} steps, "
          f"{len(variants)} runs -> {args.out}", flush=True)
    report = None if args.no_wallclock else WallclockReport.measure(sim)

    def on_result(rec: dict[str, Any]) -> None:
        print(f"  {rec['name']:<22} final val loss {rec['final_val_loss']:.4f}  (from {rec['first_val_loss']:.4f}, "
              f"{rec['updates']} updates, {rec['compute_s']:.0f} s)", flush=True)

    run_simulation(sim, args.out, jobs=args.jobs, on_result=on_result,
                   wallclock=report.for_results if report else None)
    print((args.out / "table.md").read_text(), end="")
    if report is not None:
        print(report.speedup_markdown(), end="")
    return 0


def _report_only(out: Path, merge: list[Path], *, wallclock: bool) -> int:
    from trainer.sim.report import load_results, write_outputs
    from trainer.sim.simulator import SimConfig
    from trainer.sim.timing import WallclockReport

    with user_input(f"--out {out}"):
        config, records = load_results(out / "results.json")
    for other in merge:
        with user_input(f"--merge {other}"):
            other_config, other_records = load_results(other / "results.json")
        mismatch = sorted(k for k in config if k != "methods" and config[k] != other_config.get(k))
        if mismatch:
            raise UserError(f"cannot merge {other}: its config differs in {mismatch}; rerun it with the same flags")
        names = {r["name"] for r in other_records}
        records = [r for r in records if r["name"] not in names] + other_records
    config = dict(config, methods=list(dict.fromkeys(r["method"] for r in records)))
    sim = SimConfig.from_dict(config)
    report = WallclockReport.measure(sim) if wallclock else None
    write_outputs(out, config, records, report.for_results(records) if report else None)
    print((out / "table.md").read_text(), end="")
    return 0


def _wallclock_only(sim: SimConfig, out: Path) -> int:
    import json

    from trainer.sim.timing import WallclockReport, gpu_like_rows, speedup_markdown

    report = WallclockReport.measure(sim)
    rows = report.speedup_rows() + gpu_like_rows(sim.n_replicas, sim.micro_batches, sim.fraction, sim.tau)
    out.mkdir(parents=True, exist_ok=True)
    text = speedup_markdown(rows)
    (out / "wallclock.md").write_text(text)
    (out / "wallclock.json").write_text(json.dumps(
        {"fwd_s": report.fwd_s, "bwd_s": report.bwd_s, "stage_params": report.params, "rows": rows}, indent=2) + "\n")
    print(f"measured per-stage compute (s): forward {[round(v, 4) for v in report.fwd_s]}, "
          f"backward+step {[round(v, 4) for v in report.bwd_s]}")
    print(text, end="")
    return 0


if __name__ == "__main__":  # pragma: no cover
    from peer.cli import main

    sys.exit(main(["simulate", *sys.argv[1:]]))
