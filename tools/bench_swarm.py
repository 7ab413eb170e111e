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
import http.client
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `tools.wan` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peer.ops.procs import PeerProcess, cpu_seconds, free_port, join_command, unwind_on_sigterm  # noqa: E402
from tools.bench_report import (  # noqa: F401 - re-exported: the figures belong to this tool
    active_rate,
    bytes_per_token,
    format_table,
    markdown_tables,
    ratios,
    stalled_seconds,
    window_tokens_per_s,
)
from tools.wan import DEFAULT_EMULATOR, LocalNet, Wan, WanConfig, check_available

logger = logging.getLogger("bench_swarm")

REPO = Path(__file__).resolve().parent.parent
P2P_PORT = 31337
STATUS_PORT = 9464


class BenchError(RuntimeError):
    """A benchmark case could not run (the message says what happened and where the logs are)."""


@dataclass(frozen=True)
class Case:
    """One swarm to measure."""

    mode: str          # 'async' or 'sync'
    net: str           # 'loopback' or 'wan'
    delay_ms: float    # one-way delay added by the emulator (0 on loopback)
    rate_mbit: float   # per-peer uplink cap (0: none)

    @property
    def label(self) -> str:
        if self.net == "loopback":
            return f"{self.mode}/loopback"
        return f"{self.mode}/wan-{self.delay_ms:g}ms"


# ----- processes --------------------------------------------------------------------------------------------------
def http_status(port: int, timeout: float = 3.0) -> dict[str, Any]:
    """GET http://127.0.0.1:PORT/status in the calling thread's network namespace."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/status")
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise OSError(f"/status answered HTTP {resp.status}")
        return json.loads(body)
    finally:
        conn.close()


class SwarmCase:
    """The peers of one case on one network (a Wan or a LocalNet, which reaps them)."""

    def __init__(self, case: Case, args: argparse.Namespace, net: Wan | LocalNet, workdir: Path, n_stages: int):
        self.case, self.args, self.net, self.workdir, self.n_stages = case, args, net, workdir, n_stages
        self.peers: list[dict[str, Any]] = []
        # later stages first: [1, 1, 0, 0] for 2 x 2. Stage 0 drives the pipeline, so it starts last, when every
        # replica downstream is already serving (sync mode pins each pipeline to one replica per stage)
        self.stages = sorted((i % n_stages for i in range(n_stages * args.replicas)), reverse=True)

    def spawn(self, i: int, initial: list[str]) -> dict[str, Any]:
        d = self.workdir / f"peer{i}"
        d.mkdir(parents=True, exist_ok=True)
        stage = self.stages[i]
        if self.case.net == "loopback":
            port, listen, announce = free_port(), ["/ip4/127.0.0.1/tcp/0"], []
        else:
            port, listen = STATUS_PORT, [f"/ip4/{self.net.ip(i)}/tcp/{P2P_PORT}"]
            announce = listen
        cmd = join_command(d, port=port, run=self.args.run, stage=stage, mode=self.case.mode,
                           torch_threads=self.args.torch_threads, host_maddrs=listen, announce_maddrs=announce,
                           settings=self.peer_settings(), initial=initial, checkpoints=False)
        with open(d / "log.txt", "wb") as log:
            proc = self.net.popen(i, cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        peer = {"i": i, "stage": stage, "dir": d, "proc": proc, "port": port}
        self.peers.append(peer)
        return peer

    def peer_settings(self) -> list[str]:
        items = [f"eval_every_s={self.args.eval_every_s:g}", f"drain_timeout_s={self.args.drain_timeout_s:g}"]
        if self.args.max_inflight:
            items.append(f"max_inflight={self.args.max_inflight}")
        if self.args.sync_microbatches:
            items.append(f"sync_microbatches={self.args.sync_microbatches}")
        return items + list(self.args.overrides)

    def fail(self, peer: dict[str, Any], what: str) -> BenchError:
        tail = (peer["dir"] / "log.txt").read_text(errors="replace")[-2000:]
        return BenchError(f"{self.case.label}: peer {peer['i']} {what}; log {peer['dir'] / 'log.txt'} ends:\n{tail}")

    def status(self, peer: dict[str, Any]) -> dict[str, Any] | None:
        try:
            return self.net.call_in(peer["i"], lambda: http_status(peer["port"]), timeout=10.0)
        except (OSError, ValueError, TimeoutError):
            return None

    def start(self) -> None:
        first = self.spawn(0, [])
        deadline = time.monotonic() + self.args.start_timeout_s
        maddrs = first["dir"] / "maddrs.txt"
        while not maddrs.exists():
            if first["proc"].poll() is not None:
                raise self.fail(first, f"exited with code {first['proc'].returncode} during start-up")
            if time.monotonic() > deadline:
                raise self.fail(first, "wrote no multiaddr in time")
            time.sleep(0.2)
        want = self.net.ip(0)
        initial = [m for m in maddrs.read_text().split() if "/p2p/" in m and f"/{want}/" in m][:1]
        if not initial:
            raise self.fail(first, f"announced no multiaddr on {want} ({maddrs.read_text().split()})")
        for i in range(1, len(self.stages)):
            if self.stages[i] == 0 and self.stages[i - 1] != 0:
                self.wait_training(deadline)  # downstream stages up before any stage-0 peer starts feeding
            self.spawn(i, initial)
        self.wait_training(deadline)

    def wait_training(self, deadline: float) -> None:
        """Every peer started so far in state 'training'; every stage-0 peer with a completed micro-batch."""
        waiting = list(self.peers)
        while waiting:
            for peer in list(waiting):
                if peer["proc"].poll() is not None:
                    raise self.fail(peer, f"exited with code {peer['proc'].returncode} before training")
                snap = self.status(peer)
                if snap and snap.get("state") == "training" and (peer["stage"] != 0 or snap["tokens_total"] > 0):
                    waiting.remove(peer)
            if waiting and time.monotonic() > deadline:
                raise self.fail(waiting[0], f"was not training within {self.args.start_timeout_s:.0f} s")
            time.sleep(0.5)

    def sample(self) -> dict[str, Any]:
        statuses, stamps = [], []
        for peer in self.peers:
            snap = self.status(peer)
            if snap is None:
                raise self.fail(peer, "stopped answering /status during the measurement")
            statuses.append(snap)
            stamps.append(time.monotonic())
        return {
            "tokens": [{"stage": p["stage"], "tokens_total": s["tokens_total"], "t": t}
                       for p, s, t in zip(self.peers, statuses, stamps, strict=True)],
            "steps": [s["local_step"] for s in statuses],
            "dropped": [int(s["counters"].get("microbatches_dropped", 0)) for s in statuses],
            "links": [self.net.link_bytes(p["i"]) for p in self.peers],
            "cpu": [cpu_seconds(p["proc"].pid) for p in self.peers],
            "emulator_cpu": (cpu_seconds(self.net.emulator.pid) if isinstance(self.net, Wan) and self.net.emulator
                             else None),
            "emulator": self.net.counters() if isinstance(self.net, Wan) else None,
            "t": time.monotonic(), "loadavg": os.getloadavg(), "snapshots": statuses,
        }

    def watch(self, until: float, every_s: float) -> list[tuple[float, int]]:
        """Stage-0 tokens completed so far, every ``every_s`` seconds until ``until`` (shows stalls in the window)."""
        timeline = []
        while (left := until - time.monotonic()) > 0:
            time.sleep(min(every_s, left))
            snaps = [self.status(p) for p in self.peers if p["stage"] == 0]
            if all(snaps):
                timeline.append((time.monotonic(), sum(s["tokens_total"] for s in snaps)))
        return timeline

    def stop_and_collect(self) -> list[dict[str, Any]]:
        self.net.close()  # SIGTERM, drain, reap
        return [PeerProcess(f"peer{p['i']}", p["proc"], p["dir"], p["port"]).summary() for p in self.peers]


def counter_deltas(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, int] | None:
    """The emulator's packet counters over the window (forwarded, dropped by loss, by a full queue, ...)."""
    if not before or not after:
        return None
    keys = ("forwarded", "forwarded_bytes", "dropped_loss", "dropped_queue", "dropped_noroute", "write_errors")
    return {k: int(after.get(k, 0)) - int(before.get(k, 0)) for k in keys}


