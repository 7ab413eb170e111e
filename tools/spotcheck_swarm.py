#!/usr/bin/env python3
"""What spot checks of the next stage cost and how far honest replicas disagree, on a real 2x2 swarm of the tiny run.

Starts four ``join`` processes of ``tests/runs/tiny.toml`` on loopback (two replicas of stage 0, two of stage 1), lets
them train ``--train-s`` seconds once all four train, and reads every peer's /status: the stage-0 peers' spot-check
figures (the relative distances between the two stage-1 replicas' gradients of one micro-batch: their quantiles and
maximum), the check counters, optimiser steps and bytes sent. Run once per ``--variant``:

    python tools/spotcheck_swarm.py --train-s 40 --variants on,off --json docs/bench/spotcheck.json

``on`` is the default settings, ``off`` sets ``spot_checks=false`` (the cost baseline), ``all`` checks every
micro-batch (``spot_check_fraction=1``: the most distance samples, to set the tolerance). ``recheck`` and
``norecheck`` take backups every 5 s, with and without re-checks from the held copy (peer/pipeline/recheck.py);
``--layout 2x1`` runs a lone stage-1 replica, which only re-checks check. With backups, the stage-1 peers also
re-check stage 0's forwards from their copy of stage 0 (peer/pipeline/fwdcheck.py): ``fwdchecks``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peer.ops.procs import PeerProcess, free_port, join_command, terminate, unwind_on_sigterm  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "tests" / "runs" / "tiny.toml"
SETTINGS = ("announce_every_s=1", "record_ttl_s=4", "dht_timeout_s=3", "rpc_timeout_s=5", "microbatch_timeout_s=15",
            "eval_every_s=3", "checkpoint_every_s=0", "rebalance_every_s=0", "backup_every_s=0")
VARIANTS = {"on": (), "off": ("spot_checks=false",), "all": ("spot_check_fraction=1.0",),
            # re-checks from the held copy of stage 1 (peer/pipeline/recheck.py): backups every 5 s so stage 0 holds
            # one within the run; "norecheck" is the same without re-checks (their cost baseline)
            "recheck": ("backup_every_s=5", "rechecks=true"), "norecheck": ("backup_every_s=5", "rechecks=false")}
LAYOUTS = {"2x2": (("a0", 0), ("b1", 1), ("c0", 0), ("d1", 1)),
           "2x1": (("a0", 0), ("b1", 1), ("c0", 0))}  # 2x1: a lone stage-1 replica, which spot checks cannot check


def swarm(root: Path, variant: str, train_s: float, layout: str = "2x2") -> dict[str, Any]:
    overrides = {v.split("=")[0] for v in VARIANTS[variant]}
    settings = (*(v for v in SETTINGS if v.split("=")[0] not in overrides), *VARIANTS[variant])
    peers: list[PeerProcess] = []
    try:
        for name, stage in LAYOUTS[layout]:
            port = free_port()
            initial = peers[0].wait_maddrs()[:1] if peers else ()
            peers.append(PeerProcess.spawn(name, join_command(root / name, port=port, run=TINY, stage=stage,
                                                              settings=settings, initial=initial, checkpoints=False),
                                           root / name, port, cwd=REPO))
        for p in peers:
            p.wait_status(lambda s: s.get("state") == "training" and (s.get("local_step") or 0) > 0, 180, "training")
        if "backup_every_s=5" in settings:  # measured once every peer holds its copy of the neighbour stage
            for p in peers:
                p.wait_status(lambda s: s.get("backup") is not None, 60, "a copy of the neighbour stage")
        before = {p.name: p.status() or {} for p in peers}
        t0 = time.monotonic()
        time.sleep(train_s)
        after = {p.name: p.status() or {} for p in peers}
        elapsed = time.monotonic() - t0
    finally:
        terminate([p.proc for p in peers], 10.0)

    def delta(name: str, key: str) -> float:
        return float(after[name].get("counters", {}).get(key, 0) - before[name].get("counters", {}).get(key, 0))

    def compute_s(names: tuple[str, ...], key: str) -> float:
        return round(sum(((after[n].get(key) or {}).get("compute_s") or 0)
                         - ((before[n].get(key) or {}).get("compute_s") or 0) for n in names), 3)

    def steps(name: str) -> int:
        return int((after[name].get("local_step") or 0) - (before[name].get("local_step") or 0))
    stage0, stage1 = ("a0", "c0"), tuple(n for n, s in LAYOUTS[layout] if s == 1)
    s0, s1 = sum(steps(n) for n in stage0), sum(steps(n) for n in stage1)
    checks = {k: sum(delta(n, f"spotcheck_{k}") for n in stage0)
              for k in ("sent", "passed", "failed", "unavailable", "void", "banned")}
    return {
        "variant": variant, "layout": layout, "train_s": round(elapsed, 1),
        "stage0_steps_per_s": round(s0 / elapsed, 2), "stage1_steps_per_s": round(s1 / elapsed, 2),
        "stage1_steps_per_stage0_step": round(s1 / s0, 3) if s0 else None,
        "stage0_bytes_out_per_step": round(sum(delta(n, "bytes_out") for n in stage0) / s0) if s0 else None,
        "checks": checks,
        "rechecks": {k: sum(delta(n, f"recheck_{k}") for n in stage0)
                     for k in ("sampled", "passed", "failed", "banned", "unavailable", "errors")},
        "recheck_figures": {n: after[n].get("rechecks") for n in stage0},
        "recheck_compute_s": compute_s(stage0, "rechecks"),
        "fwdchecks": {k: sum(delta(n, f"fwdcheck_{k}") for n in stage1)
                      for k in ("passed", "failed", "unavailable", "errors")},
        "fwdcheck_figures": {n: after[n].get("fwdchecks") for n in stage1},
        "fwdcheck_compute_s": compute_s(stage1, "fwdchecks"),
        "distances": {n: after[n].get("spot_checks") for n in stage0},
        "val_loss": {n: after[n].get("val_loss") for n in stage0},
        "loadavg_end": Path("/proc/loadavg").read_text().split()[:3],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-s", type=float, default=40.0, help="seconds of training measured, once all four train")
    p.add_argument("--variants", default="on,off", help=f"comma-separated, of: {', '.join(VARIANTS)}")
    p.add_argument("--layout", default="2x2", choices=sorted(LAYOUTS), help="peers per stage (2x1: a lone stage 1)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    if set(variants) - set(VARIANTS):
        p.error(f"unknown variants; known: {', '.join(VARIANTS)}")
    unwind_on_sigterm()
    root = Path(tempfile.mkdtemp(prefix="spotcheck-"))
    results = {"runs": [swarm(root / v, v, args.train_s, args.layout) for v in variants],
               "loadavg_start_end": Path("/proc/loadavg").read_text().split()[:3],
               "command": " ".join(["python", "tools/spotcheck_swarm.py", *(argv or sys.argv[1:])])}
    text = json.dumps(results, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
