"""`asyncmesh-peer join`: run one peer of a swarm (or start a new swarm) until stopped."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from peer.config import DEVICES, MODES, PRECISIONS, Device, Mode, Precision
from peer.errors import UserError, user_input
from peer.membership.relay import RELAY_MODES, RelayMode

if TYPE_CHECKING:
    from peer.averaging.behaviour import AveragingBehaviour
    from peer.config import PeerConfig
    from trainer.config import RunConfig

HELP = "Run one peer: join a swarm (or start a new one), serve a pipeline stage, train until stopped."
EPILOG = """examples:
  start a new swarm on the embedded default run (prints the multiaddr others join with):
    asyncmesh-peer join
  join it, letting the swarm pick the stage that needs help most:
    asyncmesh-peer join --stage auto --initial-peers /ip4/203.0.113.5/tcp/31337/p2p/QmPeer...
  serve stage 1 of your own run on the GPU, reachable through a forwarded port, with checkpoints:
    asyncmesh-peer join --run myrun.toml --stage 1 --device cuda --host-maddrs /ip4/0.0.0.0/tcp/31337 \\
        --announce-maddrs /ip4/203.0.113.7/tcp/31337 --checkpoint-dir ~/.asyncmesh/ckpt --initial-peers MADDR
  a short scripted run without the dashboard, writing its figures:
    asyncmesh-peer join --no-tui --max-steps 200 --summary-json out/peer.json --initial-peers MADDR
Ctrl-C or SIGTERM stops gracefully: in-flight work drains, a final checkpoint is written, the peer leaves the DHT."""


def parse_stage(value: str | int | None) -> int | None:
    """``--stage``: 'auto' (None) or a stage number >= 0; a UserError (one line, not the usage) otherwise."""
    if value is None or value == "auto":
        return None
    try:
        stage = int(value)
    except ValueError:
        raise UserError(f"--stage must be 'auto' or a stage number, got {value!r}") from None
    if stage < 0:
        raise UserError(f"--stage must be 'auto' or a stage number >= 0, got {stage}")
    return stage


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stage", default=None, metavar="auto|N",
                   help="pipeline stage to serve; 'auto' (default) picks the least-served stage and rebalances")
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="MADDR",
                   help="multiaddrs of running peers; none starts a new swarm")
    p.add_argument("--run", default=None, metavar="FILE", help="run TOML (default: the embedded default run)")
    p.add_argument("--data", default=None, metavar="PATH", help="override the run's data source (stage 0 reads it)")
    p.add_argument("--device", default=Device.AUTO.value, choices=DEVICES, help="compute device")
    p.add_argument("--precision", default=Precision.AUTO.value, choices=PRECISIONS,
                   help="bf16 autocast with fp32 master weights and optimiser state, or fp32; auto (default): bf16 on "
                        "CUDA, fp32 on the CPU")
    p.add_argument("--memory-gb", type=float, default=0.0, metavar="GIB",
                   help="memory this peer may use (GiB); default: the GPU's free memory, or the available RAM. "
                        "Stages that do not fit are never served (asyncmesh-peer memory shows what each needs)")
    p.add_argument("--host-maddrs", nargs="*", default=None, metavar="MADDR",
                   help="addresses to listen on (default /ip4/0.0.0.0/tcp/0)")
    p.add_argument("--announce-maddrs", nargs="*", default=[], metavar="MADDR",
                   help="addresses others should dial (public IP / forwarded port)")
    p.add_argument("--relay", default=RelayMode.AUTO.value, choices=RELAY_MODES,
                   help="behind NAT without port forwarding: listen through a circuit relay at the initial peers "
                        "(or --relays); auto (default) when the reachability check finds this peer unreachable")
    p.add_argument("--relay-service", default=RelayMode.AUTO.value, choices=RELAY_MODES,
                   help="relay for peers behind NAT: auto (default) when libp2p finds this peer public; on for an "
                        "organiser's public peer (needed when its address is not confirmed public)")
    p.add_argument("--relays", nargs="*", default=[], metavar="MADDR",
                   help="full multiaddrs of the relays to listen through (default: --initial-peers)")
    p.add_argument("--identity", default=None, metavar="PATH",
                   help="private key file fixing the peer id (default ~/.asyncmesh/identity.key; created if missing)")
    p.add_argument("--credential", default=None, metavar="FILE",
                   help="closed runs: the admission credential the organiser issued for this peer id")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR", help="periodic and final checkpoints go here")
    p.add_argument("--no-tui", action="store_true", help="log lines instead of the live dashboard")
    p.add_argument("--max-steps", type=int, default=0, metavar="N", help="stop after N local optimiser steps")
    p.add_argument("--summary-json", default=None, metavar="PATH", help="write tokens/s, losses, counters on exit")
    p.add_argument("--mode", default=Mode.ASYNC.value, choices=MODES,
                   help="async (default) or sync (GPipe flush + full gradient average per step, for comparison)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve /status and /metrics on PORT (0 picks a free port)")
    p.add_argument("--metrics-host", default=None, metavar="HOST",
                   help="interface of /status and /metrics (default 127.0.0.1, or $ASYNCMESH_METRICS_HOST; the "
                        "Docker image uses 0.0.0.0 so that its published port can be scraped)")
    p.add_argument("--torch-threads", type=int, default=0, metavar="N",
                   help="CPU threads for compute (default: torch's choice; use 1 when many peers share a machine)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", dest="overrides",
                   help="override a peer setting, e.g. --set eval_every_s=5 --set drain_timeout_s=20 "
                        "(any field of peer.config.PeerConfig)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``FIELD=VALUE`` strings typed after PeerConfig's defaults (PeerConfig converts and checks them further);
    ValueError names an unknown field or bad value."""
    import dataclasses

    from peer.config import PeerConfig

    fields = {f.name: f for f in dataclasses.fields(PeerConfig)}
    defaults = PeerConfig()
    out: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or name not in fields:
            raise UserError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {sorted(fields)}")
        current = getattr(defaults, name)
        try:
            if isinstance(current, bool):
                if text.lower() not in ("true", "false", "1", "0"):
                    raise ValueError("expected true or false")
                value: object = text.lower() in ("true", "1")
            elif isinstance(current, (int, float)) and not isinstance(current, bool):
                value = type(current)(text)
            else:
                value = text
        except ValueError as e:
            raise UserError(f"--set {item!r}: {e}") from None
        out[name] = value
    return out


