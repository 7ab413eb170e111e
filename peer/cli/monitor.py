"""`asyncmesh-peer monitor`: watch a whole swarm from the DHT without taking part in it.

It joins the DHT as a client (it serves nothing and stores nothing), reads the run's peer records with
``membership.records.fetch_swarm`` every ``--interval`` seconds and shows, per stage, the peers serving it with their
state, throughput, queue, state version and loss; which stages are covered; the bottleneck stage (the least announced
throughput: adding a peer there speeds up the whole swarm); the swarm's tokens/s (those of stage 0, where each token
enters the pipeline) and its mean training loss; and the swarm's progress (``peer.ops.progress``): run name, tokens
trained, step against the run's ``total_steps``, ETA, validation loss and its trend. ``--json`` prints one JSON
document per read for scripts (``--once --json``: one). ``--tensorboard DIR`` also logs the swarm's curves for
TensorBoard (an optional extra: ``pip install 'asyncmesh[tensorboard]'``).

Records are keyed by the run id, so monitor must be given the same run file as the peers (``--run``; the embedded
default otherwise); with the wrong one it finds nobody and says so.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from peer.errors import UserError, user_input
from peer.lifecycle import PeerState

if TYPE_CHECKING:
    import asyncio

    from hivemind import DHT
    from rich.console import JustifyMethod, RenderableType
    from torch.utils.tensorboard import SummaryWriter

    from peer.membership.records import PeerRecord
    from peer.ops.progress import SwarmProgress
    from trainer.config import RunConfig

HELP = "Watch a whole swarm from the DHT (client only): peers per stage, coverage, bottleneck, tokens/s, loss."
EPILOG = """examples:
  asyncmesh-peer monitor --initial-peers /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...
  asyncmesh-peer monitor --initial-peers MADDR --run myrun.toml --interval 5
  asyncmesh-peer monitor --initial-peers MADDR --once --json | jq .swarm_tokens_per_s
  asyncmesh-peer monitor --initial-peers MADDR --json | jq -c '.progress | {step, eta_s, val_loss}'
  asyncmesh-peer monitor --initial-peers MADDR --tensorboard runs/swarm   # then: tensorboard --logdir runs
