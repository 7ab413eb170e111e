#!/usr/bin/env python3
"""Churn benchmark: a swarm of ``join --stage auto`` peers on loopback, a clean control run against a churn run.

Both runs train the same run file (tests/runs/tiny.toml by default) with the same peer settings; the churn run until
a stage-0 peer reaches ``--steps`` local steps and every event is over, then the clean control run until a stage-0
peer reaches the step the churn run stopped at, so that both losses are taken at the same length. The validation loss
is read from the stage-0 peers' ``/status`` (they evaluate every 5 s) and every peer is stopped with SIGTERM.
The churn run, at points of training progress drawn from ``--seed``, does what a month of unattended volunteers does:

* ``kill_bootstrap``: kill -9 of the first peer (whose address everybody joined through), restarted at once with
  the same identity and folder and ``--stage auto``;
* ``kill_stage``: kill -9 of every peer of the stage with fewest peers (a whole stage), replaced by the same peers
  restarted with ``--stage auto`` a few seconds later (their checkpoints are all that is left of that stage);
* ``graceful``: SIGTERM of one peer and its restart with the same folder;
* ``swarm_restart``: SIGTERM of every peer, then all restarted at once from their checkpoints (their rebalancing
  timers start together: the rebalancing race).

What it reports (``--json OUT``), per run and for the churn run against the control:

* ``states_lost``: stages that restarted from the seeded init although the swarm had trained, with no other replica
  keeping their training (every peer logs that loss as a WARNING; the tool counts those lines);
  ``replicas_started_over``: replicas that started from the init while other replicas of their stage kept its
  training (no donor state they could verify; not a loss, counted apart);
* ``samples_lost``: the ``samples_lost`` of every peer's final summary (peers killed with SIGKILL cannot report);
* ``orphans``: processes of a killed peer (its DHT process, p2pd) still alive 5 s after the kill, plus descendants
  of any peer left after the final reap;
* ``stalls_over_10s``: stretches of over 10 s in which no stage-0 peer made a step, outside the whole-stage loss and
  the whole-swarm restart (listed separately, with their cause);
* ``final_val_loss``: ``{"clean": c, "churn": x}``, the mean latest validation loss of the stage-0 peers at the end;
* ``joiner_first_step_s``: seconds from starting a replacement to its first own training step;
* ``restart_resumed_step``: ``{"before": a, "after": b}`` per restarted peer: its step at exit, and its step when it
  trained again (``after >= before``: it resumed where it stopped).

Example (the figures of docs/reliability.md)::

    python tools/bench_churn.py --peers 6 --steps 300 --seed 1 --json docs/bench/churn.json

``--delay-ms D`` and ``--rate-mbit R`` run both swarms on the emulated WAN of tools/wan.py instead (root: one
network namespace per peer, kept across its restarts, one-way delay D, so RTT 2D, and an uplink cap of R Mbit/s per
peer); the peers then listen on their namespace's address and ``/status`` is read inside it.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peer.ops.procs import (  # noqa: E402
    PeerProcess,
    descendants,
    fetch_status_http,
    free_port,
    join_command,
    terminate,
    unwind_on_sigterm,
)
from peer.state.restore import REPLICA_STARTS_OVER, STAGE_LOST  # noqa: E402
from tools.swarm_case import P2P_PORT, STATUS_PORT, http_status  # noqa: E402
from tools.wan import LocalNet, Wan, WanConfig, check_available  # noqa: E402

logger = logging.getLogger("bench_churn")
REPO = Path(__file__).resolve().parent.parent
EVENTS = ("kill_bootstrap", "kill_stage", "graceful", "swarm_restart")
GAP_S = 12.0  # between the end of one event's recovery and the next event (plus up to as much again at random)
STALL_S = 10.0
SETTINGS = ("announce_every_s=1", "record_ttl_s=4", "dht_timeout_s=3", "rpc_timeout_s=5", "microbatch_timeout_s=15",
            "eval_every_s=5", "join_jitter_s=0.5", "drain_timeout_s=3", "state_load_timeout_s=30",
            "reachability_timeout_s=3", "rebalance_every_s=6", "rebalance_settle_s=1.5", "rebalance_cooldown_s=10",
            "checkpoint_every_s=5", "ban_base_s=1")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Swarm:
    """The peers of one run, by name; every process it started is reaped by ``close``."""

    def __init__(self, root: Path, args: argparse.Namespace, net: Wan | LocalNet) -> None:
        self.root, self.args, self.net = root, args, net
        self.peers: dict[str, PeerProcess] = {}
        self.all: list[PeerProcess] = []
        self.t0 = time.monotonic()
        self.events: list[dict[str, Any]] = []
        self.orphans = 0
        self.samples_lost = 0  # from the summaries of peers stopped and restarted during the run
        self.joiners: list[dict[str, Any]] = []  # restarted peers waiting for their first own step
        self.resumed: list[dict[str, Any]] = []

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    def spawn(self, name: str, initial: list[str], *, joiner: bool = False,
              before: tuple[int, int] | None = None) -> PeerProcess:
        d = self.root / name
        (d / "maddrs.txt").unlink(missing_ok=True)
        i = int(name[1:])  # p<i>: its namespace on the emulated WAN, the same across its restarts
        if isinstance(self.net, Wan):
            port, listen = STATUS_PORT, [f"/ip4/{self.net.ip(i)}/tcp/{P2P_PORT}"]
            cmd = join_command(d, port=port, run=self.args.run, stage="auto", settings=SETTINGS, initial=initial,
                               host_maddrs=listen, announce_maddrs=listen)
            p = PeerProcess.spawn(name, cmd, d, port, cwd=REPO, popen=functools.partial(self.net.popen, i),
                                  fetch=functools.partial(self._status_in, i))
        else:
            port = free_port()
            cmd = join_command(d, port=port, run=self.args.run, stage="auto", settings=SETTINGS, initial=initial)
            p = PeerProcess.spawn(name, cmd, d, port, cwd=REPO, popen=functools.partial(self.net.popen, i),
                                  fetch=fetch_status_http)
        self.peers[name] = p
        self.all.append(p)
        if joiner or before is not None:
            self.joiners.append({"peer": p, "spawned": time.monotonic(), "start_step": None, "before": before})
        return p

    def _status_in(self, i: int, peer: PeerProcess) -> dict[str, Any] | None:
        try:
            return self.net.call_in(i, lambda: http_status(peer.port), timeout=10.0)
        except (OSError, ValueError, TimeoutError):
            return None

    def dialable(self, p: PeerProcess, maddrs: list[str]) -> list[str]:
        """The multiaddr of ``p`` others join through (on the WAN: its namespace's address)."""
        want = f"/{self.net.ip(int(p.name[1:]))}/" if isinstance(self.net, Wan) else ""
        return [m for m in maddrs if "/p2p/" in m and want in m][:1]

    def entry(self) -> list[str]:
        """A live peer's multiaddr to join through."""
        for p in self.peers.values():
            if p.alive() and p.maddrs:
                return self.dialable(p, p.maddrs)
        return []

    def start(self) -> None:
        names = [f"p{i}" for i in range(self.args.peers)]
        first = self.spawn(names[0], [])
        initial = self.dialable(first, first.wait_maddrs(120))
        for name in names[1:]:
            self.spawn(name, initial)
            time.sleep(1.0)

    def statuses(self) -> dict[str, dict[str, Any]]:
        out = {}
        for name, p in self.peers.items():
            if p.alive():
                s = p.status()
                if s is not None:
                    out[name] = s
        return out

    def kill9(self, names: list[str]) -> None:
        tree = {n: descendants(self.peers[n].proc.pid) for n in names}
        for n in names:
            self.peers[n].signal(signal.SIGKILL)
        for n in names:
            self.peers[n].proc.wait(timeout=10)
        time.sleep(5.0)
        left = [pid for pids in tree.values() for pid in pids if alive(pid)]
        self.orphans += len(left)
        if left:
            logger.warning("orphans 5 s after kill -9 of %s: %s", names, left)

    def stop(self, names: list[str]) -> dict[str, tuple[int, int]]:
        """SIGTERM ``names`` and wait; their (step, stage) at exit from their summaries."""
        for n in names:
            self.peers[n].signal(signal.SIGTERM)
        steps = {}
        for n in names:
            try:
                self.peers[n].wait_exit(60)
            except Exception:
                terminate([self.peers[n].proc], 1.0)
            summary = self.peers[n].summary()
            steps[n] = (int(summary.get("steps", 0)), int(summary.get("stage") or 0))
            self.samples_lost += int(summary.get("samples_lost", 0))  # its folder's summary is rewritten on restart
        return steps

    def poll_joiners(self, snaps: dict[str, dict[str, Any]]) -> None:
        for j in list(self.joiners):
            p: PeerProcess = j["peer"]
            s = snaps.get(p.name)
            if s is None or s.get("state") != "training":
                continue
            if j["start_step"] is None:
                j["start_step"] = s["local_step"]
                if j["before"] is not None:
                    before, stage_before = j["before"]
                    kept = max((o["local_step"] for n, o in snaps.items() if n != p.name
                                and o.get("stage") == stage_before and o.get("state") == "training"), default=0)
                    self.resumed.append({"peer": p.name, "stage_before": stage_before, "before": before,
                                         "stage": s["stage"], "after": s["local_step"], "stage_kept": kept})
            elif s["local_step"] > j["start_step"]:
                j["first_step_s"] = round(time.monotonic() - j["spawned"], 1)
                self.joiners.remove(j)
                self.events.append({"t": self.now(), "first_step": p.name, "after_s": j["first_step_s"]})
                self.first_steps.append(j["first_step_s"])

    first_steps: list[float]

    def close(self) -> None:
        terminate([p.proc for p in self.all], 30.0)
        time.sleep(1.0)
        left = [pid for p in self.all for pid in descendants(p.proc.pid)]
        self.orphans += len(left)


def run_once(label: str, args: argparse.Namespace, events: tuple[str, ...], root: Path,
             steps: int | None = None) -> dict[str, Any]:
    """One run until a stage-0 peer reaches ``steps`` (default ``--steps``) and every event is over."""
    steps = args.steps if steps is None else steps
    rng = random.Random(args.seed)
    next_at: float | None = None  # when the next event is due (set once the whole swarm trains)
    net: Wan | LocalNet = (Wan(WanConfig(n=args.peers, delay_ms=args.delay_ms, rate_mbit=args.rate_mbit,
                                         stop_timeout_s=30.0)) if args.delay_ms or args.rate_mbit
                           else LocalNet(args.peers, stop_timeout_s=30.0))
    net.__enter__()
    sw = Swarm(root / label, args, net)
    sw.first_steps = []
    excused: list[tuple[float, float, str]] = []  # (from, to, why): stalls there are expected
    progress_t, best = time.monotonic(), 0
    stalls: list[dict[str, Any]] = []
    deadline = time.monotonic() + args.timeout_s
    done: set[str] = set()
    loads = []
    vals: list[float] = []
    try:
        sw.start()
        while time.monotonic() < deadline:
            time.sleep(1.0)
            loads.append(os.getloadavg()[0])
            snaps = sw.statuses()
            sw.poll_joiners(snaps)
            stage0 = [s["local_step"] for s in snaps.values() if s.get("stage") == 0 and s.get("state") == "training"]
            step = max(stage0, default=0)
            if step > best:
                if best > 0 and time.monotonic() - progress_t > STALL_S:
                    stalls.append({"from_s": round(progress_t - sw.t0, 1),
                                   "s": round(time.monotonic() - progress_t, 1), "at": progress_t})
                progress_t, best = time.monotonic(), step
            if best > 0 and not any(p.alive() for p in sw.peers.values()):
                break
            everyone = all(snaps.get(n, {}).get("state") == "training" for n, p in sw.peers.items() if p.alive())
            pending = [e for e in events if e not in done]
            if best >= steps and not pending and not sw.joiners:
                vals = [s["val_loss"] for s in snaps.values() if s.get("stage") == 0 and s.get("val_loss") is not None]
                if vals or time.monotonic() > deadline - 30:
                    break  # (after a restart, wait for the stage-0 peers' first evaluation)
            if not pending or not everyone or sw.joiners or best == 0:
                next_at = None  # one event at a time: the swarm recovers fully from the previous one first
                continue
            if next_at is None:
                next_at = time.monotonic() + GAP_S + rng.uniform(0, GAP_S)
            if time.monotonic() < next_at:
                continue
            e = pending[0]
            done.add(e)
            t = time.monotonic()
            _event(sw, e, snaps, rng)
            if e in ("kill_stage", "swarm_restart"):
                excused.append((t, time.monotonic() + 60.0, e))
            sw.events.append({"t": sw.now(), "event": e, "at_step": best})
            progress_t, next_at = max(progress_t, t), None
    finally:
        try:
            sw.close()
        finally:
            net.__exit__(None, None, None)  # the namespaces and the emulator, after every peer is reaped
    summaries = {p.name: p.summary() for p in sw.peers.values()}
    logs = "".join(p.log() for p in {p.dir: p for p in sw.all}.values())  # a restarted peer appends to its log
    # (judged on the unrounded start: a stall that starts at the event itself is the event's, not 0.1 s before it)
    real = [s for s in stalls if not any(a <= s["at"] <= b for a, b, _ in excused)]
    for s in stalls:
        del s["at"]
    return {
        "label": label, "events": sw.events, "steps_reached": best,
        "states_lost": logs.count(STAGE_LOST), "replicas_started_over": logs.count(REPLICA_STARTS_OVER),
        "samples_lost": sw.samples_lost + sum(int(s.get("samples_lost", 0)) for s in summaries.values()),
        "orphans": sw.orphans,
        "stalls_over_10s": len(real), "stalls": stalls,
        "final_val_loss": sum(vals) / len(vals) if vals else None,
        "joiner_first_step_s": sw.first_steps, "restart_resumed_step": sw.resumed,
        "stage_resumed_step": stage_resumed(sw.resumed),
        "stage_moves": logs.count("moving from stage"),
        "move_backoffs": logs.count("not moving to stage"),
        "elapsed_s": sw.now(), "loadavg_mean": round(sum(loads) / max(len(loads), 1), 2),
        "summaries": summaries,
    }


def stage_resumed(resumed: list[dict[str, Any]]) -> dict[int, dict[str, int]]:
    """Per stage: the most advanced step any peer held at exit, and the most advanced step the stage trained at once
    the peer was back (a peer may come back on the other stage; then the stage's own step is that of the replicas it
    left training there, ``stage_kept``; a stage whose state was lost restarts from 0 and shows ``after < before``)."""
    out: dict[int, dict[str, int]] = {}
    for r in resumed:
        out.setdefault(r["stage_before"], {"before": 0, "after": 0})
        out.setdefault(r["stage"], {"before": 0, "after": 0})
        out[r["stage_before"]]["before"] = max(out[r["stage_before"]]["before"], r["before"])
        out[r["stage_before"]]["after"] = max(out[r["stage_before"]]["after"], r.get("stage_kept", 0))
        out[r["stage"]]["after"] = max(out[r["stage"]]["after"], r["after"])
    return out


def _event(sw: Swarm, event: str, snaps: dict[str, dict[str, Any]], rng: random.Random) -> None:
    live = [n for n in sw.peers if sw.peers[n].alive()]
    logger.info("t=%.0f s: %s", sw.now(), event)
    if event == "kill_bootstrap":
        sw.kill9(["p0"])
        sw.spawn("p0", sw.entry(), joiner=True)
    elif event == "kill_stage":
        by_stage: dict[int, list[str]] = {}
        for n in live:
            if n in snaps:
                by_stage.setdefault(snaps[n]["stage"], []).append(n)
        victims = min(by_stage.values(), key=len) if by_stage else []
        sw.kill9(victims)
        time.sleep(2.0)
        for n in victims:
            sw.spawn(n, sw.entry(), joiner=True)
    elif event == "graceful":
        n = rng.choice([n for n in live if n != "p0"] or live)
        sw.spawn(n, sw.entry(), before=sw.stop([n])[n])
    elif event == "swarm_restart":
        steps = sw.stop(live)
        first = sw.spawn(live[0], [], before=steps[live[0]])
        initial = [m for m in first.wait_maddrs(120) if "/p2p/" in m][:1]
        for n in live[1:]:
            sw.spawn(n, initial, before=steps[n])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=6, help="peers started (default 6)")
    ap.add_argument("--steps", type=int, default=300, help="stage-0 steps of each run (--max-steps)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the churn schedule")
    ap.add_argument("--run", type=Path, default=REPO / "tests" / "runs" / "tiny.toml", help="run file")
    ap.add_argument("--events", default=",".join(EVENTS), help=f"churn events, comma-separated from {EVENTS}")
    ap.add_argument("--only", choices=("clean", "churn"), help="run only one of the two runs")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="give up a run after this long")
    ap.add_argument("--workdir", type=Path, help="keep the peers' folders here (default: a temporary folder)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--delay-ms", type=float, default=0.0,
                    help="one-way delay of the emulated WAN (RTT = 2x; 0 with --rate-mbit 0: loopback)")
    ap.add_argument("--rate-mbit", type=float, default=0.0, help="per-peer uplink cap on the emulated WAN (0: none)")
    args = ap.parse_args(argv)
    args.events = tuple(e for e in args.events.split(",") if e)
    bad = set(args.events) - set(EVENTS)
    if bad or args.peers < 3 or args.steps < 10:
        ap.error(f"unknown events {sorted(bad)}" if bad else "need --peers >= 3 and --steps >= 10")
    if args.delay_ms < 0 or args.rate_mbit < 0:
        ap.error("--delay-ms and --rate-mbit must be >= 0")
    if args.delay_ms or args.rate_mbit:
        problem = check_available()
        if problem:
            ap.error(f"the emulated WAN cannot run here: {problem}")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    unwind_on_sigterm()  # unwind through Swarm.close: reap every peer
    with tempfile.TemporaryDirectory(prefix="bench_churn.") as tmp:
        root = args.workdir or Path(tmp)
        runs = {}
        if args.only != "clean":  # first: it runs past --steps until every event is over and the peers train again
            runs["churn"] = run_once("churn", args, args.events, root)
        if args.only != "churn":  # then the control, to the step the churn run reached: losses at equal length
            reached = runs["churn"]["steps_reached"] if "churn" in runs else args.steps
            runs["clean"] = run_once("clean", args, (), root, steps=max(args.steps, reached))
    churn = runs.get("churn") or runs["clean"]
    out = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "nproc": os.cpu_count(), "peers": args.peers, "steps": args.steps, "seed": args.seed,
        "network": ({"delay_ms": args.delay_ms, "rtt_ms": 2 * args.delay_ms, "rate_mbit": args.rate_mbit}
                    if args.delay_ms or args.rate_mbit else "loopback"),
        "states_lost": churn["states_lost"], "replicas_started_over": churn["replicas_started_over"],
        "samples_lost": churn["samples_lost"], "orphans": churn["orphans"],
        "stalls_over_10s": churn["stalls_over_10s"],
        "final_val_loss": {k: r["final_val_loss"] for k, r in runs.items()},
        "joiner_first_step_s": churn["joiner_first_step_s"], "restart_resumed_step": churn["restart_resumed_step"],
        "stage_resumed_step": churn["stage_resumed_step"],
        "runs": {k: {kk: vv for kk, vv in r.items() if kk != "summaries"} for k, r in runs.items()},
        "summaries": {k: r["summaries"] for k, r in runs.items()},
    }
    text = json.dumps(out, indent=1, default=str)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    brief = {k: v for k, v in out.items() if k not in ("runs", "summaries")}
    print(json.dumps(brief, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