def build_config(args: argparse.Namespace, **overrides: object) -> tuple[RunConfig, PeerConfig]:
    """(RunConfig, PeerConfig) from parsed arguments; raises UserError with what to fix."""
    with user_input():
        return _build_config(args, **overrides)


def _build_config(args: argparse.Namespace, **overrides: object) -> tuple[RunConfig, PeerConfig]:
    from peer.config import PeerConfig
    from trainer.config import RunConfig

    run = RunConfig.from_toml(args.run) if args.run else RunConfig.default()
    kw: dict[str, Any] = dict(  # argparse's values; PeerConfig converts and checks them
        stage=parse_stage(args.stage), initial_peers=tuple(args.initial_peers),
        announce_maddrs=tuple(args.announce_maddrs), checkpoint_dir=args.checkpoint_dir, data_path=args.data,
        device=args.device, precision=args.precision, memory_gb=args.memory_gb, mode=args.mode, relay=args.relay,
        relay_service=args.relay_service,
        relays=tuple(args.relays),
        max_steps=args.max_steps, summary_json=args.summary_json, metrics_port=args.metrics_port,
        torch_threads=args.torch_threads)
    if args.host_maddrs:
        kw["host_maddrs"] = tuple(args.host_maddrs)
    if args.identity:
        kw["identity_path"] = args.identity
    if args.credential:
        kw["credential_path"] = args.credential
    if getattr(args, "metrics_host", None):
        kw["metrics_host"] = args.metrics_host
    kw.update(parse_overrides(args.overrides))
    kw.update(overrides)
    return run, PeerConfig(**kw)


def run(args: argparse.Namespace, *, averaging_behaviour: AveragingBehaviour | None = None) -> int:
    """Start the peer; ``averaging_behaviour`` (tests, tools/byzantine_peer.py): how it takes part in averaging
    rounds, honest when None."""
    import asyncio
    import logging
    import os
    import signal
    import sys

    import uvloop

    from peer.cli.checks import check_join
    from peer.daemon import Daemon
    from peer.errors import DaemonError
    from peer.ops.logs import setup_logging

    if args.max_steps < 0:
        raise UserError(f"--max-steps must be >= 0, got {args.max_steps}")
    run_cfg, cfg = build_config(args)
    check_join(args, run_cfg, cfg.metrics_host)  # before anything starts: a typo costs a second, not a DHT timeout
    setup_logging(args.log_level, json=None if args.no_tui else False)
    daemon = Daemon(run_cfg, cfg, averaging_behaviour=averaging_behaviour)

    async def main() -> int:
        dash_task = None
        if not args.no_tui:
            from peer.ops.dashboard import Dashboard

            dash_task = asyncio.ensure_future(Dashboard(daemon.metrics, title=run_cfg.name).run(daemon.stop))
        try:
            return await daemon.main()
        finally:
            if dash_task is not None:
                daemon.stop.set()
                await asyncio.gather(dash_task, return_exceptions=True)

    try:
        code = uvloop.run(main())
    except DaemonError as e:
        print(f"asyncmesh-peer join: error: {e}", file=sys.stderr)
        return e.exit_code
    finally:  # the peer has stopped; a late SIGTERM during interpreter teardown must not turn exit 0 into -15
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Everything is stopped, checkpointed and written; exit now rather than risk interpreter teardown waiting on
    # leftover library threads or child processes (hivemind's DHT process is one), so SIGTERM meets its deadline.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
