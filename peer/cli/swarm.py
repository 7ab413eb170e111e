"""`asyncmesh-peer swarm`: start N peer processes on loopback and show the swarm (the newcomer's first command).

The parent starts one ``join`` child per peer: the first starts the swarm, the others join it one after another with
``--stage auto`` (each starts once the previous one trains, so its choice sees every stage taken so far and the stages
fill before any gets a second replica). Children run ``--no-tui`` with a status endpoint on a free port; the parent
polls those endpoints and draws the swarm view of ``peer.ops.dashboard`` from them. When every stage-0 peer has reached
``--max-steps`` the parent stops the others with SIGTERM (they drain and checkpoint), then merges the children's
summaries into one. Ctrl-C stops every child the same way; any child still alive after the deadline is killed by PID.
"""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from peer.errors import UserError, user_input
from peer.ops.procs import PeerProcess, PeerProcessError, free_port, join_command, p2p_maddrs, terminate

HELP = "Start N peers on this machine (loopback) training the embedded default run, and show the swarm."
EPILOG = """examples:
  the newcomer's swarm: 4 peers (2 stages x 2 replicas) with a live dashboard, Ctrl-C to stop:
    asyncmesh-peer swarm --peers 4
  a scripted run: 60 steps per stage-0 peer, figures as JSON:
    asyncmesh-peer swarm --peers 4 --max-steps 60 --no-tui --summary-json out/swarm.json
  the synchronous baseline on the same code, for comparison:
    asyncmesh-peer swarm --peers 4 --max-steps 60 --no-tui --mode sync --summary-json out/sync.json"""

