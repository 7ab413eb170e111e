#!/usr/bin/env python3
"""Time-to-loss: real daemon swarms, async against ``--mode sync``, trained for the same wall-clock budget.

``python tools/bench_swarm.py --time-to-loss`` (or this file directly; as root for the emulated WAN). For each network
(by default the emulated WAN of tools/wan.py at 0 and 50 ms one-way delay, 100 Mbit/s per peer; ``--loopback`` adds
loopback) and each mode, it starts a fresh ``n_stages x replicas`` swarm of ``asyncmesh-peer join`` processes on the
same run and data (tools/swarm_case.py's ``SwarmCase``), and from the moment every peer trains lets it run for
``--budget-s`` seconds. Every stage-0 replica evaluates the run's fixed validation batches through the pipeline every
``--eval-every-s`` seconds; the tool polls every peer's ``/status`` each ``--poll-s`` and records, per evaluation, the
wall-clock time since the start, the swarm's training tokens (stage 0, summed over replicas) and the loss. A case's
curve is the mean over stage-0 replicas of each one's latest evaluation.

Figures (``--json OUT``; a plot with ``--plot PNG``):

* ``time_to_loss_speedup`` per network: the time sync needs to reach its own final loss (the mean of its last three
  evaluations) divided by the time async needs to reach that loss (first crossing, interpolated between
  evaluations); the top-level figure is the largest delay's.
* ``final_val_loss`` {"async", "sync"} of that network, and each curve against tokens (equal-tokens comparison).
* ``sim_agreement``: the simulator (trainer/sim) trains the same run with the same cadence and R replicas, each
  round's delay drawn from the taus the async daemon peers measured (their summaries' ``avg_delay_hist``), its
  stage 0 as stale as the daemon's stage-0 peers measured (``pipeline_delay_steps``), each replica validated on its
  own weights as the daemon's are, the replicas as fast relative to each other as the daemon's stage-0 replicas
  (their steps), for as many tokens in all as the daemon trained; daemon loss / simulator loss at the daemon's final
  token count.
* ``utilisation`` per network: swarm tokens/s over the budget / compute-only tokens/s, where compute-only runs the
  same stage workers (``StageWorker``), one process per peer with the same torch threads, side by side as the swarm
  does, on synthetic inputs with no network: R x the slowest stage's micro-batches/s x tokens per micro-batch.
  Evaluation traffic is part of the swarm's work but not of the compute-only figure, so it costs utilisation.
* per case, ``link_bytes`` (each peer's bytes sent and received on its emulated link, and its RPC bytes) and
  ``emulator``: the packets the WAN forwarded and dropped over the budget (``dropped_queue``: an uplink's buffer of
  ``--queue-ms`` was full), in all and per namespace.

``--modes sync`` (or ``async``) trains one mode only: no speedup, for diagnosing one side (its tokens/s, its links).

One run's time-to-loss is noisy: the curves flatten where async crosses sync's final loss, so a few hundredths of a
nat in either run move the crossing by a minute. ``--pool A.json B.json ...`` reads repeats of the same cases and
computes the same figures on their mean curves (each case's loss averaged over the repeats on a 5-s grid of time
and, for the equal-tokens figure, of tokens), with every repeat's own figures beside them for the spread.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peer.cli.join import parse_overrides  # noqa: E402
from peer.config import MODES, PeerConfig  # noqa: E402
from peer.ops.procs import unwind_on_sigterm  # noqa: E402
from tools.swarm_case import REPO, BenchError, Case, SwarmCase, add_swarm_arguments, repo_path, swarm_overrides  # noqa: E402
from tools.swarm_case import plan as swarm_plan  # noqa: E402
from tools.wan import LocalNet, Wan, WanConfig  # noqa: E402
from trainer.config import RunConfig  # noqa: E402
from trainer.sim.methods import fullsync_optim  # noqa: E402

logger = logging.getLogger("bench_ttl")


# ----- pure figures -------------------------------------------------------------------------------------------------
def interpolate(points: list[tuple[float, float]], x: float) -> float | None:
    """y at ``x`` on the polyline ``points`` (sorted by x); None outside its range."""
    if not points or x < points[0][0] or x > points[-1][0]:
        return None
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def at_sparser_evaluation(a: list[tuple[float, float]],
                          b: list[tuple[float, float]]) -> tuple[float, float, float] | None:
    """(tokens, a's loss, b's loss) at the last evaluation, inside both curves' token ranges, of the curve with fewer
    evaluations there, the other interpolated: a straight line between two evaluations of a falling, convex loss
    curve lies above the curve, so reading the sparsely evaluated one between its points overstates its loss (a
    codec or mode that trains 6x the tokens per second, evaluated on the same clock, is 6x sparser in tokens).
    None when the ranges do not overlap."""
    if not a or not b:
        return None
    lo, hi = max(a[0][0], b[0][0]), min(a[-1][0], b[-1][0])
    in_a, in_b = [x for x, _ in a if lo <= x <= hi], [x for x, _ in b if lo <= x <= hi]
    if not in_a or not in_b:
        return None
    x = in_a[-1] if len(in_a) <= len(in_b) else in_b[-1]
    ya, yb = interpolate(a, x), interpolate(b, x)
    return None if ya is None or yb is None else (x, ya, yb)


def time_to_reach(points: list[tuple[float, float]], target: float) -> float | None:
    """First x at which the polyline (x, loss) reaches ``target`` or below, interpolated; None if it never does."""
    for i, (x, y) in enumerate(points):
        if y <= target:
            if i == 0:
                return x
            x0, y0 = points[i - 1]
            return x0 + (x - x0) * (y0 - target) / (y0 - y) if y0 != y else x
    return None


def final_loss(points: list[tuple[float, float]], last: int = 3) -> float | None:
    """A curve's final loss: the mean of its last ``last`` evaluations (one evaluation is noisy)."""
    tail = [y for _, y in points[-last:]]
    return sum(tail) / len(tail) if tail else None


