#!/usr/bin/env python3
"""What generating through a live swarm costs it, and what a flood of generation requests does to its training.

The tool starts two peers on loopback (stage 0 and stage 1 of ``tests/runs/tiny.toml`` through ``peer.ops.procs``),
lets them train, and runs three phases of ``--phase-s`` seconds each:

* ``control``: the swarm trains, nobody generates;
* ``generate``: one client (this process, a DHT client like ``asyncmesh-peer generate``) generates greedily through
  the pipeline without pause, one token after the other;
* ``flood``: the same client keeps generating while ``--flood-ids`` stranger identities each keep ``--flood-streams``
  maximal ``infer`` requests (a whole block of positions) in flight to both peers as fast as they are answered;
* ``flood_forward``: the baseline of what such a flood costs through any handler: the same identities and streams
  send stage 1 ``forward`` requests of the run's size, which it answers Busy (the senders are not announced peers).

Per phase it reports the stage-0 peer's optimiser steps per second and its longest stretch without a step
(``max_stall_s``), from its ``/status`` polled every 0.2 s; the CPU cores the two peers used (``peers_cores``: their
processes and every descendant, the DHT and p2pd included) and this process with its own p2pd daemons used
(``tool_cores``: the generating client and the flood's identities); for generation the tokens made, the milliseconds
per token (median, 90th percentile) and failures; for the flood the replies by kind and the peers' ``infer``
counters. The tool runs on the same machine as the peers, so on few cores its own work competes with theirs.

    python tools/bench_generate.py --json docs/bench/generate.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from hivemind import DHT  # noqa: E402
from hivemind.p2p import P2P  # noqa: E402

from peer.handlers.sizes import infer_message_bytes  # noqa: E402
from peer.membership.records import fetch_swarm, record_validator  # noqa: E402
from peer.ops.procs import (  # noqa: E402
    PeerProcess,
    cpu_seconds,
    descendants,
    free_port,
    join_command,
    terminate,
    unwind_on_sigterm,
)
from peer.pipeline.hops import FORWARD_RPC  # noqa: E402
from peer.pipeline.infer import INFER_RPC  # noqa: E402
from peer.pipeline.remote import RemotePipeline, rpc_call  # noqa: E402
from protocol.codecs.registry import encode  # noqa: E402
from protocol.errors import RemoteError  # noqa: E402
from protocol.messages import Forward, Infer  # noqa: E402
from protocol.rpc import call  # noqa: E402
from trainer.config import RunConfig  # noqa: E402
from trainer.export import next_token  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "tests" / "runs" / "tiny.toml"
SETTINGS = ("announce_every_s=1", "record_ttl_s=4", "dht_timeout_s=3", "rpc_timeout_s=5", "microbatch_timeout_s=15",
            "eval_every_s=3", "checkpoint_every_s=0", "rebalance_every_s=0", "ban_base_s=1")
PROMPT = list(b"def main():\n    ")


def tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and its live descendants."""
    return sum(cpu_seconds(p) or 0.0 for p in [pid, *descendants(pid)])


class Cpu:
    """Cores used by the peers and by this tool between ``start()`` and ``cores()``."""

    def __init__(self, peers: list[PeerProcess]) -> None:
        self.peers = peers
        self.t0, self.peers0, self.tool0 = 0.0, 0.0, 0.0

    def _now(self) -> tuple[float, float, float]:
        return (time.monotonic(), sum(tree_cpu(p.proc.pid) for p in self.peers), tree_cpu(os.getpid()))

    def start(self) -> None:
        self.t0, self.peers0, self.tool0 = self._now()

    def cores(self) -> dict[str, float]:
        t, peers, tool = self._now()  # the peers are this tool's children: its own share is the difference
        return {"peers_cores": round((peers - self.peers0) / (t - self.t0), 2),
                "tool_cores": round((tool - self.tool0 - (peers - self.peers0)) / (t - self.t0), 2)}


