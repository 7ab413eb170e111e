"""`asyncmesh-peer swarm`: start N peer processes on loopback and show the swarm (the newcomer's first command).

The parent starts one ``join`` child per peer: the first starts the swarm, the others join it one after another with
``--stage auto``; each starts once the previous one has claimed its stage in the DHT, so its choice sees every stage
taken so far and the stages fill before any gets a second replica. Children run ``--no-tui`` with a status endpoint on
a free port; the parent polls those endpoints and draws the swarm view of ``peer.ops.dashboard`` from the first
second on, with a row per peer and its phase (waiting, starting, joining DHT, choosing stage, loading state,
training). Start-up waits on progress, not on a clock: a peer is given up on only when it shows no progress for
``--startup-stall-s`` (see ``peer.ops.startup``). A late peer that fails once every stage has a peer is stopped and
the swarm goes on without it; one that fails before is the end of the start-up (exit code 3).

When every stage-0 peer has reached ``--max-steps`` the parent stops the others with SIGTERM (they drain and
checkpoint), then merges the children's summaries into one. Ctrl-C or SIGTERM, in any phase, stops every child the
same way: peers still starting get ``STARTING_STOP_S``, training peers their drain; a second Ctrl-C kills them at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from peer.config import MODES, Mode
from peer.errors import DaemonError, UserError, user_input
from peer.lifecycle import PeerState
from peer.ops.procs import PeerProcess, cpu_seconds, free_port, join_command, kill_tree, p2p_maddrs, terminate
from peer.ops.startup import SHORT_PHASE, Phase, StartupWatch, phase

HELP = "Start N peers on this machine (loopback) training the embedded default run, and show the swarm."
EPILOG = """examples:
  the newcomer's swarm: 4 peers (2 stages x 2 replicas) with a live dashboard, Ctrl-C to stop:
    asyncmesh-peer swarm --peers 4
  a scripted run: 60 steps per stage-0 peer, figures as JSON:
    asyncmesh-peer swarm --peers 4 --max-steps 60 --no-tui --summary-json out/swarm.json
  the synchronous baseline on the same code, for comparison:
    asyncmesh-peer swarm --peers 4 --max-steps 60 --no-tui --mode sync --summary-json out/sync.json
  many peers on a busy machine: allow each phase of a start-up 5 minutes without visible progress:
    asyncmesh-peer swarm --peers 12 --run tests/runs/tiny.toml --startup-stall-s 300