def ttl_speedup(async_t: list[tuple[float, float]], sync_t: list[tuple[float, float]]) -> dict[str, float | None]:
    """Time sync needs to reach its own final loss / time async needs to reach it (curves against seconds)."""
    target = final_loss(sync_t)
    t_sync = None if target is None else time_to_reach(sync_t, target)
    t_async = None if target is None else time_to_reach(async_t, target)
    speedup = t_sync / t_async if t_sync is not None and t_async else None
    return {"target_loss": target, "sync_s": t_sync, "async_s": t_async, "speedup": speedup}


def merge_replicas(evals: dict[int, list[tuple[float, float, float]]]) -> list[tuple[float, float, float]]:
    """One curve from every stage-0 replica's evaluations (t, tokens, loss): at each evaluation, once every replica
    has one, the mean of each replica's latest loss, at that time and the swarm's tokens then."""
    events = sorted((t, tok, loss, peer) for peer, pts in evals.items() for t, tok, loss in pts)
    latest: dict[int, float] = {}
    out = []
    for t, tok, loss, peer in events:
        latest[peer] = loss
        if len(latest) == len(evals):
            out.append((t, tok, sum(latest.values()) / len(latest)))
    return out


def compute_only_tokens_per_s(rates: dict[int, list[float]], tokens_per_mb: int) -> float:
    """Pipelined throughput with no network: every stage's replicas run side by side, the slowest stage bounds it."""
    return min(sum(r) for r in rates.values()) * tokens_per_mb


# ----- compute only --------------------------------------------------------------------------------------------------
def compute_worker(run_path: Path, stage: int, seconds: float, threads: int,
                   device: str = "cpu", pace: float = 0.0) -> dict[str, float]:
    """One peer's compute with no network: its stage's forward and backward (with the step) on synthetic inputs,
    on ``device`` as the peers' ``--device`` resolves it (a GPU's queue is drained after every micro-batch), each
    micro-batch paced as the peers pace their compute jobs (``--compute-pace``)."""
    import torch

    from peer.compute import DevicePace
    from trainer.config import RunConfig
    from trainer.worker import StageWorker, is_gpu, resolve_device

    if threads:
        torch.set_num_threads(threads)
    run = RunConfig.from_toml(run_path)
    dev = resolve_device(device)
    w = StageWorker(run, stage, device=dev)
    b, t, c = run.data.batch_size, run.model.block_size, run.model.n_embd
    g = torch.Generator().manual_seed(stage)
    tokens = torch.randint(0, run.model.vocab_size, (b, t), generator=g)
    x = tokens if stage == 0 else torch.randn(b, t, c, generator=g)
    grad = torch.randn(b, t, c, generator=g) * 1e-3

    paced = DevicePace(pace)

    def one(i: int) -> None:
        with paced.job():
            if w.is_last:
                w.forward_loss(i, x, tokens)
            else:
                w.forward(i, x)
        if not w.is_last:
            with paced.job():
                w.backward(i, grad)
        if is_gpu(dev):
            torch.cuda.synchronize()

    for i in range(3):  # warm-up
        one(i)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        one(3 + n)
        n += 1
    return {"stage": stage, "microbatches_per_s": n / (time.perf_counter() - t0)}