class Watch(threading.Thread):
    """Polls the stage-0 peer's /status: (time, local_step)."""

    def __init__(self, peer: PeerProcess) -> None:
        super().__init__(daemon=True)
        self.peer, self.stop = peer, threading.Event()
        self.samples: list[tuple[float, int]] = []

    def run(self) -> None:
        while not self.stop.is_set():
            s = self.peer.status()
            if s is not None:
                self.samples.append((time.monotonic(), int(s.get("local_step") or 0)))
            time.sleep(0.2)

    def window(self, t0: float, t1: float) -> dict[str, float]:
        """Steps per second and the longest stretch without a new step within [t0, t1]."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        changes = [t for (t, step), (_, prev) in zip(inside[1:], inside, strict=False) if step > prev]
        marks = [t0, *changes, t1]
        stall = max(b - a for a, b in zip(marks, marks[1:], strict=False))
        rate = (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0]) if len(inside) > 1 else 0.0
        return {"steps_per_s": round(rate, 2), "max_stall_s": round(stall, 2)}


async def generate(remote: RemotePipeline, until: float) -> dict[str, Any]:
    """Greedy tokens one after the other until ``until``; the context restarts from the prompt at the block size."""
    ids, took, failures = list(PROMPT), [], Counter()
    while time.monotonic() < until:
        t0 = time.monotonic()
        try:
            logits = await remote.next_logits(ids)
        except Exception as e:  # counted: what an honest client suffers is the measurement
            failures[type(e).__name__] += 1
            continue
        took.append(time.monotonic() - t0)
        ids.append(int(next_token(logits, temperature=0, top_k=0)))
        if len(ids) >= remote.run.model.block_size:
            ids = list(PROMPT)
    ms = sorted(1000 * t for t in took)
    return {"tokens": len(took), "ms_per_token_median": round(statistics.median(ms), 1) if ms else None,
            "ms_per_token_p90": round(ms[int(0.9 * (len(ms) - 1))], 1) if ms else None,
            "failures": dict(failures)}


async def flood(run: RunConfig, identities: list[P2P], streams: int, targets: dict[int, str], until: float, *,
                handler: str = INFER_RPC) -> dict[str, int]:
    """Every identity keeps ``streams`` maximal requests in flight to each target stage's peer until ``until``."""
    b, t, d = run.data.batch_size, run.model.block_size, run.model.n_embd
    if handler == INFER_RPC:
        msgs = {0: Infer(run.run_id, 0, encode(torch.randint(0, run.model.vocab_size, (1, t)), "none"), "none"),
                1: Infer(run.run_id, 1, encode(torch.randn(1, t, d), "none"), "none")}
    else:  # a stage-1 forward of the run's size, its route ending with the sender as the protocol wants
        env = encode(torch.randn(b, t, d), run.compression.activations)
        targets = {1: targets[1]}
        msgs = {1: lambda p2p: Forward(run.run_id, 1, [p2p.peer_id.to_base58()], env,
                                       encode(torch.zeros(b, t, dtype=torch.int64), "none"), False, time.time())}
    replies: Counter[str] = Counter()

    async def loop(p2p: P2P, stage: int) -> None:
        msg = msgs[stage](p2p) if callable(msgs[stage]) else msgs[stage]
        while time.monotonic() < until:
            try:
                reply = await call(p2p, targets[stage], handler, msg, timeout=5.0)
                replies[type(reply).__name__] += 1
            except RemoteError as e:
                replies[e.code.name] += 1
            except Exception as e:  # a stream closed unread, a timeout: how the victim ended it
                replies[type(e).__name__] += 1
                await asyncio.sleep(0.01)

    await asyncio.gather(*(loop(p2p, stage) for p2p in identities for stage in targets for _ in range(streams)))
    return dict(replies)


