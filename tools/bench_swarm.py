#!/usr/bin/env python3
"""Swarm throughput benchmark: tokens/s of a real ``asyncmesh-peer join`` swarm, async against ``--mode sync``.

For each network (loopback, then -- as root -- network namespaces joined by tools/netem.py with one-way delays of, by
default, 0 / 25 / 50 ms and a 100 Mbit/s uplink cap per peer) and each mode, the tool starts a fresh swarm of
``n_stages x replicas`` peers (one process per peer, one namespace per peer, each with ``--stage`` fixed: the first
peer starts the swarm and the others join through its multiaddr; the later stages start first, stage 0 -- which
feeds the pipeline -- last, all its replicas at once), waits until every peer trains, lets it warm up, then measures
over a fixed wall-clock window by reading every peer's ``/status`` at both ends and polling it in between:

* swarm tokens/s = sum over stage-0 peers of (training tokens completed in the window) / window. Every token enters
  the pipeline once, at stage 0, and counts when its gradient has come back (docs/design.md, "How we measure");
* wire bytes per token (namespaces only) from the emulated links' counters, which include TCP/IP, libp2p, DHT and
  averaging traffic: everything a peer sent;
* CPU seconds each process used in the window (the peers and the emulator share this machine's cores);
* packets the emulator forwarded and dropped (random loss, full uplink queue) in the window;
* stalled seconds: poll intervals in the window in which no stage-0 micro-batch completed.

Then it stops the peers with SIGTERM and keeps their ``--summary-json`` files in the results. Ratios come from one
run of the tool: speedup = async / sync tokens/s on the same network; latency hiding = tokens/s at a delay / tokens/s
of the same mode at 0 ms added delay (same namespaces and cap). Results: a table on stdout, JSON and CSV.

Example (root, the figures of docs/performance.md)::

    python tools/bench_swarm.py --warmup-s 20 --measure-s 60 --out docs/bench/swarm

``--time-to-loss`` (first argument) runs tools/bench_ttl.py instead, with the arguments that follow: async and sync
swarms trained for the same wall-clock budget, validation loss against time and tokens, time-to-loss speedup, the
simulator's agreement and utilisation (``--time-to-loss --help`` lists its options).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `tools.wan` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peer.config import MODES  # noqa: E402
from peer.ops.procs import unwind_on_sigterm  # noqa: E402
from tools.bench_report import (  # noqa: F401 - re-exported: the figures belong to this tool
    active_rate,
    bytes_per_token,
    format_table,
    markdown_tables,
    ratios,
    stalled_seconds,
    window_tokens_per_s,
)
from tools.swarm_case import (  # noqa: E402
    REPO,
    BenchError,
    Case,
    SwarmCase,
    command_line,
    counter_deltas,
    plan,
    repo_path,
)
from tools.wan import DEFAULT_EMULATOR, LocalNet, Wan, WanConfig  # noqa: E402

logger = logging.getLogger("bench_swarm")

def measure(case: Case, args: argparse.Namespace, workdir: Path, n_stages: int) -> dict[str, Any]:
    """Run one case from start to teardown and return its figures."""
    n = n_stages * args.replicas
    if case.net == "loopback":
        net: Wan | LocalNet = LocalNet(n, stop_timeout_s=args.drain_timeout_s + 20)
    else:
        net = Wan(WanConfig(n=n, delay_ms=case.delay_ms, rate_mbit=case.rate_mbit, emulator=args.emulator,
                            subnet=args.subnet, stop_timeout_s=args.drain_timeout_s + 20))
    with net:
        rtt = net.rtt(0, 1) * 1000 if isinstance(net, Wan) else None
        sc = SwarmCase(case, args, net, workdir, n_stages)
        sc.start()
        logger.info("%s: all %d peers training; warming up %.0f s", case.label, n, args.warmup_s)
        time.sleep(args.warmup_s)
        before = sc.sample()
        start = (before["t"], sum(x["tokens_total"] for x in before["tokens"] if x["stage"] == 0))
        timeline = [start, *sc.watch(before["t"] + args.measure_s, args.poll_s)]
        after = sc.sample()
        summaries = sc.stop_and_collect()
    tps = window_tokens_per_s(before["tokens"], after["tokens"])
    if tps <= 0:
        logger.error("%s: no stage-0 token completed in the %.0f s window: the swarm stalled; see the peers' logs "
                     "in %s", case.label, args.measure_s, workdir)
    window = after["t"] - before["t"]
    cpu = [(a - b) if a is not None and b is not None else 0.0
           for a, b in zip(after["cpu"], before["cpu"], strict=True)]
    emulator_cpu = (after["emulator_cpu"] - before["emulator_cpu"]) if after["emulator_cpu"] is not None else None
    stages = [p["stage"] for p in sc.peers]
    return {
        **asdict(case), "label": case.label, "tokens_per_s": tps, "window_s": window, "rtt_ms": rtt,
        "stalled_s": stalled_seconds(timeline), "active_tokens_per_s": active_rate(timeline),
        "timeline": [(round(t - before["t"], 2), n) for t, n in timeline],
        "bytes_per_token": bytes_per_token(before["links"], after["links"], stages, tps * window),
        "dropped": sum(after["dropped"]) - sum(before["dropped"]),
        "stage0_steps": min(a - b for a, b, s in zip(after["steps"], before["steps"], stages, strict=True) if s == 0),
        "cpu_s_per_peer": cpu, "emulator_cpu_s": emulator_cpu,
        "cpu_util": (sum(cpu) + (emulator_cpu or 0.0)) / (window * (os.cpu_count() or 1)),
        "loadavg": [before["loadavg"], after["loadavg"]],
        "pipeline_delay": [s.get("pipeline_delay") for s in after["snapshots"]],
        "avg_rounds_ok": [int(s["counters"].get("averaging_rounds_ok", 0)) for s in after["snapshots"]],
        "emulator": net.counters(refresh=False) if isinstance(net, Wan) else None,  # whole run, from its exit line
        "emulator_window": counter_deltas(before["emulator"], after["emulator"]),
        "summaries": summaries, "workdir": str(workdir),
    }


# ----- command line -----------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--run", type=Path, default=REPO / "trainer" / "runs" / "default.toml", help="run TOML")
    p.add_argument("--replicas", type=int, default=2, help="peers per stage")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--loopback", action=argparse.BooleanOptionalAction, default=True, help="measure on loopback")
    p.add_argument("--wan", choices=["auto", "yes", "no"], default="auto",
                   help="namespaces + tools/netem.py: auto runs them when root and the emulator are available")
    p.add_argument("--delays-ms", nargs="+", type=float, default=[0.0, 25.0, 50.0], help="one-way delays (RTT = 2x)")
    p.add_argument("--rate-mbit", type=float, default=100.0, help="per-peer uplink cap on the emulated WAN (0: none)")
    p.add_argument("--emulator", type=Path, default=DEFAULT_EMULATOR, help="path of the link emulator")
    p.add_argument("--subnet", default="100.64.7", help="first three octets of the namespaces' addresses")
    p.add_argument("--warmup-s", type=float, default=20.0, help="seconds after all peers train, before measuring")
    p.add_argument("--measure-s", type=float, default=60.0, help="measurement window in seconds")
    p.add_argument("--poll-s", type=float, default=2.0, help="progress poll period inside the window (stalls)")
    p.add_argument("--start-timeout-s", type=float, default=180.0, help="give up if the swarm is not training by then")
    p.add_argument("--drain-timeout-s", type=float, default=5.0, help="peers' drain at the end of a case")
    p.add_argument("--eval-every-s", type=float, default=0.0, help="peers' evaluation period (0: off while measuring)")
    p.add_argument("--max-inflight", type=int, default=0, help="stage-0 micro-batches in flight (0: the peer default)")
    p.add_argument("--sync-microbatches", type=int, default=0, help="GPipe micro-batches per flush in sync mode "
                   "(0: the peer default)")
    p.add_argument("--torch-threads", type=int, default=1, help="compute threads per peer")
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="FIELD=VALUE",
                   help="extra PeerConfig setting for every peer")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "bench" / "swarm",
                   help="writes OUT.json and OUT.csv")
    p.add_argument("--workdir", type=Path, default=None, help="peers' logs and summaries (default: a temp folder)")
    p.add_argument("--report", type=Path, default=None, metavar="JSON",
                   help="measure nothing: print the Markdown tables of a JSON this tool wrote")
    args = p.parse_args(argv)
    if args.replicas < 1 or args.warmup_s < 0 or args.measure_s <= 0 or args.torch_threads < 0 or args.poll_s <= 0:
        p.error("--replicas >= 1, --warmup-s >= 0, --measure-s > 0, --poll-s > 0 and --torch-threads >= 0 are "
                "required")
    if any(d < 0 for d in args.delays_ms) or args.rate_mbit < 0:
        p.error("--delays-ms and --rate-mbit must be >= 0")
    if not args.run.is_file():
        p.error(f"--run {args.run} does not exist")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--time-to-loss" in argv:
        from tools import bench_ttl  # the other benchmark of tools/swarm_case.py's swarms

        return bench_ttl.main([a for a in argv if a != "--time-to-loss"])
    args = parse_args(argv)
    if args.report is not None:
        try:
            saved = json.loads(args.report.read_text())
            print(markdown_tables(saved["cases"], saved["figures"]))
        except (OSError, ValueError, KeyError) as e:
            print(f"bench_swarm: cannot read {args.report} ({e!r}); pass a JSON written by this tool", file=sys.stderr)
            return 2
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    unwind_on_sigterm()
    from trainer.config import RunConfig

    run = RunConfig.from_toml(args.run)
    try:
        cases = plan(args)
    except BenchError as e:
        print(f"bench_swarm: error: {e}", file=sys.stderr)
        return 2
    if not cases:
        print("bench_swarm: nothing to measure (--no-loopback and no emulated WAN)", file=sys.stderr)
        return 2
    root = args.workdir or Path(tempfile.mkdtemp(prefix="asyncmesh-bench-"))
    results, failed = [], []
    for k, case in enumerate(cases):
        workdir = root / f"case{k}-{case.mode}-{case.net}-{case.delay_ms:g}ms"
        logger.info("case %d/%d: %s (files in %s)", k + 1, len(cases), case.label, workdir)
        try:
            results.append(measure(case, args, workdir, run.n_stages))
        except BenchError as e:  # the case's processes and namespaces are gone; the other cases still run
            logger.error("%s", e)
            failed.append({"label": case.label, "error": str(e).splitlines()[0], "workdir": str(workdir)})
            continue
        logger.info("%s: %.0f tokens/s over %.0f s", case.label, results[-1]["tokens_per_s"],
                    results[-1]["window_s"])
    figures = ratios(results)
    print(format_table(results, figures))
    for f in failed:
        print(f"FAILED {f['label']}: {f['error']} (files in {f['workdir']})")
    write_outputs(args, run, results, figures, argv, failed)
    return 1 if failed else 0


def write_outputs(args: argparse.Namespace, run: Any, results: list[dict[str, Any]],
                  figures: dict[str, dict[str, float | None]], argv: list[str] | None,
                  failed: list[dict[str, str]]) -> None:
    meta = {"command": command_line("python tools/bench_swarm.py", argv),
            "run": repo_path(args.run), "run_id": run.run_id, "n_stages": run.n_stages, "replicas": args.replicas,
            "tokens_per_microbatch": run.data.batch_size * run.model.block_size, "nproc": os.cpu_count(),
            "settings": {k: (repo_path(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "figures": figures, "cases": results,
                                                         "failed": failed}, indent=1, default=str))
    with open(args.out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["mode", "net", "delay_ms", "rate_mbit", "rtt_ms", "tokens_per_s", "window_s", "bytes_per_token",
                    "dropped", "stalled_s", "cpu_util", "stage0_steps"])
        for r in results:
            bpt = f"{r['bytes_per_token']['total']:.1f}" if r["bytes_per_token"] else ""
            rtt = "" if r["rtt_ms"] is None else f"{r['rtt_ms']:.1f}"
            w.writerow([r["mode"], r["net"], r["delay_ms"], r["rate_mbit"], rtt, f"{r['tokens_per_s']:.1f}",
                        f"{r['window_s']:.1f}", bpt, r["dropped"], f"{r['stalled_s']:.1f}", f"{r['cpu_util']:.3f}",
                        r["stage0_steps"]])
    logger.info("wrote %s and %s", args.out.with_suffix(".json"), args.out.with_suffix(".csv"))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("bench_swarm: interrupted; every peer, emulator and namespace of this run was removed", file=sys.stderr)
        sys.exit(130)