def measure_compute_only(args: argparse.Namespace, run: Any) -> dict[str, Any]:
    """R x K compute-only processes side by side (as the swarm's peers are), each reporting micro-batches/s."""
    procs = []
    for i in range(run.n_stages * args.replicas):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--compute-worker", str(i % run.n_stages),
               "--run", str(args.run), "--compute-s", f"{args.compute_s:g}", "--torch-threads",
               str(args.torch_threads), "--device", args.device, "--compute-pace", f"{args.compute_pace:g}"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=REPO))
    rates: dict[int, list[float]] = {}
    try:
        for p in procs:
            out, _ = p.communicate(timeout=args.compute_s + args.compute_timeout_s)
            rec = json.loads(out.strip().splitlines()[-1])
            rates.setdefault(int(rec["stage"]), []).append(float(rec["microbatches_per_s"]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    tpm = run.data.batch_size * run.model.block_size
    return {"microbatches_per_s": rates, "tokens_per_s": compute_only_tokens_per_s(rates, tpm),
            "seconds": args.compute_s, "loadavg": os.getloadavg()}


# ----- one swarm for the budget --------------------------------------------------------------------------------------
def rpc_bytes_out(status: dict[str, Any] | None) -> int | None:
    """The RPC message bytes a peer has sent so far (its ``bytes_out`` counter), None without a /status answer."""
    return None if status is None else int(status.get("counters", {}).get("bytes_out", 0))


def train_case(case: Case, args: argparse.Namespace, workdir: Path, n_stages: int) -> dict[str, Any]:
    """Start the case's swarm, train ``budget_s`` from the moment every peer trains, record every evaluation."""
    n = n_stages * args.replicas
    if case.net == "loopback":
        net: Wan | LocalNet = LocalNet(n, stop_timeout_s=args.drain_timeout_s + 20)
    else:
        net = Wan(WanConfig(n=n, delay_ms=case.delay_ms, rate_mbit=case.rate_mbit, emulator=args.emulator,
                            subnet=args.subnet, stop_timeout_s=args.drain_timeout_s + 20, queue_ms=args.queue_ms,
                            slow_start_after_idle=args.slow_start_after_idle))
    evals: dict[int, list[tuple[float, float, float]]] = {}
    seen: dict[int, int] = {}
    loads = []
    with net:
        rtt = net.rtt(0, 1) * 1000 if isinstance(net, Wan) else None
        sc = SwarmCase(case, args, net, workdir, n_stages)
        sc.start()
        stage0 = [p for p in sc.peers if p["stage"] == 0]
        t0 = time.monotonic()
        first = [sc.status(p) for p in stage0]
        tokens0 = sum(s["tokens_total"] for s in first if s)
        for p, s in zip(stage0, first, strict=True):
            seen[p["i"]] = int(s["counters"].get("evaluations", 0)) if s else 0
            evals[p["i"]] = []
        links0 = [net.link_bytes(p["i"]) for p in sc.peers]  # None on loopback
        drops0 = net.counters()
        rpc0 = [rpc_bytes_out(sc.status(p)) for p in sc.peers]
        logger.info("%s: all %d peers training; %.0f s budget", case.label, n, args.budget_s)
        tokens = tokens0
        while (now := time.monotonic()) - t0 < args.budget_s:
            time.sleep(min(args.poll_s, max(0.0, args.budget_s - (now - t0))))
            snaps = [sc.status(p) for p in stage0]
            t = time.monotonic() - t0
            if all(snaps):
                tokens = sum(s["tokens_total"] for s in snaps) - tokens0
                for p, s in zip(stage0, snaps, strict=True):
                    count = int(s["counters"].get("evaluations", 0))
                    new = s["val_loss_history"][len(s["val_loss_history"]) - min(count - seen[p["i"]],
                                                                                  len(s["val_loss_history"])):]
                    evals[p["i"]].extend((round(t, 2), tokens, float(loss)) for loss in new)
                    seen[p["i"]] = count
            loads.append(os.getloadavg()[0])
        elapsed = time.monotonic() - t0
        links1 = [net.link_bytes(p["i"]) for p in sc.peers]
        drops1 = net.counters()
        rpc1 = [rpc_bytes_out(sc.status(p)) for p in sc.peers]
        summaries = sc.stop_and_collect()
    links = [{"stage": p["stage"], "tx": b["tx"] - a["tx"], "rx": b["rx"] - a["rx"],
              "rpc_tx": (r1 - r0) if r0 is not None and r1 is not None else None}
             for p, a, b, r0, r1 in zip(sc.peers, links0, links1, rpc0, rpc1, strict=True)
             if a is not None and b is not None]
    curve = merge_replicas(evals)
    return {
        "label": case.label, "mode": case.mode, "net": case.net, "delay_ms": case.delay_ms,
        "rate_mbit": case.rate_mbit, "rtt_ms": rtt, "budget_s": elapsed, "tokens": tokens,
        "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        "curve": [{"t": t, "tokens": tok, "val_loss": loss} for t, tok, loss in curve],
        "evals_per_replica": {str(k): len(v) for k, v in evals.items()},
        # per peer, over the budget: what its emulated link sent (tx) and received, and the bytes of its RPC messages
        # (requests it sent and replies it served, before libp2p's and TCP/IP's framing; the DHT's traffic apart)
        "link_bytes": links or None,
        "emulator": emulator_record(drops0, drops1),
        "final_val_loss": final_loss([(t, loss) for t, _, loss in curve]),
        "avg_fraction_per_step": [s.get("avg_fraction_per_step") for s in summaries],
        "avg_delay_steps": [s.get("avg_delay_steps") for s in summaries],
        "avg_delay_hist": [s.get("avg_delay_hist") or {} for s in summaries],
        "loadavg_max": max(loads, default=None), "loadavg_mean": sum(loads) / len(loads) if loads else None,
        "compute_pace": pace_record(summaries),
        "summaries": summaries, "workdir": workdir.name,  # the case's folder under --workdir (logs, summaries)
    }


def emulator_record(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the emulated WAN did over the budget: packets forwarded and dropped (uplink queue full, random loss), in
    all and per namespace; None on loopback or without the emulator's counters."""
    if not before or not after:
        return None
    keys = ("forwarded", "dropped_queue", "dropped_loss")
    out: dict[str, Any] = {k: int(after.get(k, 0)) - int(before.get(k, 0)) for k in keys}
    b_ns, a_ns = before.get("per_ns") or {}, after.get("per_ns") or {}
    out["per_ns"] = {name: {k: int(c.get(k, 0)) - int(b_ns.get(name, {}).get(k, 0))
                            for k in ("sent_packets", "dropped_queue", "dropped_loss")} for name, c in a_ns.items()}
    return out


def pace_record(summaries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """How well the bed emulated a device per peer (``--compute-pace``): the share of compute jobs, over all peers,
    that already lasted longer than the pace asks (the cores were too few), and the worst peer's share."""
    paced = [s["compute_pace"] for s in summaries if s.get("compute_pace")]
    if not paced:
        return None
    jobs = sum(p["jobs"] for p in paced)
    return {"factor": paced[0]["factor"], "jobs": jobs,
            "overrun_share": round(sum(p["overruns"] for p in paced) / jobs, 4) if jobs else 0.0,
            "worst_peer_overrun_share": max(p["overrun_share"] for p in paced)}


# ----- the simulator on the same run ---------------------------------------------------------------------------------
def sim_steps(tokens: int, first_tokens: int, tpm: int, made: list[int], replicas: int, cap: int) -> int:
    """Micro-batches of the simulation's fastest replica (a multiple of 8): as many as the daemon's fastest replica
    trained (``tokens`` in all, ``made`` stage-0 steps per replica, [] for equal speeds), at most ``cap`` (0: no
    cap), but never fewer than reach the daemon's first evaluation (``first_tokens``): without a token count common
    to both curves there is nothing to compare, and a fast machine evaluates late in tokens."""
    share = max(made) / sum(made) if made else 1 / replicas  # the fastest replica's share of the tokens
    per_replica = int(tokens / tpm * share)
    steps = max(8, (min(per_replica, cap) if cap else per_replica) // 8 * 8)
    first = int(first_tokens / tpm * share) + 1 if first_tokens else 0
    return steps if steps >= first else -(-first // 8) * 8


def simulate_same_run(run: Any, case: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """asyncmesh in the simulator: same run and cadence, R replicas, delays drawn from the case's measured taus, as
    many micro-batches per replica as the daemon's stage-0 replicas trained (``--sim-max-steps`` caps it when set), so
    that sim_agreement compares the whole run."""
    from trainer.sim.simulator import SimConfig, run_method, speeds_from_steps

    taus = tuple(int(t) for hist in case["avg_delay_hist"] for t, c in hist.items() for _ in range(int(c)))
    tpm = run.data.batch_size * run.model.block_size
    # the replicas' measured speeds: stage 0's steps per replica (a replica is a pipeline, paced by its stage 0), so
    # that the simulation trains the fast and the slow replica in the daemon's proportion, as many tokens in all
    made = replica_steps(case["summaries"], args.replicas)
    speeds = speeds_from_steps(made) if made else ()
    first = case["curve"][0]["tokens"] if case["curve"] else 0
    steps = sim_steps(case["tokens"], first, tpm, made, args.replicas, args.sim_max_steps)
    # the cadence the daemon really ran: a round opens on the first clock tick after round_steps local steps, so it
    # stands for more steps than round_steps; the simulator opens one every measured steps-per-round, each round
    # averaging the run's round fraction, so that both average the same fraction per local step
    every = measured_round_steps(case["summaries"], run.averaging.round_steps)
    sim_run = run.replace(averaging={"round_steps": every, "fraction": run.averaging.round_fraction / every})
    extra = pipeline_extra(case["summaries"], run.n_stages)
    sim = SimConfig(preset="time-to-loss", run=sim_run, n_replicas=args.replicas, steps=steps, micro_batches=4,
                    tau=0 if not taus else taus[0], tau_samples=taus, fraction=run.averaging.round_fraction / every,
                    accumulate=max(1, run.optim.accumulate), eval_every=max(1, steps // 8),
                    eval_batches=args.eval_batches, methods=("asyncmesh",), pipeline_extra=extra,
                    eval_replicas="each", speeds=speeds)
    rec = run_method(sim, "asyncmesh", "asyncmesh", sim.tau)
    curve = [(p["samples"] * run.model.block_size, p["val_loss"]) for p in rec["curve"]]
    daemon = [(c["tokens"], c["val_loss"]) for c in case["curve"]]
    at = min(daemon[-1][0], curve[-1][0]) if daemon and curve else None
    d_loss = interpolate(daemon, at) if at is not None else None
    s_loss = interpolate(curve, at) if at is not None else None
    if d_loss is None or s_loss is None:
        logger.warning("no token count common to the daemon's curve (%s to %s tokens) and the simulator's (%s to "
                       "%s, %d steps): no sim_agreement", daemon[0][0] if daemon else None,
                       daemon[-1][0] if daemon else None, curve[0][0] if curve else None,
                       curve[-1][0] if curve else None, steps)
    return {"steps": steps, "delays_drawn_from": len(taus), "tokens": at, "daemon_loss": d_loss, "sim_loss": s_loss,
            "sim_agreement": d_loss / s_loss if d_loss and s_loss else None, "sim_curve": curve,
            "avg_fraction_per_step": rec["avg_fraction_per_step"], "avg_delay_steps": rec["avg_delay_steps"],
            "round_steps": every, "pipeline_extra": extra, "speeds": list(speeds), "data": rec["data"],
            "compute_s": rec["compute_s"]}


def replica_steps(summaries: list[dict[str, Any]], replicas: int) -> list[int]:
    """Local steps of each stage-0 replica over the run, [] unless every one of the ``replicas`` reported some."""
    made = [int(s.get("steps") or 0) for s in summaries if s.get("stage") == 0]
    return made if len(made) == replicas and min(made) > 0 else []


def pipeline_extra(summaries: list[dict[str, Any]], n_stages: int) -> int:
    """Ticks the simulator's 1F1B must hold gradients back so that its stage 0 is as stale as the daemon's stage-0
    peers measured (``pipeline_delay_steps``, mean over the run): round(measured) - (K - 1), at least 0."""
    seen = [float(s["pipeline_delay_steps"]) for s in summaries
            if s.get("stage") == 0 and s.get("pipeline_delay_steps") is not None]
    return max(0, round(sum(seen) / len(seen)) - (n_stages - 1)) if seen else 0


def measured_round_steps(summaries: list[dict[str, Any]], planned: int) -> int:
    """Local steps per successful averaging round, over the case's peers (``planned`` when none succeeded): what the
    daemon ran, fewer than ``planned`` too (a replica pulled into its partners' rounds averages more often)."""
    steps = sum(int(s.get("steps") or 0) for s in summaries)
    rounds = sum(int(s.get("averaging_rounds_ok") or 0) for s in summaries)
    return max(1, round(steps / rounds)) if rounds else planned


# ----- the plot ------------------------------------------------------------------------------------------------------
def plot(cases: list[dict[str, Any]], sim: dict[str, Any] | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for c in cases:
        style = "-" if c["mode"] == "async" else "--"
        a.plot([p["t"] for p in c["curve"]], [p["val_loss"] for p in c["curve"]], style, label=c["label"])
        b.plot([p["tokens"] / 1e6 for p in c["curve"]], [p["val_loss"] for p in c["curve"]], style, label=c["label"])
    if sim and sim.get("sim_curve"):
        b.plot([x / 1e6 for x, _ in sim["sim_curve"]], [y for _, y in sim["sim_curve"]], ":k", label="simulator")
    a.set(xlabel="wall-clock since all peers train (s)", ylabel="validation loss (nats)", title="loss vs time")
    b.set(xlabel="swarm training tokens (millions)", ylabel="validation loss (nats)", title="loss vs tokens")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----- command line --------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_swarm.py --time-to-loss", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--run", type=Path, default=REPO / "trainer" / "runs" / "default.toml", help="run TOML")
    add_swarm_arguments(p, replicas=2, budget_s=300.0, eval_every_s=5.0, subnet="100.64.8")
    p.add_argument("--loopback", action=argparse.BooleanOptionalAction, default=False, help="also on loopback")
    p.add_argument("--wan", choices=["auto", "yes", "no"], default="auto", help="the emulated WAN (root)")
    p.add_argument("--delays-ms", nargs="+", type=float, default=[0.0, 50.0], help="one-way delays on the WAN")
    p.add_argument("--rate-mbit", type=float, default=100.0, help="per-peer uplink cap on the WAN")
    p.add_argument("--modes", nargs="+", choices=MODES, default=None,
                   help="train only these modes (default: both; a single mode gives no speedup, for diagnosis)")
    p.add_argument("--compute-s", type=float, default=30.0, help="compute-only measurement per process (0: skip)")
    p.add_argument("--compute-timeout-s", type=float, default=600.0,
                   help="start-up allowance of a compute-only process on top of --compute-s")
    p.add_argument("--sim-max-steps", type=int, default=0,
                   help="cap on the simulator's micro-batches per replica (0: as many as the daemon's replicas made; "
                   "never fewer than reach the daemon's first evaluation)")
    p.add_argument("--no-sim", action="store_true", help="skip the simulator (no sim_agreement)")
    p.add_argument("--resimulate", type=Path, default=None, metavar="JSON",
                   help="only re-run the simulator against the swarms of an earlier --json result, and rewrite it")
    p.add_argument("--pool", type=Path, nargs="+", default=None, metavar="JSON",
                   help="only pool repeats: the figures of the mean curves of earlier --json results' common cases")
    p.add_argument("--compute-worker", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.overrides = [*swarm_overrides(p, args), *args.overrides]
    return args


def plan(args: argparse.Namespace) -> list[Case]:
    """bench_swarm's cases for the modes asked for (both by default), at exactly the delays asked for."""
    return swarm_plan(argparse.Namespace(**{**vars(args), "modes": args.modes or MODES}), zero_delay=False)


def baseline_record(run: RunConfig, overrides: list[str]) -> dict[str, Any]:
    """What the synchronous swarm trained with: the papers' FullSync as ``--mode sync`` builds it from the run and the
    peers' settings (``sync_optimizer``, ``sync_lr``, ``sync_microbatches``), so a reader of the JSON can check that
    the baseline had its best shot (docs/convergence.md has the sweep that picked them)."""
    cfg = dataclasses.replace(PeerConfig(torch_threads=1), **parse_overrides(overrides))  # as the peers are started
    m = cfg.sync_microbatches
    o = fullsync_optim(run.optim, m, optimizer=cfg.sync_optimizer, lr=cfg.sync_lr or None)
    batch = run.data.batch_size * run.model.block_size
    return {"method": "FullSync: GPipe flush of M micro-batches per step, gradients averaged over every replica",
            "optimizer": str(o.optimizer), "beta1": o.beta1, "beta2": o.beta2, "weight_decay": o.weight_decay,
            "lr": o.lr, "micro_batches": m, "warmup_steps": o.warmup_steps, "total_steps": o.total_steps,
            "warmup_tokens_per_replica": o.warmup_steps * m * batch,
            "async_warmup_tokens_per_replica": run.optim.warmup_steps * batch,
            "schedule": "linear warm-up, then cosine to the run's floor, counted in samples like the async mode's",
            "barriers": "every stage's barrier overlapped with the drain"}


def figures(results: list[dict[str, Any]], compute: dict[str, Any] | None) -> dict[str, Any]:
    """Per network: time-to-loss speedup, final losses, loss at equal tokens, utilisation."""
    out: dict[str, Any] = {}
    for r in results:
        net = r["label"].split("/", 1)[1]
        out.setdefault(net, {})[r["mode"]] = r
    figs: dict[str, Any] = {}
    for net, pair in out.items():
        a, s = pair.get("async"), pair.get("sync")
        f: dict[str, Any] = {}
        if a and s:
            f.update(ttl_speedup([(p["t"], p["val_loss"]) for p in a["curve"]],
                                 [(p["t"], p["val_loss"]) for p in s["curve"]]))
            s_tok = [(p["tokens"], p["val_loss"]) for p in s["curve"]]
            a_tok = [(p["tokens"], p["val_loss"]) for p in a["curve"]]
            at = min(s_tok[-1][0], a_tok[-1][0]) if s_tok and a_tok else None
            f["equal_tokens"] = {"tokens": at, "async": interpolate(a_tok, at) if at else None,
                                 "sync": interpolate(s_tok, at) if at else None}
            if (sparse := at_sparser_evaluation(a_tok, s_tok)) is not None:
                f["equal_tokens_at_evaluation"] = dict(zip(("tokens", "async", "sync"), sparse, strict=True))
        f["final_val_loss"] = {m: pair[m]["final_val_loss"] for m in pair}
        if compute and compute.get("tokens_per_s"):
            f["utilisation"] = {m: pair[m]["tokens_per_s"] / compute["tokens_per_s"] for m in pair}
        figs[net] = f
    return figs


def mean_curve(curves: list[list[dict[str, float]]], step_s: float = 5.0) -> list[dict[str, float]]:
    """The repeats' mean curve: on a grid every ``step_s`` over the time all of them cover, the mean of each one's
    interpolated loss and tokens (a point every repeat reached only)."""
    if not curves or any(not c for c in curves):
        return []
    t0, t1 = max(c[0]["t"] for c in curves), min(c[-1]["t"] for c in curves)
    out, t = [], t0
    while t <= t1 + 1e-9:
        loss = [interpolate([(p["t"], p["val_loss"]) for p in c], t) for c in curves]
        tok = [interpolate([(p["t"], p["tokens"]) for p in c], t) for c in curves]
        if all(v is not None for v in loss + tok):
            out.append({"t": round(t, 2), "tokens": sum(tok) / len(tok),  # type: ignore[arg-type]
                        "val_loss": sum(loss) / len(loss)})  # type: ignore[arg-type]
        t += step_s
    return out


def pool(paths: list[Path]) -> dict[str, Any]:
    """Figures of the mean curves of the cases every result in ``paths`` holds, and each result's own figures."""
    docs = [json.loads(p.read_text()) for p in paths]
    labels = [k for k in docs[0]["cases"] if all(k in d["cases"] for d in docs[1:])]
    if not labels:
        raise BenchError("the results share no case (a label like async/wan-50ms)")
    runs = {d.get("meta", {}).get("run_id") for d in docs}
    if len(runs) > 1:
        raise BenchError(f"the results measured different runs ({sorted(map(str, runs))}): nothing to pool")
    cases = []
    for label in labels:
        reps = [d["cases"][label] for d in docs]
        curve = mean_curve([r["curve"] for r in reps])
        cases.append({"label": label, "mode": reps[0]["mode"], "curve": curve,
                      "tokens_per_s": sum(r["tokens_per_s"] for r in reps) / len(reps),
                      "final_val_loss": final_loss([(p["t"], p["val_loss"]) for p in curve])})
    each = [figures([d["cases"][k] for k in labels], None) for d in docs]
    return {"pooled": figures(cases, None), "each": each, "sources": [p.name for p in paths],
            "tokens_per_s": {c["label"]: c["tokens_per_s"] for c in cases},
            "meta": {"command": " ".join(["python tools/bench_swarm.py --time-to-loss", *sys.argv[1:]]),
                     "run_id": docs[0].get("meta", {}).get("run_id"),
                     "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}


def resimulate(args: argparse.Namespace, run: Any) -> int:
    """Re-run only the simulator against the swarm figures of an earlier ``--json`` result (same run file), and
    write the result back with the new ``simulator`` and ``sim_agreement``."""
    doc = json.loads(args.resimulate.read_text())
    label = (doc.get("simulator") or {}).get("case") or next(
        (k for k in doc["cases"] if k.startswith("async/") and k.endswith(doc.get("headline_network") or "")), None)
    if label is None or label not in doc["cases"]:
        print(f"bench_ttl: error: {args.resimulate} holds no asynchronous case to simulate", file=sys.stderr)
        return 2
    if doc.get("meta", {}).get("run_id") not in (None, run.run_id):
        print(f"bench_ttl: error: {args.resimulate} measured run {doc['meta']['run_id']}, --run is {run.run_id}",
              file=sys.stderr)
        return 2
    sim = simulate_same_run(run, doc["cases"][label], args)
    sim["case"] = label
    logger.info("simulator: daemon %.4f / sim %.4f at %s tokens (a round every %d steps)",
                sim["daemon_loss"] or float("nan"), sim["sim_loss"] or float("nan"), sim["tokens"], sim["round_steps"])
    doc["simulator"], doc["sim_agreement"] = sim, sim["sim_agreement"]
    doc.setdefault("meta", {})["resimulated"] = {
        "command": " ".join(["python tools/bench_swarm.py --time-to-loss", *sys.argv[1:]]),
        "loadavg": os.getloadavg(), "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    _write(args.json or args.resimulate, doc)
    if args.plot:
        plot(list(doc["cases"].values()), sim, args.plot)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compute_worker is not None:
        print(json.dumps(compute_worker(args.run, args.compute_worker, args.compute_s, args.torch_threads,
                                        args.device, args.compute_pace)))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.pool is not None:
        try:
            pooled = pool(args.pool)
        except (BenchError, OSError, ValueError, KeyError) as e:
            print(f"bench_ttl: error: cannot pool {' '.join(map(str, args.pool))}: {e}", file=sys.stderr)
            return 2
        if args.json:
            _write(args.json, pooled)
        print(json.dumps(pooled["pooled"], indent=1))
        return 0
    unwind_on_sigterm()
    from trainer.config import RunConfig
    from trainer.data import corpus_identity, load_corpus

    run = RunConfig.from_toml(args.run)
    if args.resimulate is not None:
        return resimulate(args, run)
    try:
        cases = plan(args)
    except BenchError as e:
        print(f"bench_ttl: error: {e}", file=sys.stderr)
        return 2
    if not cases:
        print("bench_ttl: nothing to measure (no loopback and no emulated WAN)", file=sys.stderr)
        return 2
    root = args.workdir or Path(tempfile.mkdtemp(prefix="asyncmesh-ttl-"))
    load_start = os.getloadavg()
    compute = None
    if args.compute_s > 0:
        compute = measure_compute_only(args, run)
        logger.info("compute only: %.0f tokens/s", compute["tokens_per_s"])
    results, failed = [], []

    def write_partial(note: str) -> None:
        _write(args.json, {"cases": {r["label"]: r for r in results}, "figures": figures(results, compute),
                           "compute_only": compute, "baseline": baseline_record(run, args.overrides),
                           "failed": failed, "partial": note})

    for k, case in enumerate(cases):
        workdir = root / f"case{k}-{case.mode}-{case.net}-{case.delay_ms:g}ms"
        logger.info("case %d/%d: %s (files in %s)", k + 1, len(cases), case.label, workdir)
        try:
            results.append(train_case(case, args, workdir, run.n_stages))
        except BenchError as e:
            logger.error("%s", e)
            failed.append({"label": case.label, "error": str(e).splitlines()[0], "workdir": str(workdir)})
            continue
        r = results[-1]
        logger.info("%s: %.0f tokens/s, final val loss %s, %d evaluations", case.label, r["tokens_per_s"],
                    r["final_val_loss"], len(r["curve"]))
        if args.json and k + 1 < len(cases):  # a run cut short (a lease, a timeout) keeps the cases it finished
            write_partial(f"written after case {k + 1} of {len(cases)}")
    figs = figures(results, compute)
    headline_net = max((n for n in figs if "speedup" in figs[n]), key=_delay_of, default=None)
    if args.json:  # the swarms' figures first: the simulator may take a while on a busy machine
        write_partial("written before the simulator ran")
    sim = None
    asyncs = [r for r in results if r["mode"] == "async" and r["curve"]]
    if not args.no_sim and asyncs:
        target = next((r for r in asyncs if r["label"].endswith(headline_net or "")), asyncs[-1])
        sim = simulate_same_run(run, target, args)
        sim["case"] = target["label"]
        logger.info("simulator: daemon %.4f / sim %.4f at %s tokens", sim["daemon_loss"] or float("nan"),
                    sim["sim_loss"] or float("nan"), sim["tokens"])
    head = figs.get(headline_net, {}) if headline_net else {}
    doc = {
        "cases": {r["label"]: r for r in results},
        "time_to_loss_speedup": head.get("speedup"),
        "sim_agreement": sim["sim_agreement"] if sim else None,
        "final_val_loss": head.get("final_val_loss", {}),
        "headline_network": headline_net,
        "figures": figs, "compute_only": compute, "simulator": sim, "failed": failed,
        "baseline": baseline_record(run, args.overrides),
        "meta": {"command": " ".join(["python tools/bench_swarm.py --time-to-loss",
                                      *(argv if argv is not None else sys.argv[1:])]),
                 "run": repo_path(args.run), "run_id": run.run_id, "n_stages": run.n_stages,
                 "replicas": args.replicas, "compute_pace": args.compute_pace,
                 "tcp_slow_start_after_idle": args.slow_start_after_idle, "nproc": os.cpu_count(),
                 "loadavg_start": load_start,
                 "loadavg_end": os.getloadavg(), "python": platform.python_version(),
                 "data": corpus_identity(load_corpus(run.data, run.model.vocab_size)),
                 "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
    }
    print(json.dumps({k: doc[k] for k in ("time_to_loss_speedup", "sim_agreement", "final_val_loss",
                                          "headline_network")} | {"figures": _brief(figs)}, indent=1, default=str))
    for f in failed:
        print(f"FAILED {f['label']}: {f['error']} (files in {f['workdir']})")
    if args.json:
        _write(args.json, doc)
    if args.plot and results:
        plot(results, sim, args.plot)
    return 1 if failed else 0


def _write(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str))


def _delay_of(net: str) -> float:
    return float(net.removeprefix("wan-").removesuffix("ms")) if net.startswith("wan-") else -1.0


def _brief(figs: dict[str, Any]) -> dict[str, Any]:
    return {net: {k: v for k, v in f.items()} for net, f in figs.items()}


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("bench_ttl: interrupted; every peer, emulator and namespace of this run was removed", file=sys.stderr)
        sys.exit(130)
