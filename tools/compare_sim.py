"""Same-sample check: the real daemon's validation loss against the simulator's asyncmesh on the same run.

Starts a 2-stage x 2-replica swarm of real peer processes on loopback (stages 0, 1, 0, 1; asynchronous), lets each
stage-0 replica train ``--steps`` micro-batches, and reads the mean final validation loss of the stage-0 peers (the
fixed validation batches of the run, identical on every peer). Then trains the simulator's ``asyncmesh`` method on
the same run config, 2 replicas, the same number of micro-batches per replica, and the same validation batches.
Both run the run's averaging cadence (a round every ``averaging.round_steps`` local steps); the simulator draws each
round's delay from the delays the daemon's peers measured (their summaries' ``avg_delay_hist``; ``--tau`` only when
they measured none). What differs, by construction: the daemon's pipeline staleness is whatever the machine made it,
the simulator's is exact; and each side draws its own training windows (same corpus and run seed,
shards seeded by peer id in the daemon and by replica index in the simulator).

    python tools/compare_sim.py --run tests/runs/tiny.toml --steps 40
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

STAGES = (0, 1, 0, 1)


def daemon_swarm(run_file: str | None, steps: int, settings: list[str], timeout_s: float) -> list[dict]:
    """Run the 2x2 swarm to ``steps`` on the stage-0 peers; returns every peer's summary."""
    root = Path(tempfile.mkdtemp(prefix="compare-sim-"))
    procs: list[subprocess.Popen] = []
    try:
        initial: list[str] = []
        for i, stage in enumerate(STAGES):
            d = root / f"peer{i}"
            d.mkdir()
            cmd = [sys.executable, "-m", "peer.cli", "join", "--no-tui", "--stage", str(stage), "--max-steps",
                   str(steps), "--torch-threads", "1", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity",
                   str(d / "id.key"), "--summary-json", str(d / "summary.json"),
                   "--set", f"maddrs_file={d / 'maddrs.txt'}", "--set", "checkpoint_every_s=0"]
            cmd += [x for s in settings for x in ("--set", s)] + (["--run", run_file] if run_file else [])
            cmd += ["--initial-peers", *initial] if initial else []
            with open(d / "log.txt", "wb") as log:
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
            while i == 0 and not (d / "maddrs.txt").exists():
                if procs[0].poll() is not None:
                    raise RuntimeError(f"the first peer exited; see {d / 'log.txt'}")
                time.sleep(0.2)
            if i == 0:
                initial = [m for m in (d / "maddrs.txt").read_text().split() if "/p2p/" in m][:1]
        for i, stage in enumerate(STAGES):
            if stage == 0:
                procs[i].wait(timeout=timeout_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    out = []
    for i in range(len(STAGES)):
        path = root / f"peer{i}" / "summary.json"
        out.append(json.loads(path.read_text()) if path.exists() else {"stage": STAGES[i], "error": str(path)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default=str(REPO / "tests" / "runs" / "tiny.toml"), help="run TOML")
    ap.add_argument("--steps", type=int, default=40, help="micro-batches per stage-0 replica")
    ap.add_argument("--tau", type=int, default=4,
                    help="the simulator's averaging delay in local steps when the daemon measured none")
    ap.add_argument("--set", action="append", default=[], dest="settings",
                    metavar="FIELD=VALUE", help="peer setting for every peer")
    ap.add_argument("--timeout", type=float, default=600.0, help="give up on the swarm after this long")
    args = ap.parse_args()

    from trainer.config import RunConfig
    from trainer.sim.simulator import SimConfig, run_method

    run = RunConfig.from_toml(args.run)
    peers = daemon_swarm(args.run, args.steps, ["eval_batches=2", *args.settings], args.timeout)
    stage0 = [p for p in peers if p.get("stage") == 0]
    vals = [p["final_val_loss"] for p in stage0 if p.get("final_val_loss") is not None]
    done = [p.get("steps", 0) for p in stage0]
    steps = max(4, (min(done) // 4) * 4)  # the simulator needs a multiple of its micro-batches per flush
    taus = tuple(int(t) for p in peers for t, n in (p.get("avg_delay_hist") or {}).items() for _ in range(n))
    sim = SimConfig(preset="daemon-compare", run=run, n_replicas=2, steps=steps, micro_batches=4, tau=args.tau,
                    tau_samples=taus, fraction=run.averaging.fraction, accumulate=run.optim.accumulate,
                    eval_every=steps, eval_batches=2, methods=("asyncmesh",))
    result = run_method(sim, "asyncmesh", "asyncmesh", args.tau)
    print(json.dumps({
        "run": run.name, "run_id": run.run_id,
        "daemon_final_val_loss": sum(vals) / len(vals) if vals else None,
        "daemon_microbatches_per_replica": done,
        "daemon_averaging_rounds_ok": sum(p.get("averaging_rounds_ok", 0) for p in peers),
        "sim_final_val_loss": result["final_val_loss"], "sim_first_val_loss": result["first_val_loss"],
        "daemon_avg_fraction_per_step": [p.get("avg_fraction_per_step") for p in peers],
        "sim_avg_fraction_per_step": result["avg_fraction_per_step"],
        "sim_microbatches_per_replica": steps, "sim_tau": args.tau if not taus else None,
        "sim_delays_from_daemon": len(taus),
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
