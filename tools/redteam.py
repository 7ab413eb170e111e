#!/usr/bin/env python3
"""Red team: attack a live swarm of the tiny run from a stranger's process and measure what each attack costs.

The tool starts two swarms of ``tests/runs/tiny.toml`` on loopback at once, the same run file, seed, layout and
settings (``tools/redteam_swarm.py``): the attacked swarm and its twin, which nobody attacks and which trains
alongside over the same seconds. The attacks on what replicas do together (averaging, witnesses, backups, spot
checks: ``REPLICATED``) run against a pair of swarms with ``--replicas`` peers per stage, the others against a pair
with one peer per stage. Each pair trains ``--warmup-s``, then the tool runs phases of ``--phase-s`` seconds: a
control phase with no attack (with ``--control-each``, one before every attack), and one phase per attack. The
attacker is this process: a hivemind DHT node that installs no validator and raw libp2p clients that speak our
protocol through ``protocol.rpc`` or write frames by hand. At the end of every phase a judge (a stranger's identity
per swarm) fetches every honest peer's stage weights through the state RPC, as any joiner may, chains them into
pipelines (replica r of every stage; a peer the attack added in place of replica 0 of its stage) and evaluates them on
fixed validation batches in this process, both swarms at the same moment. Per attack it reports:

* ``outcome``: ``stalled`` (a stage-0 peer made no progress for more than 5 s), else ``degraded`` (the phase's own
  loss ratio, ``phase_loss_ratio``, above 1.05, or the attack's evidence shows harm the losses miss: a joiner
  that loaded a liar's state), else ``refused`` (the victims refused what the attack needed: ``evidence``), else
  ``harmless``;
* ``max_stall_s`` (``twin_max_stall_s``): the longest gap between two optimiser steps of a stage-0 peer;
* ``honest_val_loss_ratio``: the attacked swarm's mean judged loss over its pipelines ÷ the twin's, at the same
  moment; ``worst_victim_loss_ratio``: its worst pipeline (a joiner's included) ÷ the twin's worst;
  ``reported_val_loss_ratio``: the same for the losses the first stage-0 peers report on ``/status``, for contrast;
* ``carried_in_loss_ratio``: the worst ratio when the phase began (both swarms are judged then too: one attacked
  swarm takes every phase of its group, so a phase starts with what the earlier ones left); ``phase_loss_ratio``:
  ``worst_victim_loss_ratio`` ÷ the carried-in ratio where that is above 1 (never below the plain ratio otherwise),
  the phase's own harm, which decides the outcome;
* ``steps``: every layout peer's ``local_step`` in both swarms (a ratio above 1 with fewer steps is lost compute);
* ``rss_growth_mib``: the largest growth of a victim's resident memory over the phase.

    python tools/redteam.py --json redteam.json                       # every attack
    python tools/redteam.py --attacks forged_record,malformed --phase-s 8 --json out.json

The attacker shares the victims' cores (and the twin's); ``--attacker-cpu CORES`` confines it to a CPU quota
(tools/confine.py) to model a remote attacker, and the floods report the stream rate it reached.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from hivemind import DHT  # noqa: E402
from hivemind.p2p import P2P, PeerID  # noqa: E402
from hivemind.utils import get_dht_time  # noqa: E402

from peer.averaging.loop import AVG_RPC  # noqa: E402
from peer.membership.reachability import REACH_RPC  # noqa: E402
from peer.membership.records import PeerRecord, announce, fetch_swarm, record_validator, swarm_key  # noqa: E402
from peer.membership.signing import Signer, seal  # noqa: E402
from peer.ops.metrics import PeerMetrics  # noqa: E402
from peer.ops.procs import unwind_on_sigterm  # noqa: E402
from peer.pipeline.hops import BACKWARD_RPC, FORWARD_RPC  # noqa: E402
from peer.pipeline.infer import INFER_RPC  # noqa: E402
from peer.state.sync import STATE_RPC, StateServer  # noqa: E402
from protocol.codecs.registry import encode  # noqa: E402
from protocol.framing import frame_header, read_message  # noqa: E402
from protocol.limits import RpcLimits  # noqa: E402
from protocol.messages import Ack, Error, Forward, Hello, Infer, Message, pack, unpack  # noqa: E402
from protocol.rpc import PROTOCOL_PREFIX, RpcServer, call  # noqa: E402
from tools.confine import CpuQuota  # noqa: E402
from tools.redteam_swarm import Judge, Swarm, Verdict, honest_peer, judge_now, peer_id_of, ratio  # noqa: E402
from tools.redteam_trust import TRUST_ATTACKS  # noqa: E402
from trainer.config import RunConfig  # noqa: E402
from trainer.worker import StageWorker  # noqa: E402

logger = logging.getLogger("redteam")
REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "tests" / "runs" / "tiny.toml"
SETTINGS = ("announce_every_s=1", "record_ttl_s=4", "dht_timeout_s=3", "rpc_timeout_s=5", "microbatch_timeout_s=15",
            "eval_every_s=3", "checkpoint_every_s=0", "rebalance_every_s=0", "ban_base_s=1")
STALL_LIMIT_S, LOSS_LIMIT = 5.0, 1.05
MiB = 2**20


class Attacker:
    """The stranger: a DHT node without validators (its own identity) and more identities on demand."""

    def __init__(self, root: Path, initial: list[str], run: RunConfig) -> None:
        self.root, self.initial, self.run = root, initial, run
        P2P.generate_identity(str(root / "attacker.key"))
        self.signer = Signer.from_identity_file(root / "attacker.key")
        self.dht = DHT(start=True, initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                       identity_path=str(root / "attacker.key"))
        self.reader = DHT(start=True, initial_peers=initial, client_mode=True,
                          record_validators=[record_validator(run.run_id)])
        self.p2p: P2P | None = None
        self.extra: list[P2P] = []
        self.status_a: Callable[[], dict[str, Any] | None] = lambda: None  # the stage-0 victim's /status
        self.status_b: Callable[[], dict[str, Any] | None] = lambda: None  # the stage-1 victim's /status
        self.swarm: Swarm | None = None  # the attacked swarm: honest peers an attack adds join it (``extra``)
        self.judge: Callable[[], Awaitable[None]] | None = None  # judge both swarms now (before extra peers leave)

    async def start(self) -> None:
        self.p2p = await self.dht.replicate_p2p()

    async def identities(self, n: int) -> list[P2P]:
        while len(self.extra) < n:
            self.extra.append(await P2P.create(initial_peers=self.initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        return self.extra[:n]

    async def close(self) -> None:
        await asyncio.gather(*(p.shutdown() for p in self.extra), return_exceptions=True)
        self.dht.shutdown()
        self.reader.shutdown()

    async def raw(self, p2p: P2P, peer: str, handler: str, data: bytes, timeout: float = 10.0) -> str:
        """Write ``data`` on a new stream and name the reply (its error code, or how the stream ended)."""
        try:
            async with asyncio.timeout(timeout):
                _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer),
                                                                         PROTOCOL_PREFIX + handler)
                writer.write(data)
                await writer.drain()
                reply = unpack(await read_message(reader, max_frame_bytes=MiB, max_message_bytes=MiB))
                writer.close()
                return reply.code.name if isinstance(reply, Error) else type(reply).__name__
        except Exception as e:  # how the victim ended the stream is the observation
            return type(e).__name__


def _forward(run: RunConfig, mb_id: int, route: list[str], x: torch.Tensor) -> Forward:
    b, t = run.data.batch_size, run.model.block_size
    return Forward(run_id=run.run_id, mb_id=mb_id, route=route, activations=encode(x, run.compression.activations),
                   targets=encode(torch.randint(0, run.model.vocab_size, (b, t)), "none"), is_eval=False,
                   sent_at=time.time())


async def _own_record(att: Attacker, stage: int, throughput: float, *, state: str = "training") -> None:
    """The attacker announces itself (a validly signed record of its own id: open runs allow it)."""
    rec = PeerRecord(peer_id=att.signer.peer_id, stage=stage, throughput=throughput, queue=0, version=0,
                     state=state, maddrs=[])
    await announce(att.dht, att.run.run_id, rec, 4.0, signer=att.signer)


# ----- attacks: each runs until ``until`` and returns its evidence (with "refused": bool) ---------------------------
async def forged_record(att: Attacker, victims: dict[str, str], until: float) -> dict[str, Any]:
    key, b = swarm_key(att.run.run_id), victims["b"]
    forged_seen = stored = 0
    while time.monotonic() < until:
        now = get_dht_time()
        fake = PeerRecord(peer_id=b, stage=1, throughput=1e9, queue=0, version=0, state="stopped").to_value()
        mine = PeerRecord(peer_id=att.signer.peer_id, stage=1, throughput=1e9, queue=0, version=0,
                          state="training").to_value()
        for subkey, value, exp in ((b, seal(att.signer, key, fake, now + 50), now + 50),
                                   (att.signer.peer_id, seal(att.signer, key, mine, now + 3e8), now + 3e8)):
            future = att.dht.store(key, value, exp, subkey=subkey, return_future=True)
            stored += bool(await asyncio.wait_for(future, 10))
        view = await fetch_swarm(att.reader, att.run.run_id, timeout=3, include_stopped=True)
        forged_seen += int(att.signer.peer_id in view or (b in view and view[b].state == "stopped"))
        await asyncio.sleep(1.0)
    return {"refused": forged_seen == 0, "forged_records_seen_by_honest_reader": forged_seen,
            "stores_the_attackers_own_node_reported": stored}


async def _flood(att: Attacker, victims: dict[str, str], until: float, abandon_s: float | None) -> dict[str, Any]:
    """``ids`` identities x ``streams`` streams each announcing a 4 MiB frame and sending nothing, reopened when cut
    (``abandon_s`` None) or abandoned ``abandon_s`` after the header whatever the victim does."""
    replies: dict[str, int] = {}
    header, victim = frame_header(4 * MiB, end=True), PeerID.from_base58(victims["b"])

    async def hit_and_run(p2p: P2P) -> str:
        try:
            async with asyncio.timeout(max(0.5, until - time.monotonic())):
                _, _, writer = await p2p.call_binary_stream_handler(victim, PROTOCOL_PREFIX + FORWARD_RPC)
                writer.write(header)
                await asyncio.sleep(abandon_s or 0.0)
                writer.close()
                return "abandoned"
        except Exception as e:
            return type(e).__name__

    async def one(p2p: P2P) -> None:
        while time.monotonic() < until:
            r = await (att.raw(p2p, victims["b"], FORWARD_RPC, header, timeout=max(0.5, until - time.monotonic()))
                       if abandon_s is None else hit_and_run(p2p))
            replies[r] = replies.get(r, 0) + 1
    t0 = time.monotonic()
    await asyncio.gather(*(one(p) for p in await att.identities(FLOOD["ids"]) for _ in range(FLOOD["streams"])))
    # refused: answered with a refusal, closed or reset unanswered, held until we gave up, or abandoned by us
    ok = {"TIMEOUT", "BUSY", "Busy", "TOO_LARGE", "TimeoutError", "StreamEnded", "ConnectionResetError", "abandoned"}
    return {"refused": set(replies) <= ok, "replies": replies,
            "streams_per_s": round(sum(replies.values()) / max(1e-9, time.monotonic() - t0))}


async def budget_flood(att: Attacker, victims: dict[str, str], until: float) -> dict[str, Any]:
    """16 identities x 16 streams, each announcing a 4 MiB frame and sending nothing, reopened when cut."""
    return await _flood(att, victims, until, None)


async def churn_flood(att: Attacker, victims: dict[str, str], until: float) -> dict[str, Any]:
    """As budget_flood, but each stream is abandoned 50 ms after its header, answered or not: an attacker that does
    not wait for the victim (held streams do not slow it down)."""
    return await _flood(att, victims, until, 0.05)


async def stream_flood(att: Attacker, victims: dict[str, str], until: float, n: int = 1000) -> dict[str, Any]:
    """``n`` streams from one id that never write, kept open until the end of the phase."""
    target = PeerID.from_base58(victims["b"])
    opened = await asyncio.gather(*(att.p2p.call_binary_stream_handler(target, PROTOCOL_PREFIX + FORWARD_RPC)
                                    for _ in range(n)), return_exceptions=True)
    await asyncio.sleep(max(0.0, until - time.monotonic()))
    ok = [o for o in opened if not isinstance(o, BaseException)]
    for o in ok:
        o[2].close()
    return {"refused": True, "streams_opened": len(ok)}


async def malformed(att: Attacker, victims: dict[str, str], until: float) -> dict[str, Any]:
    """The malformed-frame matrix against every handler of both victims: every cell must be refused."""
    run, cells = att.run, {}
    b, t, d = run.data.batch_size, run.model.block_size, run.model.n_embd
    hello = Hello(protocol_version=1, run_id=run.run_id, stage=0, peer_id="x", capabilities=[])
    nan = _forward(run, 1, [att.signer.peer_id], torch.full((b, t, d), float("nan")))
    shape = _forward(run, 2, [att.signer.peer_id], torch.randn(b, t, d + 1))
    infer_nan = Infer(run.run_id, 1, encode(torch.full((1, t, d), float("nan")), "none"), "none")
    infer_floats = Infer(run.run_id, 0, encode(torch.randn(1, t, d), "none"), "none")  # stage 0 takes token ids
    payloads = {"garbage": b"\x00garbage" * 8, "bad_magic": b"XX" + bytes(10),
                "huge_announce": frame_header(2**40, end=True), "wrong_kind": frame_header(len(pack(hello)), end=True)
                + pack(hello), "nan": _frame(nan), "wrong_shape": _frame(shape), "infer_nan": _frame(infer_nan),
                "infer_floats": _frame(infer_floats)}
    for victim, pid in victims.items():
        for handler in (FORWARD_RPC, BACKWARD_RPC, REACH_RPC, STATE_RPC, AVG_RPC, INFER_RPC):
            for name, data in payloads.items():
                cells[f"{victim}.{handler}.{name}"] = await att.raw(att.p2p, pid, handler, data, timeout=10)
    await asyncio.sleep(max(0.0, until - time.monotonic()))
    bad = {k: v for k, v in cells.items() if v in ("Ack", "INTERNAL")}
    replies: dict[str, int] = {}
    for v in cells.values():
        replies[v] = replies.get(v, 0) + 1
    return {"refused": not bad, "cells": len(cells), "replies": replies, "accepted_or_internal": bad}


def _frame(msg: Message) -> bytes:
    data = pack(msg)
    return frame_header(len(data), end=True) + data


async def _counters(status: Callable[[], dict[str, Any] | None]) -> dict[str, float]:
    return ((await asyncio.to_thread(status)) or {}).get("counters", {})


async def stranger_forwards(att: Attacker, victims: dict[str, str], until: float) -> dict[str, Any]:
    """A stranger announces itself as stage 0 and sends stage 1 forwards of random activations; replays one 50x."""
    before = await _counters(att.status_b)
    await _own_record(att, 0, 1.0)
    await asyncio.sleep(2.0)  # let the victims see the record
    run, counts = att.run, {}
    b, t, d = run.data.batch_size, run.model.block_size, run.model.n_embd
    replay = _forward(run, 7, [att.signer.peer_id], torch.randn(b, t, d))
    replay_acks = 0
    for _ in range(50):
        try:
            replay_acks += isinstance(await call(att.p2p, victims["b"], FORWARD_RPC, replay, timeout=5), Ack)
        except Exception:  # refusals raise RemoteError
            pass
    mb = 1000
    while time.monotonic() < until:
        mb += 1
        try:
            r = await call(att.p2p, victims["b"], FORWARD_RPC, _forward(run, mb, [att.signer.peer_id],
                                                                    torch.randn(b, t, d)), timeout=5)
            name = type(r).__name__
        except Exception as e:  # a refusal
            name = getattr(getattr(e, "code", None), "name", type(e).__name__)
        counts[name] = counts.get(name, 0) + 1
        if int(time.monotonic() * 4) % 4 == 0:
            await _own_record(att, 0, 1.0)
    after = await _counters(att.status_b)
    seen = {k: int(after.get(k, 0) - before.get(k, 0)) for k in (
        "rejected:loss_above_ceiling", "rejected:share_exceeded", "rejected:share_banned", "share_bans")}
    # every forward it got in (Ack) was refused at the loss check, none trained on (the stage-1 victim's counters,
    # which count honest refusals too: a few over the attacker's Acks is honest noise, fewer is training on garbage)
    refused = replay_acks <= 1 and seen["rejected:loss_above_ceiling"] >= counts.get("Ack", 0)
    return {"refused": refused, "replies": counts, "replay_accepted": replay_acks, "victim_counters": seen}


RESTART_EVERY_S = 12.0  # restarting_black_hole: announces itself training this long (a newcomer is judged after 10 s)
RESTART_JOINING_S = 2.5  # ... then joining this long (two of the victims' 1-s record refreshes), and again


async def black_hole(att: Attacker, victims: dict[str, str], until: float, *,
                     restarting: bool = False) -> dict[str, Any]:
    """A stranger announces itself as a stage-1 peer with throughput 1e9, acks every forward and never answers.
    ``restarting``: after each ``RESTART_EVERY_S`` it announces itself joining for a while, as a restarted peer does,
    which ends a black-hole ban and makes it a newcomer again (``Router.observe``)."""
    server = RpcServer(att.p2p, RpcLimits())
    taken, restarts = 0, 0

    async def swallow(msg: Message, peer: str) -> Message:
        nonlocal taken
        taken += 1
        return Ack()
    await server.add_handler(FORWARD_RPC, swallow)
    before = await _counters(att.status_a)
    since = time.monotonic()
    while time.monotonic() < until:
        if restarting and time.monotonic() - since > RESTART_EVERY_S:
            await _own_record(att, 1, 1e9, state="joining")
            await asyncio.sleep(RESTART_JOINING_S)
            restarts, since = restarts + 1, time.monotonic()
        await _own_record(att, 1, 1e9)
        await asyncio.sleep(1.0)
    await server.shutdown()
    after = await _counters(att.status_a)
    banned = int(after.get("black_holes_banned", 0) - before.get("black_holes_banned", 0))
    forfeited = int(after.get("microbatches_forfeited", 0) - before.get("microbatches_forfeited", 0))
    return {"refused": banned > 0, "forwards_swallowed": taken, "black_holes_banned_by_stage0": banned,
            "restarts": restarts, "forfeited_by_stage0": forfeited}



async def lying_donor(att: Attacker, victims: dict[str, str], until: float) -> dict[str, Any]:
    """A stranger announces itself as a stage-1 replica far ahead of everyone (state version 10^6) and serves a
    stage-1 state whose weights are zeros. A second honest stage-1 replica (c) joins first, then a joiner (d): it
    asks the donors its initial peer vouches for first (b), then the most advanced, the liar, whose state its
    witnesses outvote; it must load an honest state, never the liar's. Both extra peers leave at the end of the
    phase."""
    liar = StageWorker(att.run, 1)
    with torch.no_grad():
        for weight in liar.model.parameters():
            weight.zero_()

    async def worker_call(fn: Callable[[StageWorker], Any]) -> Any:
        return fn(liar)

    server = RpcServer(att.p2p, RpcLimits())
    state_server = StateServer(p2p=att.p2p, rpc_server=server, run=att.run, stage=1, worker_call=worker_call,
                               metrics=PeerMetrics("liar", 1))
    await state_server.start()
    state_server.ready = True
    rec = PeerRecord(peer_id=att.signer.peer_id, stage=1, throughput=1.0, queue=0, version=10**6, state="training",
                     maddrs=[])

    async def keep_announcing() -> None:
        while True:
            await announce(att.dht, att.run.run_id, rec, 4.0, signer=att.signer)
            await asyncio.sleep(1.0)

    announcing: asyncio.Task | None = None
    try:
        async with honest_peer(att, "c", 1):
            announcing = asyncio.ensure_future(keep_announcing())
            await asyncio.sleep(2.0)  # the liar's record reaches the DHT before the joiner reads it
            visible = att.signer.peer_id in await fetch_swarm(att.reader, att.run.run_id, timeout=5.0)
            async with honest_peer(att, "d", 1) as (d, status):
                await asyncio.sleep(max(0.0, until - time.monotonic()))
                counters = status.get("counters", {})
                late = await asyncio.to_thread(d.status) or {}
                losses = {"b": (await asyncio.to_thread(att.status_b) or {}).get("train_loss"),
                          "d": late.get("train_loss")}
                log = d.log()
                await judge_now(att)
        loaded = next((line for line in log.splitlines() if "loaded stage 1 state from" in line), "")
        served = state_server.metrics.snapshot()["counters"].get("state_chunks_served", 0)
    finally:
        if announcing is not None:
            announcing.cancel()
        await server.shutdown()
    from_liar = att.signer.peer_id[:16] in loaded
    return {"refused": bool(loaded) and not from_liar,
            "degraded": from_liar, "train_loss_at_end": losses,
            "joiner_outvoted": counters.get("state_sync_outvoted", 0), "joiner_loaded_from_liar": from_liar,
            "liar_chunks_served": served, "liar_visible_in_dht": visible}


ATTACKS: dict[str, Callable[[Attacker, dict[str, str], float], Awaitable[dict[str, Any]]]] = {
    "forged_record": forged_record, "budget_flood": budget_flood, "churn_flood": churn_flood,
    "stream_flood": stream_flood,
    "malformed": malformed, "stranger_forwards": stranger_forwards, "black_hole": black_hole,
    "restarting_black_hole": functools.partial(black_hole, restarting=True), "lying_donor": lying_donor}
from tools.redteam_state import ATTACKS as _STATE_ATTACKS  # noqa: E402 (its attacks use this module's helpers)

ATTACKS.update(_STATE_ATTACKS)
ATTACKS.update(TRUST_ATTACKS)  # tools/redteam_trust.py: the pipeline's and the DHT's trust
FLOOD = {"ids": 16, "streams": 16}


REPLICATED = frozenset({"lying_donor", "poisoned_backup", "poisoned_donor_state", "witness_sybils", "phantom_quorum",
                        "vouch_sybils", "fake_next_stage", "patient_liar"})
"""Attacks on what replicas do together (averaging, witnesses, backups, spot checks): run against stages of
``--replicas`` peers; the others against one peer per stage."""
MIN_PHASE_S = {"loss_window_drift": 50.0}
"""Attacks that cannot act within a short phase (a sender's losses count for the ceiling only after 30 s)."""


def outcome(stall: float, ratio: float | None, refused: bool, degraded: bool = False) -> str:
    """``degraded``: the attack's own evidence of harm that the loss figures do not show (a joiner that loaded a
    liar's state)."""
    if stall > STALL_LIMIT_S:
        return "stalled"
    if degraded or (ratio is not None and ratio > LOSS_LIMIT):
        return "degraded"
    return "refused" if refused else "harmless"


class Campaign:
    """The attacked swarm, its twin and their judges; one phase after another, both judged at each phase's end."""

    def __init__(self, args: argparse.Namespace, attacked: Swarm, twin: Swarm, root: Path) -> None:
        self.args, self.attacked, self.twin, self.root = args, attacked, twin, root
        self.run = RunConfig.from_toml(args.run)
        self.judges = (Judge(self.run, root / "judge-a.key", args.eval_batches),
                       Judge(self.run, root / "judge-t.key", args.eval_batches))
        self.verdicts: tuple[Verdict, Verdict] | None = None

    async def judge(self) -> None:
        self.verdicts = tuple(await asyncio.gather(self.judges[0].judge(self.attacked),  # type: ignore[assignment]
                                                   self.judges[1].judge(self.twin)))

    async def figures(self, t0: float, t1: float, before: tuple[Verdict, Verdict] | None = None) -> dict[str, Any]:
        """The phase's figures: stalls, the judged losses of both swarms and their ratios, reported losses; with
        ``before`` (both swarms judged as the phase began) also the damage carried in from earlier phases and the
        phase's own: the worst ratio at the end over the worst at the start, when the start was behind the twin."""
        stall, reported = self.attacked.window(t0, t1)
        twin_stall, twin_reported = self.twin.window(t0, t1)
        attacked, twin = self.verdicts or (Verdict(), Verdict())
        layout = [n for n in attacked.losses if n in twin.losses]  # the pipelines both swarms have
        worst = max(attacked.losses.values(), default=None)
        twin_worst = max(twin.losses.values(), default=None)
        mean_ratio = ratio(attacked.mean(layout), twin.mean(layout))
        worst_ratio = ratio(worst, twin_worst)
        reported_ratio = ratio(reported, twin_reported)
        carried = None if before is None else ratio(max(before[0].losses.values(), default=None),
                                                    max(before[1].losses.values(), default=None))
        own = None if worst_ratio is None else worst_ratio / max(1.0, carried or 1.0)
        return {"max_stall_s": round(stall, 2), "twin_max_stall_s": round(twin_stall, 2),
                "honest_val_loss_ratio": None if mean_ratio is None else round(mean_ratio, 3),
                "worst_victim_loss_ratio": None if worst_ratio is None else round(worst_ratio, 3),
                "carried_in_loss_ratio": None if carried is None else round(carried, 3),
                "phase_loss_ratio": None if own is None else round(own, 3),
                "reported_val_loss_ratio": None if reported_ratio is None else round(reported_ratio, 3),
                "val_loss": {"attacked": attacked.to_json(), "twin": twin.to_json()},
                "steps": {"attacked": await asyncio.to_thread(self.attacked.steps),
                          "twin": await asyncio.to_thread(self.twin.steps)}}

    async def control(self, seconds: float) -> dict[str, Any]:
        logger.info("control phase (%.0f s) starts", seconds)
        t0 = time.monotonic()
        await asyncio.sleep(seconds)
        await self.judge()
        return await self.figures(t0, time.monotonic())

    async def phases(self, names: list[str], progress: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        a, b = self.attacked.peers[0][0], self.attacked.peers[1][0]
        att = Attacker(self.root, self.attacked.initial, self.run)
        att.status_a, att.status_b, att.swarm, att.judge = a.status, b.status, self.attacked, self.judge
        victims = {"a": peer_id_of(a), "b": peer_id_of(b)}
        if len(self.attacked.peers) > 2:  # the first peer of stage 2
            victims["c"] = peer_id_of(self.attacked.peers[2][0])
        await att.start()
        await self.judges[0].start(self.attacked.initial)
        await self.judges[1].start(self.twin.initial)
        results: dict[str, Any] = {"control": []}
        try:
            if {"budget_flood", "churn_flood"} & set(names):
                await att.identities(self.args.flood_ids)  # started before any phase: starting p2pd is not the attack
            for i, name in enumerate(names):
                if i == 0 or self.args.control_each:
                    results["control"].append(await self.control(self.args.phase_s))
                    progress(results)
                seconds = max(self.args.phase_s, MIN_PHASE_S.get(name, 0.0))
                await self.judge()  # what earlier phases left: this phase is judged on its own change too
                before = self.verdicts
                logger.info("attack %s (%.0f s) starts", name, seconds)
                t0, rss0, self.verdicts = time.monotonic(), self.attacked.rss_mib(), None
                try:
                    evidence = await ATTACKS[name](att, victims, t0 + seconds)
                except Exception as e:  # the attack itself failed: say so, keep the campaign going
                    logger.exception("attack %s failed", name)
                    evidence = {"refused": False, "error": f"{type(e).__name__}: {e}"}
                t1 = time.monotonic()
                if self.verdicts is None:
                    await self.judge()
                fig = await self.figures(t0, t1, before)
                verdict = outcome(fig["max_stall_s"], fig["phase_loss_ratio"], evidence.pop("refused"),
                                  evidence.pop("degraded", False))
                results[name] = {"outcome": verdict, **fig, "replicas": self.attacked.replicas,
                                 "rss_growth_mib": round(max(0.0, self.attacked.rss_mib() - rss0), 1),
                                 "phase_s": round(t1 - t0, 1), "evidence": evidence}
                logger.info("%s: %s", name, {k: results[name][k] for k in (
                    "outcome", "max_stall_s", "honest_val_loss_ratio", "worst_victim_loss_ratio", "phase_loss_ratio")})
                progress(results)
                await asyncio.sleep(1.0)  # let the attack's last streams drain before the next phase
        finally:
            await att.close()
            await asyncio.gather(*(j.close() for j in self.judges), return_exceptions=True)
        return results


async def campaign(args: argparse.Namespace, names: list[str], attacked: Swarm, twin: Swarm,
                   root: Path, progress: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    quota = CpuQuota(args.attacker_cpu).enter() if args.attacker_cpu else None  # before the attacker starts anything
    try:
        results = await Campaign(args, attacked, twin, root).phases(names, progress)
    finally:
        if quota is not None:
            throttled = quota.throttled_s()
            quota.close()
    if quota is not None:
        results["attacker_confined"] = {"cores": args.attacker_cpu, "throttled_s": round(throttled, 1)}
    return results


def run_group(args: argparse.Namespace, names: list[str], replicas: int, root: Path,
              progress: Callable[[dict[str, Any]], None] = lambda _: None) -> dict[str, Any]:
    """Start the attacked swarm and its twin together (``replicas`` peers per stage each), let them train for
    ``--warmup-s``, run ``names`` against the first, reap both."""
    run = RunConfig.from_toml(args.run)
    settings = (*SETTINGS, *args.victim_set)
    swarms = [Swarm(name, root / f"{name}{replicas}", args.run, run.n_stages, replicas, settings, REPO)
              for name in ("v", "t")]
    try:
        for s in swarms:
            s.start_first()
        for s in swarms:
            s.start_rest()
        for s in swarms:
            s.wait_training(180)
            s.watch()
        time.sleep(args.warmup_s)
        (root / f"attacker{replicas}").mkdir(parents=True, exist_ok=True)  # its identities, the judges' keys
        results = asyncio.run(campaign(args, names, swarms[0], swarms[1], root / f"attacker{replicas}", progress))
        results["victims_alive"], results["twin_alive"] = swarms[0].alive(), swarms[1].alive()
    finally:
        for s in swarms:
            s.close()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attacks", default=",".join(ATTACKS), help=f"comma-separated, of: {', '.join(ATTACKS)}")
    p.add_argument("--phase-s", type=float, default=20.0, help="seconds per phase (default 20)")
    p.add_argument("--run", type=Path, default=TINY,
                   help="run TOML of both swarms (default tests/runs/tiny.toml; fake_middle_stage needs 3 stages or "
                        "more: tests/runs/tiny3.toml)")
    p.add_argument("--warmup-s", type=float, default=20.0,
                   help="seconds both swarms train before the first phase (default 20)")
    p.add_argument("--replicas", type=int, default=2,
                   help="peers per stage for the attacks on replicas (default 2; the others: 1)")
    p.add_argument("--eval-batches", type=int, default=4, help="validation batches the judge evaluates (default 4)")
    p.add_argument("--control-each", action="store_true", help="a control phase before every attack phase")
    p.add_argument("--flood-ids", type=int, default=16, help="identities of the floods (x 16 streams each)")
    p.add_argument("--attacker-cpu", type=float, default=None, metavar="CORES",
                   help="confine the attacker (its event loop, DHT and libp2p daemons) to this many cores with a "
                        "cgroup v1 CPU quota: models a remote attacker whose daemons do not run on the victims' "
                        "cores (root; default: unconfined, the attacker shares the victims' cores)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the results here")
    p.add_argument("--victim-set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a peer setting of both swarms (repeatable), e.g. spot_checks=false to measure a defence's "
                        "absence")
    p.add_argument("--workdir", default=None, help="keep the peers' folders here (default: a temporary one)")
    args = p.parse_args(argv)
    args.attacks = [x for x in args.attacks.split(",") if x]
    FLOOD["ids"] = args.flood_ids
    unknown = set(args.attacks) - set(ATTACKS)
    if unknown:
        p.error(f"unknown attacks {sorted(unknown)}; known: {', '.join(ATTACKS)}")
    if args.replicas < 1:
        p.error("--replicas must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    unwind_on_sigterm()  # SIGTERM unwinds through the finally blocks that reap the swarms
    root = Path(args.workdir or tempfile.mkdtemp(prefix="redteam-"))
    results: dict[str, Any] = {"command": " ".join(["python", "tools/redteam.py",
                                                    *(argv if argv is not None else sys.argv[1:])]),
                               "machine": {"nproc": os.cpu_count(),
                                           "loadavg_start": Path("/proc/loadavg").read_text().split()[:3]},
                               "groups": {}}
    groups = {1: [n for n in args.attacks if n not in REPLICATED],
              args.replicas: [n for n in args.attacks if n in REPLICATED]}
    if args.replicas == 1:
        groups = {1: args.attacks}
    for replicas, names in groups.items():
        if not names:
            continue
        key = f"{replicas}x{RunConfig.from_toml(args.run).n_stages}"
        try:
            group = run_group(args, names, replicas, root, functools.partial(_write, args, results, key))
        except Exception as e:  # a swarm that would not start: say so, run the next group
            logger.exception("the %s swarms failed", key)
            group = {"error": f"{type(e).__name__}: {e}"}
        _merge(results, key, group)
    results["machine"]["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    text = json.dumps(results, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


def _merge(results: dict[str, Any], key: str, group: dict[str, Any]) -> None:
    """A group's figures into the results: its control phases and liveness under ``groups``, its attacks on top."""
    group = dict(group)
    results["groups"][key] = {k: group.pop(k) for k in ("control", "victims_alive", "twin_alive",
                                                        "attacker_confined", "error") if k in group}
    results.update(group)


def _write(args: argparse.Namespace, results: dict[str, Any], key: str, partial: dict[str, Any]) -> None:
    """The results so far, written after every phase (a campaign cut short keeps what it measured)."""
    if args.json:
        merged = json.loads(json.dumps(results))
        _merge(merged, key, partial)
        merged["machine"]["loadavg_now"] = Path("/proc/loadavg").read_text().split()[:3]
        Path(args.json).write_text(json.dumps(merged, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