SUMMED = ("microbatches_dropped", "microbatches_requeued", "retries", "averaging_rounds_ok", "averaging_rounds_failed")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peers", type=int, default=4, metavar="N", help="peer processes to start (>= the run's stages)")
    p.add_argument("--run", default=None, metavar="FILE", help="run TOML (default: the embedded default run)")
    p.add_argument("--max-steps", type=int, default=0, metavar="N",
                   help="stop after N steps of the stage-0 peers (the swarm also ends early, with the reason, when a "
                        "peer exits and leaves a stage with no live peer)")
    p.add_argument("--no-tui", action="store_true", help="no dashboard: log a status line every few seconds")
    p.add_argument("--summary-json", default=None, metavar="PATH", help="write the swarm's figures here on exit")
    p.add_argument("--mode", default="async", choices=("async", "sync"), help="async (default) or sync baseline")
    p.add_argument("--workdir", default=None, metavar="DIR",
                   help="identities, checkpoints, logs and summaries of the children (default: a temp folder)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", dest="overrides",
                   help="peer setting passed to every child (see `asyncmesh-peer join --help`)")
    p.add_argument("--timeout", type=float, default=0.0, metavar="S", help="stop the swarm after S seconds (0: never)")


class Swarm:
    """N child peers; each is reaped (SIGTERM, then SIGKILL of it and its descendants by PID) whatever happens."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args, self.workdir = args, workdir
        self.children: list[PeerProcess] = []
        self.status: dict[int, dict[str, Any]] = {}

    def spawn(self, i: int, initial: list[str]) -> PeerProcess:
        d = self.workdir / f"peer{i}"
        port = free_port()
        cmd = join_command(d, port=port, run=self.args.run, mode=self.args.mode, max_steps=self.args.max_steps,
                           settings=self.args.overrides, initial=initial)
        child = PeerProcess.spawn(f"peer{i}", cmd, d, port, i=i)
        self.children.append(child)
        return child

    def poll(self) -> list[dict[str, Any]]:
        import asyncio

        from peer.ops.status_server import fetch_status

        async def all_status() -> list[Any]:
            return await asyncio.gather(*(fetch_status("127.0.0.1", c.port, timeout=1.0) for c in self.children),
                                        return_exceptions=True)
        out = []
        for c, snap in zip(self.children, asyncio.run(all_status()), strict=True):
            if isinstance(snap, dict):
                self.status[c.info["i"]] = snap
                out.append(snap)
            else:
                out.append({"name": c.name, "error": "starting" if c.alive() else "exited"})
        return out

    def wait_stage(self, child: PeerProcess, timeout: float) -> None:
        """Wait until the child trains (its stage is announced), so the next joiner's auto choice sees it."""
        def training() -> bool:
            self.poll()
            snap = self.status.get(child.info["i"])
            return bool(snap and snap.get("stage") is not None and snap.get("state") == "training")
        try:
            child.wait_for(training, timeout, "a stage", every_s=0.3)
        except PeerProcessError as e:
            raise RuntimeError(str(e).split(";")[0] + f"; see {child.dir / 'log.txt'}") from None

    def finished(self, n_stages: int) -> str | None:
        """Why the swarm is over, or None while it can still train.

        Over when every stage-0 peer has exited (they drive the pipeline), or when a peer has exited and some stage
        has no live peer left: the others could only wait (with ``--max-steps``, peers that started late would
        otherwise wait forever for a stage whose peers already finished).
        """
        stage0 = [c for c in self.children if self.status.get(c.info["i"], {}).get("stage") == 0]
        if stage0 and not any(c.alive() for c in stage0):
            return "every stage-0 peer has finished"
        gone = [c for c in self.children if not c.alive()]
        if not gone:
            return None
        live = {self.status.get(c.info["i"], {}).get("stage") for c in self.children if c.alive()}
        empty = [s for s in range(n_stages) if s not in live]
        if not empty:
            return None
        c = gone[0]
        return (f"{c.name} exited (code {c.proc.returncode}) and stage {empty[0]} has no live peer left, so "
                f"the others cannot train; see {c.dir / 'log.txt'}")

    def reap(self, deadline_s: float) -> None:
        terminate([c.proc for c in self.children], deadline_s)

    def summary(self) -> dict[str, Any]:
        return merge_summaries([c.summary() for c in self.children], mode=self.args.mode)


def _mean(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


def merge_summaries(peers: list[dict[str, Any]], *, mode: str) -> dict[str, Any]:
    """The swarm's figures: tokens/s summed over stage-0 peers (each token enters the pipeline there once).

    Steps and losses are over the stage-0 peers that trained: one that started as the swarm ended (no step, no
    loss) would otherwise report the swarm at step 0. Every peer's own figures stay in ``per_peer``.
    """
    s0 = [p for p in peers if p.get("stage") == 0]
    trained = [p for p in s0 if (p.get("steps") or 0) > 0 and p.get("final_loss") is not None] or s0
    return {
        "mode": mode, "peers": len(peers),
        "tokens_per_s": sum(p.get("tokens_per_s") or 0.0 for p in s0),
        "steps": min((p.get("steps", 0) for p in trained), default=0),
        "initial_loss": _mean([p.get("initial_loss") for p in trained]),
        "final_loss": _mean([p.get("final_loss") for p in trained]),
        "final_val_loss": _mean([p.get("final_val_loss") for p in trained]),
        **{k: sum(int(p.get(k) or 0) for p in peers) for k in SUMMED},
        "per_peer": peers,
    }


def run(args: argparse.Namespace) -> int:
    from trainer.config import RunConfig

    with user_input():
        run_cfg = RunConfig.from_toml(args.run) if args.run else RunConfig.default()
    if args.peers < run_cfg.n_stages:
        raise UserError(f"--peers {args.peers} cannot fill the run's {run_cfg.n_stages} stages; pass at least "
                         f"{run_cfg.n_stages}")
    if args.max_steps < 0 or args.timeout < 0:
        raise UserError("--max-steps and --timeout must be >= 0")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="asyncmesh-swarm-"))
    swarm = Swarm(args, workdir)
    stop = {"flag": False}
    previous = {s: signal.signal(s, lambda *_: stop.__setitem__("flag", True))
                for s in (signal.SIGINT, signal.SIGTERM)}
    start = time.monotonic()
    try:
        first = swarm.spawn(0, [])
        initial = p2p_maddrs(_wait_maddrs(first, 60))[:1]
        print(f"swarm of {args.peers} peers, run {run_cfg.name} ({run_cfg.run_id}); files in {workdir}")
        print(f"join it from this machine: asyncmesh-peer join --stage auto --initial-peers {initial[0]}")
        swarm.wait_stage(first, 90)
        for i in range(1, args.peers):
            if not all(c.alive() for c in swarm.children):
                print(f"a peer already exited (--max-steps {args.max_steps} reached?); not starting the other "
                      f"{args.peers - i} peers", flush=True)
                break
            child = swarm.spawn(i, initial)
            swarm.wait_stage(child, 90)
            initial = (initial + p2p_maddrs(_wait_maddrs(child, 5))[:1])[-3:]
        _watch(swarm, args, stop, start, run_cfg.n_stages)
    finally:
        swarm.reap(deadline_s=30.0)
        for s, h in previous.items():
            signal.signal(s, h)
    result = swarm.summary()
    if args.summary_json:
        Path(args.summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary_json).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "per_peer"}, indent=1))
    return 0 if all(p.get("exit_code") == 0 for p in result["per_peer"]) else 1


def _wait_maddrs(child: PeerProcess, timeout: float) -> list[str]:
    try:
        return child.wait_maddrs(timeout)
    except PeerProcessError as e:
        raise RuntimeError(str(e).split(";")[0] + f"; see {child.dir / 'log.txt'}") from None


def _watch(swarm: Swarm, args: argparse.Namespace, stop: dict[str, bool], start: float, n_stages: int) -> None:
    dash = live = None
    if not args.no_tui:
        from rich.live import Live

        from peer.ops.dashboard import Dashboard

        dash = Dashboard([], title="asyncmesh swarm")
        live = Live(dash.render(), auto_refresh=False)
        live.start()
    last_line = 0.0
    try:
        while not stop["flag"]:
            if args.timeout and time.monotonic() - start > args.timeout:
                break
            snaps = swarm.poll()
            if (reason := swarm.finished(n_stages)) is not None:
                if live is not None:
                    live.stop()
                    live = None
                print(f"stopping the swarm: {reason}", flush=True)
                break
            if dash is not None:
                dash.update(snaps)
                live.update(dash.render(), refresh=True)
            elif time.monotonic() - last_line > 5:
                last_line = time.monotonic()
                steps = [f"s{s.get('stage')}:{s.get('local_step')}" for s in snaps if "stage" in s]
                print(f"[{time.monotonic() - start:5.0f}s] " + " ".join(steps), flush=True)
            time.sleep(0.5)
    finally:
        if live is not None:
            live.stop()