async def phases(args: argparse.Namespace, a: PeerProcess, b: PeerProcess, watch: Watch) -> dict[str, Any]:
    run = RunConfig.from_toml(TINY)
    initial = a.wait_maddrs()[:1]
    dht = await asyncio.to_thread(DHT, initial_peers=initial, client_mode=True, start=True,
                                  record_validators=[record_validator(run.run_id)])
    extra: list[P2P] = []
    try:
        p2p = await dht.replicate_p2p()
        remote = RemotePipeline(run=run, call=rpc_call(p2p, max(infer_message_bytes(run).values())),
                                read_swarm=lambda: fetch_swarm(dht, run.run_id, timeout=3.0), timeout_s=10.0)
        await remote.wait_for_stages(30.0)
        for _ in range(args.flood_ids):  # started before any phase: starting p2pd is not the flood
            extra.append(await P2P.create(initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        targets = {r.stage: r.peer_id for r in remote.records.values()}
        out: dict[str, Any] = {}
        cpu = Cpu([a, b])
        t0 = time.monotonic()
        cpu.start()
        await asyncio.sleep(args.phase_s)
        out["control"] = {**watch.window(t0, time.monotonic()), **cpu.cores()}
        t0 = time.monotonic()
        cpu.start()
        got = await generate(remote, t0 + args.phase_s)
        out["generate"] = {**got, **watch.window(t0, time.monotonic()), **cpu.cores()}
        before = {p.name: (await asyncio.to_thread(p.status))["counters"] for p in (a, b)}
        t0 = time.monotonic()
        cpu.start()
        got, replies = await asyncio.gather(generate(remote, t0 + args.phase_s),
                                            flood(run, extra, args.flood_streams, targets, t0 + args.phase_s))
        out["flood"] = {**got, **watch.window(t0, time.monotonic()), **cpu.cores(), "flood_replies": replies}
        after = {p.name: (await asyncio.to_thread(p.status))["counters"] for p in (a, b)}
        out["flood"]["peers_infer"] = {name: {k: after[name].get(k, 0) - before[name].get(k, 0) for k in
                                              ("infer_served", "infer_busy", "infer_compute_ms")} for name in after}
        out["flood"].update(identities=args.flood_ids, streams_per_stage=args.flood_streams)
        t0 = time.monotonic()
        cpu.start()
        replies = await flood(run, extra, args.flood_streams, targets, t0 + args.phase_s, handler=FORWARD_RPC)
        out["flood_forward"] = {**watch.window(t0, time.monotonic()), **cpu.cores(), "flood_replies": replies}
        return out
    finally:
        await asyncio.gather(*(p.shutdown() for p in extra), return_exceptions=True)
        await asyncio.to_thread(dht.shutdown)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phase-s", type=float, default=20.0, help="seconds per phase (default 20)")
    p.add_argument("--flood-ids", type=int, default=4, help="stranger identities of the flood (default 4)")
    p.add_argument("--flood-streams", type=int, default=4, help="requests each keeps in flight per stage (default 4)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the results here")
    p.add_argument("--workdir", default=None, help="keep the peers' folders here (default: a temporary one)")
    args = p.parse_args(argv)
    unwind_on_sigterm()  # SIGTERM unwinds through the finally that reaps both peers
    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench-generate-"))
    peers: list[PeerProcess] = []
    load = [Path("/proc/loadavg").read_text().split()[:3]]
    try:
        a = PeerProcess.spawn("a", join_command(root / "a", port=(pa := free_port()), run=TINY, stage=0,
                                                settings=SETTINGS), root / "a", pa, cwd=REPO)
        peers.append(a)
        b = PeerProcess.spawn("b", join_command(root / "b", port=(pb := free_port()), run=TINY, stage=1,
                                                settings=SETTINGS, initial=a.wait_maddrs()[:1]), root / "b", pb,
                              cwd=REPO)
        peers.append(b)
        a.wait_status(lambda s: (s.get("local_step") or 0) > 10, 120, "training")
        watch = Watch(a)
        watch.start()
        results = asyncio.run(phases(args, a, b, watch))
        watch.stop.set()
        results["peers_alive"] = a.alive() and b.alive()
    finally:
        terminate([p.proc for p in peers], 10.0)
    load.append(Path("/proc/loadavg").read_text().split()[:3])
    results["machine"] = {"nproc": os.cpu_count(), "loadavg_start_end": load}
    results["command"] = " ".join(["python", "tools/bench_generate.py", *(argv if argv is not None else sys.argv[1:])])
    text = json.dumps(results, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