stopping: Ctrl-C or SIGTERM, in any phase. Peers still starting stop within 5 s; training peers drain in-flight
work and write a final checkpoint (their drain_timeout_s); a second Ctrl-C kills every peer at once.
exit codes:
  0    the swarm ran; every peer that trained stopped cleanly (--max-steps, --timeout, Ctrl-C or SIGTERM);
       peers still starting when it ended are listed in the summary as stopped_while_starting
  1    a peer exited with an error, or a late peer was given up on during start-up (see the summary and its log)
  2    bad input: a flag or the run file (the message says which)
  3    start-up failed: a peer exited or showed no progress for --startup-stall-s before every stage had a peer
  130  stopped by Ctrl-C or SIGTERM before every stage had a peer"""

SUMMED = ("microbatches_dropped", "microbatches_requeued", "retries", "averaging_rounds_ok", "averaging_rounds_failed",
          "spotcheck_sent", "spotcheck_failed", "recheck_passed", "recheck_failed",
          "fwdcheck_passed", "fwdcheck_failed")
STARTING_STOP_S = 5.0  # a peer still starting has no work to drain: it must be gone within this
DRAIN_MARGIN_S = 20.0  # beyond a training peer's drain_timeout_s: final checkpoint, DHT withdrawal, p2pd shutdown
POLL_S = 0.5
EXIT_PEER_FAILED, EXIT_INTERRUPTED = 1, 130


class SwarmStartError(DaemonError):
    """A peer exited or stalled before every stage had a peer: the swarm cannot train."""

    exit_code = 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peers", type=int, default=4, metavar="N", help="peer processes to start (>= the run's stages)")
    p.add_argument("--run", default=None, metavar="FILE", help="run TOML (default: the embedded default run)")
    p.add_argument("--max-steps", type=int, default=0, metavar="N",
                   help="stop after N steps of the stage-0 peers (the swarm also ends early, with the reason, when a "
                        "peer exits and leaves a stage with no live peer)")
    p.add_argument("--no-tui", action="store_true", help="no dashboard: log a status line every few seconds")
    p.add_argument("--summary-json", default=None, metavar="PATH", help="write the swarm's figures here on exit")
    p.add_argument("--mode", default=Mode.ASYNC.value, choices=MODES, help="async (default) or sync baseline")
    p.add_argument("--workdir", default=None, metavar="DIR",
                   help="identities, checkpoints, logs and summaries of the children (default: a temp folder)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", dest="overrides",
                   help="peer setting passed to every child (see `asyncmesh-peer join --help`)")
    p.add_argument("--timeout", type=float, default=0.0, metavar="S", help="stop the swarm after S seconds (0: never)")
    p.add_argument("--startup-stall-s", type=float, default=180.0, metavar="S",
                   help="give up on a starting peer that shows no progress (no new phase, log line, status change "
                        "or, before its status answers, CPU time) for S seconds (default 180)")


class StopFlag:
    """Set by the first Ctrl-C or SIGTERM (stop: drain the peers); ``hurry`` by the second (kill them now)."""

    def __init__(self) -> None:
        self.event, self.hurry = threading.Event(), threading.Event()

    def __call__(self, signum: int, frame: object) -> None:
        (self.hurry if self.event.is_set() else self.event).set()

    @property
    def requested(self) -> bool:
        return self.event.is_set()


class Swarm:
    """N child peers; each is reaped (SIGTERM, then SIGKILL of it and its descendants by PID) whatever happens."""

    def __init__(self, args: argparse.Namespace, workdir: Path, n_stages: int = 0) -> None:
        self.args, self.workdir, self.n_stages = args, workdir, n_stages
        self.children: list[PeerProcess] = []
        self.status: dict[int, dict[str, Any]] = {}
        self.watches: dict[int, StartupWatch] = {}
        self.trained: set[int] = set()  # peers that reached 'training': out of start-up for good
        self.failed: dict[int, str] = {}  # late peers given up on during start-up, and why
        self.initial: list[str] = []
        self.spawning_closed = False
        self.notes: list[str] = []  # one-line events for the operator, printed above the dashboard

    # ----- children -------------------------------------------------------------------------------------------------
    def spawn(self, i: int, initial: list[str]) -> PeerProcess:
        d = self.workdir / f"peer{i}"
        port = free_port()
        cmd = join_command(d, port=port, run=self.args.run, mode=self.args.mode, max_steps=self.args.max_steps,
                           settings=self.args.overrides, initial=initial)
        child = PeerProcess.spawn(f"peer{i}", cmd, d, port, i=i)
        self.children.append(child)
        self.watches[i] = StartupWatch(self.args.startup_stall_s)
        return child

    def poll(self) -> list[dict[str, Any]]:
        """One row per planned peer: its ``/status`` (with ``name``), or ``{"name", "phase"}`` while it has none."""
        from peer.ops.status_server import fetch_status

        async def all_status() -> list[dict[str, Any] | BaseException]:
            return await asyncio.gather(*(fetch_status("127.0.0.1", c.port, timeout=1.0) for c in self.children),
                                        return_exceptions=True)
        rows: list[dict[str, Any]] = []
        for c, snap in zip(self.children, asyncio.run(all_status()), strict=True):
            i = c.info["i"]
            if i in self.failed:
                row: dict[str, Any] = {"name": c.name, "phase": Phase.FAILED}
            elif isinstance(snap, dict):
                self.status[i] = snap
                row = {**snap, "name": c.name}
                if snap.get("state") in (PeerState.TRAINING, PeerState.DRAINING, PeerState.STOPPED):
                    self.trained.add(i)
            elif not c.alive():
                row = {"name": c.name, "phase": Phase.EXITED}
            elif i in self.status:  # it answered before: busy or hung, not starting
                row = {"name": c.name, "error": "busy or stopping"}
            else:
                row = {"name": c.name, "phase": Phase.STARTING}
            if c.alive() and i not in self.trained and i in self.watches:
                log = c.dir / "log.txt"
                self.watches[i].observe(row, log_bytes=log.stat().st_size if log.exists() else 0,
                                        cpu_s=cpu_seconds(c.proc.pid))
            rows.append(row)
        rows += [{"name": f"peer{i}", "phase": Phase.WAITING} for i in range(len(self.children), self.args.peers)]
        return rows

    # ----- start-up -------------------------------------------------------------------------------------------------
    def stages_filled(self) -> bool:
        """Every stage has a live peer that trains."""
        live = {self.status[i].get("stage") for i in self.trained if self._alive(i)}
        return all(s in live for s in range(self.n_stages))

    def _alive(self, i: int) -> bool:
        return any(c.info["i"] == i and c.alive() for c in self.children)

    def starting(self) -> bool:
        """Start-up is not over: a peer is still to be started, or one that was has not trained yet."""
        todo = not self.spawning_closed and len(self.children) < self.args.peers
        return todo or any(c.info["i"] not in self.trained and c.info["i"] not in self.failed and c.alive()
                           for c in self.children)

    def step_startup(self) -> None:
        """Check the starting peers and start the next one when the previous one has claimed its stage."""
        for c in self.children:
            i = c.info["i"]
            if i in self.trained or i in self.failed:
                continue
            w = self.watches[i]
            if not c.alive():
                self._give_up(c, f"exited with code {c.proc.returncode} while {w.phase}", "see its log")
            elif w.stalled():
                self._give_up(c, f"showed no progress for {w.idle_s():.0f} s while {w.phase}",
                              "on a busy machine pass a larger --startup-stall-s or start fewer --peers")
        if self.spawning_closed or len(self.children) >= self.args.peers:
            return
        if self.children:
            last = self.children[-1]
            if last.info["i"] not in self.failed and self.status.get(last.info["i"], {}).get("stage") is None:
                return  # the previous peer has not claimed its stage yet: the next one's choice would not see it
            if any(not c.alive() and c.info["i"] not in self.failed for c in self.children):
                self.spawning_closed = True
                self.notes.append(f"a peer already exited (--max-steps {self.args.max_steps} reached?); not "
                                  f"starting the other {self.args.peers - len(self.children)} peers")
                return
            first = p2p_maddrs(self.children[0].maddrs)[:1]
            if not first:
                return  # the first peer writes its multiaddrs once its DHT is up
            if not self.initial:
                self.initial = first
                self.notes.append(f"join it from this machine: asyncmesh-peer join --stage auto "
                                  f"{'' if self.args.run is None else f'--run {self.args.run} '}"
                                  f"--initial-peers {first[0]}")
            elif last.info["i"] not in self.failed:  # a few entry points, so one peer's exit does not orphan joiners
                self.initial = (self.initial + p2p_maddrs(last.maddrs)[:1])[-3:]
        self.spawn(len(self.children), self.initial)

    def _give_up(self, c: PeerProcess, why: str, advice: str) -> None:
        where = f"{c.name} {why}; see {c.dir / 'log.txt'}"
        if not self.stages_filled():
            raise SwarmStartError(f"{where}; {advice}")
        self.failed[c.info["i"]] = why
        self.notes.append(f"{where}; the swarm goes on without it ({advice})")
        terminate([c.proc], STARTING_STOP_S)

    # ----- the end --------------------------------------------------------------------------------------------------
    def finished(self, n_stages: int) -> str | None:
        """Why the swarm is over, or None while it can still train.

        Over when every stage-0 peer has exited (they drive the pipeline), or when a peer has exited and some stage
        has no live peer left: the others could only wait (with ``--max-steps``, peers that started late would
        otherwise wait forever for a stage whose peers already finished). Peers given up on during start-up do not
        count: the swarm went on without them.
        """
        kids = [c for c in self.children if c.info["i"] not in self.failed]
        stage0 = [c for c in kids if self.status.get(c.info["i"], {}).get("stage") == 0]
        if stage0 and not any(c.alive() for c in stage0):
            return "every stage-0 peer has finished"
        gone = [c for c in kids if not c.alive()]
        if not gone:
            return None
        live = {self.status.get(c.info["i"], {}).get("stage") for c in kids if c.alive()}
        empty = [s for s in range(n_stages) if s not in live]
        if not empty:
            return None
        c = gone[0]
        return (f"{c.name} exited (code {c.proc.returncode}) and stage {empty[0]} has no live peer left, so "
                f"the others cannot train; see {c.dir / 'log.txt'}")

    def reap(self, drain_s: float, hurry: threading.Event | None = None) -> None:
        """SIGTERM every child; wait up to ``STARTING_STOP_S`` for peers still starting and ``drain_s`` for peers
        that trained (sooner if ``hurry`` is set), then SIGKILL what is left with its descendants."""
        now = time.monotonic()
        deadline: dict[int, float] = {}
        for c in self.children:
            if c.alive():
                c.signal(signal.SIGTERM)
                deadline[c.info["i"]] = now + (drain_s if c.info["i"] in self.trained else STARTING_STOP_S)
        while (hurry is None or not hurry.is_set()) and any(
                c.alive() and time.monotonic() < deadline.get(c.info["i"], 0.0) for c in self.children):
            time.sleep(0.1)
        for c in self.children:
            if c.alive():
                print(f"{c.name} did not stop in time; killing it and its descendants", flush=True)
                kill_tree(c.proc.pid)
        terminate([c.proc for c in self.children], 1.0)  # reaps them, and kills what their sessions left behind

    def counted(self) -> list[PeerProcess]:
        """The peers the swarm's figures and exit code are about: those that trained, and those given up on.
        A peer the swarm itself stopped while it was still starting (the run ended first) took no part."""
        return [c for c in self.children if c.info["i"] in self.trained or c.info["i"] in self.failed]

    def summary(self) -> dict[str, Any]:
        out = merge_summaries([c.summary() for c in self.counted()], mode=self.args.mode)
        if self.failed:
            out["failed_to_start"] = {f"peer{i}": why for i, why in sorted(self.failed.items())}
        late = [c.name for c in self.children if c not in self.counted()]
        if late:
            out["stopped_while_starting"] = late
        return out


def _mean(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


def _by_stage(peers: list[dict[str, Any]]) -> dict[str, int]:
    """Tokens counted on each stage over the swarm (a peer that moved adds to each stage it served)."""
    out: dict[str, int] = {}
    for p in peers:
        for s, n in (p.get("tokens_by_stage") or {}).items():
            out[s] = out.get(s, 0) + int(n)
    return dict(sorted(out.items()))


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
        "tokens_by_stage": _by_stage(peers),
        "per_peer": peers,
    }


def run(args: argparse.Namespace) -> int:
    from peer.cli.join import parse_overrides
    from peer.config import PeerConfig
    from trainer.config import RunConfig

    with user_input(f"--run {args.run}" if args.run else ""):
        run_cfg = RunConfig.from_toml(args.run) if args.run else RunConfig.default()
    if args.peers < run_cfg.n_stages:
        raise UserError(f"--peers {args.peers} cannot fill the run's {run_cfg.n_stages} stages; pass at least "
                         f"{run_cfg.n_stages}")
    if args.max_steps < 0 or args.timeout < 0:
        raise UserError("--max-steps and --timeout must be >= 0")
    if args.startup_stall_s <= 0:
        raise UserError(f"--startup-stall-s must be positive (seconds), got {args.startup_stall_s:g}")
    with user_input("--set"):
        drain_s = PeerConfig(**parse_overrides(args.overrides)).drain_timeout_s + DRAIN_MARGIN_S
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="asyncmesh-swarm-"))
    swarm = Swarm(args, workdir, run_cfg.n_stages)
    stop = StopFlag()
    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    print(f"swarm of {args.peers} peers, run {run_cfg.name} ({run_cfg.run_id}); files in {workdir}", flush=True)
    view = View(not args.no_tui, f"{run_cfg.name}")
    interrupted_in_startup = False
    try:
        _watch(swarm, args, stop, view, run_cfg.n_stages)
        interrupted_in_startup = stop.requested and not swarm.stages_filled()
        if stop.requested:
            view.note("stopping the swarm (Ctrl-C or SIGTERM): peers drain and checkpoint; Ctrl-C again kills them")
    finally:
        view.close()
        swarm.reap(drain_s, stop.hurry)
        for s, h in previous.items():
            signal.signal(s, h)
    result = swarm.summary()
    if args.summary_json:
        Path(args.summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary_json).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "per_peer"}, indent=1))
    if interrupted_in_startup:
        return EXIT_INTERRUPTED
    ok = all(p.get("exit_code") == 0 for p, c in zip(result["per_peer"], swarm.counted(), strict=True)
             if c.info["i"] not in swarm.failed)
    return 0 if ok and not swarm.failed else EXIT_PEER_FAILED


class View:
    """The live dashboard (or, with --no-tui, a status line every few seconds) and one-line notes above it."""

    def __init__(self, tui: bool, title: str) -> None:
        self.dash = self.live = None
        self.last_line = 0.0
        self.started = time.monotonic()
        if tui:
            from rich.live import Live

            from peer.ops.dashboard import Dashboard

            self.dash = Dashboard([], title=title)
            self.live = Live(self.dash.render(), auto_refresh=False)
            self.live.start()

    def note(self, text: str) -> None:
        if self.live is not None:
            self.live.console.print(text, markup=False, highlight=False)
        else:
            print(text, flush=True)

    def draw(self, rows: list[dict[str, Any]]) -> None:
        if self.dash is not None and self.live is not None:
            self.dash.update(rows)
            self.live.update(self.dash.render(), refresh=True)
        elif time.monotonic() - self.last_line > 5:
            self.last_line = time.monotonic()
            print(f"[{time.monotonic() - self.started:5.0f}s] " + " ".join(map(_cell, rows)), flush=True)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None


def _cell(row: dict[str, Any]) -> str:
    ph = phase(row)
    if ph in (Phase.TRAINING, Phase.DRAINING) and row.get("stage") is not None:
        return f"s{row['stage']}:{row.get('local_step', 0)}"
    return f"{row.get('name', '?')}:{SHORT_PHASE.get(ph, ph)}"


def _watch(swarm: Swarm, args: argparse.Namespace, stop: StopFlag, view: View, n_stages: int) -> None:
    """Poll, start peers, draw; return on a stop request, --timeout, or when the swarm can no longer train."""
    start = time.monotonic()
    shown = 0
    try:
        while not stop.requested:
            if args.timeout and time.monotonic() - start > args.timeout:
                swarm.notes.append(f"stopping the swarm: --timeout {args.timeout:g} s reached")
                break
            swarm.step_startup()
            rows = swarm.poll()
            ending = any(not c.alive() and c.info["i"] in swarm.trained for c in swarm.children)
            if (ending or not swarm.starting()) and (reason := swarm.finished(n_stages)) is not None:
                swarm.notes.append(f"stopping the swarm: {reason}")
                break
            for text in swarm.notes[shown:]:
                view.note(text)
            shown = len(swarm.notes)
            view.draw(rows)
            stop.event.wait(POLL_S)
    finally:
        for text in swarm.notes[shown:]:
            view.note(text)