"""

EXIT_OK, EXIT_EMPTY = 0, 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR",
                        help="multiaddrs of any running peers of the swarm")
    parser.add_argument("--run", metavar="FILE", default=None,
                        help="the run file the peers use (default: the embedded default run)")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between DHT reads (default 2)")
    parser.add_argument("--timeout", type=float, default=5.0, help="hard timeout of one DHT read, s (default 5)")
    parser.add_argument("--wait", type=float, default=15.0,
                        help="--once: keep reading this long until some peer shows up (default 15 s)")
    parser.add_argument("--once", action="store_true", help="read once, print, exit (1 if no peer was found)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--tensorboard", metavar="DIR", default=None,
                        help="also log the swarm's tokens/s, loss, validation loss, step and tokens to DIR for "
                             "TensorBoard (needs the 'tensorboard' extra)")


def swarm_view(records: Mapping[str, PeerRecord], n_stages: int, run_id: str,
               progress: dict[str, Any] | None = None) -> dict[str, Any]:
    """Summarise PeerRecords (keyed by peer id) into the JSON document monitor prints. Pure; unit-tested.
    ``progress`` is the ``SwarmProgress`` view after this read (None: not computed)."""
    stages: list[dict[str, Any]] = []
    for stage in range(n_stages):
        peers = sorted((r for r in records.values() if r.stage == stage), key=lambda r: r.peer_id)
        training = [r for r in peers if r.state == PeerState.TRAINING]
        losses = [r.loss for r in training if r.loss is not None]
        stages.append({
            "stage": stage,
            "peers": [_record_dict(r) for r in peers],
            "n_peers": len(peers),
            "n_training": len(training),
            "throughput": sum(r.throughput for r in training),
            "tokens_per_s": sum(r.tokens_per_s for r in training),
            "loss": sum(losses) / len(losses) if losses else None,
        })
    strays = sorted((r for r in records.values() if not 0 <= r.stage < n_stages), key=lambda r: r.peer_id)
    covered = [s["stage"] for s in stages if s["n_training"] > 0]
    bottleneck = min(stages, key=lambda s: (s["throughput"], s["stage"]))["stage"] if stages else None
    last = stages[-1] if stages else None  # the loss is computed there
    return {
        "run_id": run_id,
        "time": time.time(),
        "n_stages": n_stages,
        "n_peers": len(records),
        "coverage": len(covered) / n_stages if n_stages else 0.0,
        "missing_stages": [s["stage"] for s in stages if s["n_training"] == 0],
        "bottleneck_stage": bottleneck,
        # each token enters the pipeline once, at stage 0; with a stage missing nothing completes
        "swarm_tokens_per_s": stages[0]["tokens_per_s"] if stages and len(covered) == n_stages else 0.0,
        "loss": last["loss"] if last else None,
        "progress": progress,
        "stages": stages,
        "other_stages": [_record_dict(r) for r in strays],
    }


def _record_dict(r: PeerRecord) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(r)


def render(view: dict[str, Any]) -> RenderableType:
    """The rich renderable of a swarm view (fits 80 columns)."""
    from rich import box
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    from peer.ids import short_id
    from peer.ops.dashboard import STATE_STYLE, duration, human
    from peer.ops.progress import progress_line

    table = Table(box=box.SIMPLE_HEAD, padding=0, pad_edge=False, show_edge=False)
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("stage", "left"), ("peer", "left"), ("state", "left"), ("thru", "right"), ("tok/s", "right"),
        ("queue", "right"), ("version", "right"), ("loss", "right"), ("reach", "left"))
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=True, overflow="ellipsis")
    for s in view["stages"]:
        tag = Text(f"{s['stage']}", style="bold")
        if s["n_training"] == 0:
            tag.append(" MISSING", style="bold red")
        elif s["stage"] == view["bottleneck_stage"] and view["n_stages"] > 1:
            tag.append(" slowest", style="yellow")
        if not s["peers"]:
            table.add_row(tag, Text("no peer", style="red"))
        for i, p in enumerate(s["peers"]):
            table.add_row(tag if i == 0 else "", short_id(p["peer_id"]),
                          Text(p["state"], style=STATE_STYLE.get(p["state"], "white")), human(p["throughput"]),
                          human(p["tokens_per_s"], digits=0), str(p["queue"]), str(p["version"]),
                          "-" if p["loss"] is None else f"{p['loss']:.3f}",
                          Text("yes", style="green") if p["reachable"] else Text("NO", style="red"))
        table.add_section()
    for p in view["other_stages"]:
        table.add_row(Text(f"{p['stage']}?", style="red"), short_id(p["peer_id"]), p["state"])
    loss = "-" if view["loss"] is None else f"{view['loss']:.3f}"
    footer = Text.assemble(
        (f"{view['n_peers']} peers", "bold"), f" · coverage {view['coverage']:.0%}",
        (" (missing " + ", ".join(map(str, view["missing_stages"])) + ")", "bold red") if view["missing_stages"]
        else "", " · bottleneck stage ", str(view["bottleneck_stage"]), " · ",
        (human(view["swarm_tokens_per_s"]), "bold"), " tok/s · loss ", (loss, "bold"))
    parts: list[RenderableType] = [table, footer]
    if view.get("progress") is not None:
        parts.append(Text(progress_line(view["progress"], duration, human), overflow="ellipsis", no_wrap=True))
    return Panel(Group(*parts), title=f"asyncmesh swarm · run {view['run_id']}", title_align="left", width=80,
                 subtitle=time.strftime("%H:%M:%S") + " · Ctrl-C quits", subtitle_align="right")


def _load_run(path: str | None) -> RunConfig:
    from trainer.config import RunConfig

    with user_input():
        return RunConfig.default() if path is None else RunConfig.from_toml(path)


def run(args: argparse.Namespace) -> int:
    for name in ("interval", "timeout", "wait"):
        if getattr(args, name) <= 0:
            raise UserError(f"--{name} must be positive (seconds), got {getattr(args, name)}")
    run_config = _load_run(args.run)
    from peer.cli.checks import check_multiaddrs

    check_multiaddrs("--initial-peers", args.initial_peers, need_peer_id=True)
    if args.tensorboard is not None:
        args.tb_writer = tensorboard_writer(args.tensorboard)
    import uvloop

    from peer.ops.logs import setup_logging

    setup_logging("WARNING", json=args.json or None)
    try:
        return uvloop.run(_main(args, run_config))
    except KeyboardInterrupt:  # Ctrl-C is how a watch ends
        return EXIT_OK


async def _main(args: argparse.Namespace, run_config: RunConfig) -> int:
    import asyncio

    from hivemind import DHT

    from peer.membership.records import fetch_swarm, record_validator
    from peer.ops.progress import from_records

    try:  # the run's validator: forged records in a lying node's answer are dropped before fetch_swarm sees them
        dht = await asyncio.to_thread(DHT, initial_peers=list(args.initial_peers), client_mode=True, start=True,
                                      record_validators=[record_validator(run_config.run_id)])
    except Exception as e:  # a bad multiaddr or an unreachable bootstrap peer
        raise UserError(f"could not join the DHT through {' '.join(args.initial_peers)}: {e}. Check the "
                         f"multiaddrs (copy them from a running peer's log) and that the peer is reachable") from e
    try:
        if args.once:
            deadline = time.monotonic() + args.wait
            while True:
                records = await fetch_swarm(dht, run_config.run_id, timeout=args.timeout)
                if records or time.monotonic() >= deadline:
                    break
                await asyncio.sleep(min(1.0, args.interval))
            view = swarm_view(records, run_config.n_stages, run_config.run_id, _progress(run_config).update(
                from_records(records.values())))
            _print(view, args.json)
            _log_tb(args, view)
            if not records:
                print(f"asyncmesh-peer monitor: no peer of run {run_config.run_id} found within {args.wait:g} s; "
                      "check --run (it must be the peers' run file) and --initial-peers", file=sys.stderr)
            return EXIT_OK if records else EXIT_EMPTY
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig in before:  # Ctrl-C, `docker stop`: leave the DHT before exiting
            loop.add_signal_handler(sig, stop.set)
        try:
            return await _watch(dht, args, run_config, stop)
        finally:  # the process's own handlers again, as they were (asyncio would put Python's defaults back)
            for sig, handler in before.items():
                loop.remove_signal_handler(sig)
                signal.signal(sig, handler)
    finally:
        await asyncio.to_thread(dht.shutdown)


def _print(view: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(view))
    else:
        from rich import get_console

        get_console().print(render(view))


async def _watch(dht: DHT, args: argparse.Namespace, run_config: RunConfig, stop: asyncio.Event) -> int:
    """Refresh until ``stop`` is set (Ctrl-C, SIGTERM): a live table on a terminal, one JSON line per read with
    --json."""
    import asyncio
    from contextlib import nullcontext

    from rich import get_console
    from rich.live import Live

    from peer.membership.records import fetch_swarm
    from peer.ops.progress import from_records

    progress = _progress(run_config)
    view = swarm_view({}, run_config.n_stages, run_config.run_id)
    live = None if args.json else Live(render(view), console=get_console(), auto_refresh=False)
    with nullcontext() if live is None else live:
        while not stop.is_set():
            records = await fetch_swarm(dht, run_config.run_id, timeout=args.timeout)
            view = swarm_view(records, run_config.n_stages, run_config.run_id,
                              progress.update(from_records(records.values())))
            _log_tb(args, view)
            if live is None:
                print(json.dumps(view), flush=True)
            else:
                live.update(render(view), refresh=True)
            try:
                await asyncio.wait_for(stop.wait(), args.interval)
            except TimeoutError:
                pass
    return EXIT_OK


def _progress(run_config: RunConfig) -> SwarmProgress:
    from peer.ops.progress import SwarmProgress

    return SwarmProgress(run_name=run_config.name, total_steps=run_config.optim.total_steps)


def tensorboard_writer(logdir: str) -> SummaryWriter:
    """A TensorBoard SummaryWriter on ``logdir``; a one-line UserError when the optional extra is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch ships the writer, the 'tensorboard' package provides its protobufs
        raise UserError("--tensorboard needs the tensorboard package: pip install 'asyncmesh[tensorboard]' (or run "
                        "without --tensorboard)") from None
    with user_input(f"--tensorboard {logdir}"):
        return SummaryWriter(log_dir=logdir)


def tensorboard_scalars(view: dict[str, Any]) -> dict[str, float]:
    """The swarm's curves of one read, by TensorBoard tag (absent figures are left out)."""
    p = view.get("progress") or {}
    out = {"swarm/tokens_per_s": view.get("swarm_tokens_per_s"), "swarm/train_loss": view.get("loss"),
           "swarm/val_loss": p.get("val_loss"), "swarm/tokens": p.get("tokens"), "swarm/peers": view.get("n_peers"),
           "swarm/coverage": view.get("coverage")}
    return {k: float(v) for k, v in out.items() if v is not None}


def _log_tb(args: argparse.Namespace, view: dict[str, Any]) -> None:
    writer = getattr(args, "tb_writer", None)
    if writer is None:
        return
    step = int((view.get("progress") or {}).get("step") or 0)
    for tag, value in tensorboard_scalars(view).items():
        writer.add_scalar(tag, value, global_step=step, walltime=view["time"])
    writer.flush()
