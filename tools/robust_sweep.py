"""Robust averaging in the simulator: honest validation loss under Byzantine replicas, per aggregator and attack.

For each (replicas, Byzantine count) pair and each aggregator, trains the control (no attacker) and one run per attack
with the simulator (trainer/sim), and reports the honest replicas' final validation loss and its ratio to the control
of the same aggregator. Writes DIR/robust.json (every record) and DIR/robust.md (the table).

    python tools/robust_sweep.py --preset smoke --grid 4:1,8:2,4:2,8:3 --out /tmp/robust --jobs 2
    python tools/robust_sweep.py --table A/robust.json B/log.txt   # one table from several sweeps' records
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import multiprocessing
import os
import platform
import time
from pathlib import Path
from typing import Any

from trainer.attacks import ATTACKS
from trainer.robust import AGGREGATORS
from trainer.sim.presets import preset, with_overrides
from trainer.sim.simulator import SimConfig, run_method


def _job(sim: SimConfig, method: str) -> dict[str, Any]:
    rec = run_method(sim, method, method, sim.tau)
    return {"replicas": sim.n_replicas, "byzantine": sim.byzantine, "attack": sim.attack if sim.byzantine else None,
            "aggregator": sim.run.averaging.aggregator, "final_val_loss": rec["final_val_loss"],
            "compute_s": rec["compute_s"]}


def _grid(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        r, f = item.split(":")
        out.append((int(r), int(f)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="smoke", choices=("smoke", "paper"))
    ap.add_argument("--steps", type=int, default=None, help="micro-batches per replica (default: the preset's)")
    ap.add_argument("--stages", type=int, default=None, help="pipeline stages (default: the preset's)")
    ap.add_argument("--method", default="asyncmesh", help="a parameter-averaging method (default: asyncmesh)")
    ap.add_argument("--grid", default="4:1,8:2", help="replicas:byzantine pairs, comma-separated")
    ap.add_argument("--aggregators", default=",".join(AGGREGATORS))
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--out", type=Path, default=None, help="output folder (required unless --table)")
    ap.add_argument("--table", type=Path, nargs="+", default=None, metavar="FILE",
                    help="train nothing: print one table from robust.json files or logs of printed records")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--no-controls", action="store_true",
                    help="skip the runs without attackers (the simulator is deterministic: reuse another sweep's)")
    args = ap.parse_args()
    if args.table:
        print(table([rec for path in args.table for rec in _records(path)]), end="")
        return 0
    if args.out is None:
        ap.error("--out is required")
    aggs, attacks = args.aggregators.split(","), args.attacks.split(",")
    base = with_overrides(preset(args.preset), steps=args.steps, stages=args.stages, methods=(args.method,))
    sims: list[SimConfig] = []
    for r, f in _grid(args.grid):
        for agg in aggs:
            sim = with_overrides(base, replicas=r, aggregator=agg)
            if not args.no_controls and (r, agg) not in {(s.n_replicas, s.run.averaging.aggregator)
                                                         for s in sims if not s.byzantine}:
                sims.append(sim)
            sims.extend(dataclasses.replace(sim, byzantine=f, attack=a) for a in attacks)
    args.out.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    t0 = time.time()
    loads: list[str] = []
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=ctx) as pool:
        futures = [pool.submit(_job, s, args.method) for s in sims]
        for fut in cf.as_completed(futures):
            records.append(fut.result())
            loads.append(Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?")
            print(json.dumps(records[-1]), flush=True)
    meta = {"preset": args.preset, "steps": base.steps, "stages": base.run.n_stages, "method": args.method,
            "nproc": os.cpu_count(), "machine": platform.machine(), "loadavg_samples": loads,
            "wall_s": round(time.time() - t0, 1)}
    (args.out / "robust.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    (args.out / "robust.md").write_text(table(records))
    print(table(records))
    return 0


def _records(path: Path) -> list[dict[str, Any]]:
    """The records of a robust.json, or of a log holding one printed JSON record a line."""
    text = path.read_text()
    if path.suffix == ".json":
        return json.loads(text)["records"]
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _fmt(x: float) -> str:
    return f"{x:.3f}" if abs(x) < 100 else f"{x:.1e}"


def table(records: list[dict[str, Any]]) -> str:
    """Markdown: one row per (replicas, byzantine, attack), one column per aggregator: loss (ratio to its control)."""
    control = {(r["replicas"], r["aggregator"]): r["final_val_loss"] for r in records if not r["byzantine"]}
    aggs = [a for a in AGGREGATORS if any(r["aggregator"] == a for r in records)]
    rows: dict[tuple[int, int, str], dict[str, str]] = {}
    for (n, agg), loss in control.items():
        rows.setdefault((n, 0, "none (control)"), {})[agg] = _fmt(loss)
    for r in records:
        if not r["byzantine"]:
            continue
        ref = control.get((r["replicas"], r["aggregator"]))
        ratio = f" ({_fmt(r['final_val_loss'] / ref)})" if ref else ""
        rows.setdefault((r["replicas"], r["byzantine"], r["attack"]), {})[r["aggregator"]] = \
            _fmt(r["final_val_loss"]) + ratio
    lines = ["| replicas | Byzantine | attack | " + " | ".join(aggs) + " |",
             "|---|---|---|" + "---|" * len(aggs)]
    for (n, f, attack), cells in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        lines.append(f"| {n} | {f} | {attack} | " + " | ".join(cells.get(a, "") for a in aggs) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