def repo_path(path: Path) -> str:
    """``path`` relative to the repository when it lies inside it (results name no machine's directories)."""
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


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
    p.add_argument("--modes", nargs="+", default=["async", "sync"], choices=["async", "sync"])
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


def plan(args: argparse.Namespace, *, zero_delay: bool = True) -> list[Case]:
    """The cases in running order: per network, every mode of ``args.modes`` back to back (so ratios compare
    neighbours in time). ``zero_delay``: always add the 0-ms WAN case (latency hiding's reference)."""
    nets: list[tuple[str, float, float]] = [("loopback", 0.0, 0.0)] if args.loopback else []
    if args.wan != "no":
        reason = check_available(args.emulator)
        if reason and args.wan == "yes":
            raise BenchError(f"--wan yes: {reason}")
        if reason:
            logger.warning("skipping the emulated WAN: %s", reason)
        else:
            delays = sorted(set(args.delays_ms) | ({0.0} if zero_delay else set()))
            nets += [("wan", d, args.rate_mbit) for d in delays]
    return [Case(mode, net, delay, rate) for net, delay, rate in nets for mode in args.modes]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--time-to-loss" in argv:
        from tools import bench_ttl  # bench_ttl builds on this module's swarm plumbing

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
    meta = {"command": " ".join(["python tools/bench_swarm.py", *(argv if argv is not None else sys.argv[1:])]),
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
