"""A swarm of real ``asyncmesh-peer join`` processes for the benchmarks (tools/bench_swarm.py, tools/bench_ttl.py):
one case (mode, network, delay, uplink cap), its peers started in order on loopback or the emulated WAN, their
``/status`` read, their summaries collected, and the cases a run of a benchmark measures."""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `tools.wan` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peer.ops.procs import PeerProcess, cpu_seconds, free_port, join_command  # noqa: E402
from tools.wan import DEFAULT_EMULATOR, LocalNet, Wan, check_available  # noqa: E402

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


def command_line(tool: str, argv: list[str] | None) -> str:
    """How a result file names the command that made it: ``tool`` (``python tools/<name>.py``, options that select a
    mode included) and its arguments (``argv``, or the process's own when None)."""
    return " ".join([tool, *(sys.argv[1:] if argv is None else argv)])


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


# ----- command line shared by the benchmarks that train swarms of real peers -------------------------------------
def add_swarm_arguments(p: argparse.ArgumentParser, *, replicas: int, budget_s: float, eval_every_s: float,
                        subnet: str) -> None:
    """The options every swarm a benchmark trains reads (``train_case``, ``SwarmCase``, ``tools.wan``), with the
    benchmark's own defaults, so that a new option of the swarms reaches every benchmark that trains them."""
    p.add_argument("--replicas", type=int, default=replicas, help="peers per stage")
    p.add_argument("--budget-s", type=float, default=budget_s,
                   help="training seconds per swarm, from all peers training")
    p.add_argument("--eval-every-s", type=float, default=eval_every_s, help="stage-0 replicas' evaluation period")
    p.add_argument("--eval-batches", type=int, default=2, help="validation micro-batches per evaluation")
    p.add_argument("--poll-s", type=float, default=1.0, help="/status poll period (evaluation time resolution)")
    p.add_argument("--queue-ms", type=float, default=200.0, help="each uplink's buffer on the WAN, in ms of the rate")
    p.add_argument("--emulator", type=Path, default=DEFAULT_EMULATOR, help="path of the link emulator")
    p.add_argument("--slow-start-after-idle", action=argparse.BooleanOptionalAction, default=True,
                   help="TCP restarts an idle connection's window (Linux's default); --no-... keeps it, as a tuned "
                        "cluster does, which the synchronous barrier's once-a-step exchange gains most from")
    p.add_argument("--subnet", default=subnet, help="first three octets of the namespaces' addresses")
    p.add_argument("--start-timeout-s", type=float, default=180.0, help="give up if a swarm is not training by then")
    p.add_argument("--drain-timeout-s", type=float, default=5.0, help="peers' drain at the end of a swarm")
    p.add_argument("--torch-threads", type=int, default=1, help="compute threads per peer")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu",
                   help="every peer's (and compute-only process's) --device (cuda: they share the GPU)")
    p.add_argument("--compute-pace", type=float, default=0.0, metavar="F",
                   help="each peer a device of its own, 1/F the speed of a core: every compute job lasts F x its CPU "
                        "time (peer/compute.py, DevicePace; 0: off, the peers share the cores)")
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="FIELD=VALUE",
                   help="extra PeerConfig setting for every peer")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the figures here")
    p.add_argument("--plot", type=Path, default=None, metavar="PNG", help="loss vs time and vs tokens")
    p.add_argument("--workdir", type=Path, default=None, help="peers' logs and summaries (default: a temp folder)")


def swarm_overrides(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Check ``add_swarm_arguments``' options (``p.error`` on a bad one), fill in what ``SwarmCase`` reads of
    bench_swarm's own options, and return the PeerConfig settings they give every peer (before the user's ``--set``,
    which wins over them)."""
    if args.budget_s <= 0 or args.eval_every_s <= 0 or args.poll_s <= 0 or args.replicas < 1:
        p.error("--budget-s, --eval-every-s and --poll-s must be positive and --replicas >= 1")
    if not args.run.is_file():
        p.error(f"--run {args.run} does not exist")
    args.max_inflight, args.sync_microbatches = 0, 0  # what SwarmCase reads of bench_swarm's arguments
    items = [f"eval_batches={args.eval_batches}", f"device={args.device}"]
    if args.compute_pace:
        if args.torch_threads != 1 or args.device == "cuda":
            p.error("--compute-pace times each compute thread's own CPU time: it needs --torch-threads 1 and the CPU")
        items.append(f"compute_pace={args.compute_pace:g}")
    return items
