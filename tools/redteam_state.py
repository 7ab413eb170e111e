"""Red-team attacks on loaded states and earned trust, registered in ``tools/redteam.py`` (same phases and report).

Each attack is ``attack(att, victims, until) -> evidence`` like the others of the tool: ``att`` is its ``Attacker``
(a DHT node of its own, raw libp2p clients), ``victims`` maps "a" (stage 0) and "b" (stage 1) to peer ids, and the
evidence carries ``refused`` (the victims refused what the attack needed) and ``degraded`` (harm shown by the
evidence itself). What each one does is in its docstring; docs/security.md has the measured results.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from hivemind.p2p import P2P

from peer.membership.records import PeerRecord, announce
from peer.membership.signing import Signer
from peer.ops.metrics import PeerMetrics
from peer.pipeline.hops import FORWARD_RPC
from peer.state.sync import STATE_RPC, StateServer, StateSyncConfig, load_state_from_peers
from protocol.errors import RemoteError
from protocol.limits import RpcLimits
from protocol.messages import Ack, Busy, Error, Message, StateChunk, StateRequest
from protocol.rpc import RpcServer, call
from tools.redteam_swarm import honest_peer, judge_now
from trainer.worker import StageWorker

if TYPE_CHECKING:
    from tools.redteam import Attacker

Evidence = dict[str, Any]


async def _serve_state(att: Attacker, p2p: P2P, stage: int, worker: StageWorker) -> RpcServer:
    """A state server on ``p2p`` serving ``worker``'s state as stage ``stage``'s (unlimited: the attacker's own)."""
    async def worker_call(fn: Callable[[StageWorker], Any]) -> Any:
        return fn(worker)

    server = RpcServer(p2p, RpcLimits())
    unlimited = {k: 10**6 for k in ("peer_start_burst", "peer_chunk_burst")
                 if k in {f.name for f in dataclasses.fields(StateSyncConfig)}}  # (versions before the limits)
    state = StateServer(p2p=p2p, rpc_server=server, run=att.run, stage=stage, worker_call=worker_call,
                        metrics=PeerMetrics("attacker", stage), config=StateSyncConfig(**unlimited))
    await state.start()
    state.ready = True
    return server


async def _announcing(att: Attacker, signer: Signer, rec: PeerRecord) -> asyncio.Task:
    async def loop() -> None:
        while True:
            await announce(att.dht, att.run.run_id, rec, 4.0, signer=signer)
            await asyncio.sleep(1.0)

    task = asyncio.ensure_future(loop())
    await asyncio.sleep(2.0)  # the record reaches the DHT before anyone reads it
    return task


async def _identity(att: Attacker, name: str) -> tuple[P2P, Signer]:
    """One more identity of the attacker (its key kept under ``name``): a libp2p node in the swarm and its signer."""
    key = att.root / f"{name}.key"
    if not key.exists():
        P2P.generate_identity(str(key))
    p2p = await P2P.create(identity_path=str(key), initial_peers=att.initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    return p2p, Signer.from_identity_file(key)


def _zeros(att: Attacker, stage: int) -> StageWorker:
    w = StageWorker(att.run, stage)
    with torch.no_grad():
        for p in w.model.parameters():
            p.zero_()
    return w


@dataclasses.dataclass
class Joined:
    """What an honest joiner showed: its /status when it began training, at the end, and its log."""
    status: dict[str, Any]
    late: dict[str, Any]
    log: str

    @property
    def counters(self) -> dict[str, float]:
        return self.status.get("counters", {})


async def _joiner_phase(att: Attacker, name: str, stage: int, until: float,
                        records: Sequence[tuple[Signer, PeerRecord]], servers: Sequence[RpcServer] = (),
                        p2ps: Sequence[P2P] = ()) -> Joined:
    """The attacks on a joiner: announce ``records`` (each signed by its signer, every second), start an honest
    joiner of ``stage`` in the attacked swarm, let it train until ``until``, judge both swarms while it lives, then
    stop announcing, reap it and shut the attacker's ``servers`` and ``p2ps`` down, however the attack ended."""
    tasks: list[asyncio.Task[None]] = []
    try:
        for signer, rec in records:
            tasks.append(await _announcing(att, signer, rec))
        async with honest_peer(att, name, stage) as (joiner, status):
            await asyncio.sleep(max(0.0, until - time.monotonic()))
            late = await asyncio.to_thread(joiner.status) or {}
            await judge_now(att)
            return Joined(status=status, late=late, log=joiner.log())
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*(s.shutdown() for s in servers), return_exceptions=True)
        await asyncio.gather(*(p.shutdown() for p in p2ps), return_exceptions=True)


def _loaded_from(log: str, stage: int, peer_id: str) -> bool:
    line = next((x for x in log.splitlines() if f"loaded stage {stage} state from" in x), "")
    return peer_id[:16] in line


async def poisoned_backup(att: Attacker, victims: dict[str, str], until: float) -> Evidence:
    """The attacker's record says it is a stage-0 peer holding a copy of stage 1 at step 10^6 (``backup_stage`` 1)
    and it serves a zeroed stage-1 state. A joiner of stage 1 ranks that copy above the honest donor (b): before,
    it restored the copy unwitnessed; now b witnesses it and refuses it."""
    zeros = _zeros(att, 1)
    zeros.local_step = 10**6  # what the copy's own counter says, like its record
    server = await _serve_state(att, att.p2p, 1, zeros)
    rec = PeerRecord(peer_id=att.signer.peer_id, stage=0, throughput=1.0, queue=0, version=1, state="training",
                     maddrs=[], backup_stage=1, backup_step=10**6, backup_taken_at=time.time())
    seen = await _joiner_phase(att, "pb", 1, until, [(att.signer, rec)], [server])
    restored = f"backup copy held by peer {att.signer.peer_id[:16]}" in seen.log
    return {"refused": not restored and seen.counters.get("state_sync_outvoted", 0) >= 1, "degraded": restored,
            "joiner_restored_attackers_copy": restored, "joiner_outvoted": seen.counters.get("state_sync_outvoted", 0),
            "joiner_train_loss": seen.late.get("train_loss")}


async def poisoned_donor_state(att: Attacker, victims: dict[str, str], until: float) -> Evidence:
    """The attacker fetches b's honest stage-1 state, then serves it as its own with ``local_step`` 2^62 (the
    learning-rate schedule's end, for good), optimiser moments x 10^6 and announces version 10^6. A joiner takes it
    (its weights are honest): before, with the step and moments; now with the step capped at the witnesses' and the
    moments dropped."""
    honest = await load_state_from_peers(p2p=att.p2p, run=att.run, stage=1, metrics=PeerMetrics("attacker", 1),
                                         donors=[victims["b"]])
    if honest is None:
        return {"refused": False, "error": "could not read b's state"}
    liar = StageWorker(att.run, 1)
    liar.load_state_dict(honest)
    liar.local_step = 2**62
    for slot in liar.optimizer.state.values():
        for v in slot.values():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                v.mul_(1e6)
    server = await _serve_state(att, att.p2p, 1, liar)
    rec = PeerRecord(peer_id=att.signer.peer_id, stage=1, throughput=1.0, queue=0, version=10**6,
                     state="training", maddrs=[])
    seen = await _joiner_phase(att, "pd", 1, until, [(att.signer, rec)], [server])
    step = int(seen.late.get("local_step") or 0)
    return {"refused": step < 2**40, "degraded": step >= 2**40, "joiner_local_step": step,
            "joiner_step_capped": seen.counters.get("state_step_capped", 0),
            "joiner_train_loss": seen.late.get("train_loss")}


async def witness_sybils(att: Attacker, victims: dict[str, str], until: float) -> Evidence:
    """A liar announces a zeroed stage-1 state at version 10^6, and four sybil identities announce themselves as
    stage-1 replicas serving the same zeros, so that a joiner's witnesses are mostly theirs. Before, two witnesses
    drawn at random judged only chunk 0 and two chunks, and a silent one prevented any outvote; now every announced
    replica (up to 8) is asked and a strict majority must agree, so five identities outvote the honest b and d;
    now the joiner draws its witnesses from the peers its initial peer vouches for (peer.membership.vouches), which
    the sybils did no work for, and asks those donors first (``vouched_first``: five identities ranked above them
    would otherwise use up every donor attempt, and the joiner would start from the init)."""
    zeros = _zeros(att, 1)
    zeros.local_step = 10**6
    servers = [await _serve_state(att, att.p2p, 1, zeros)]
    records = [(att.signer, PeerRecord(peer_id=att.signer.peer_id, stage=1, throughput=1.0, queue=0, version=10**6,
                                       state="training", maddrs=[]))]
    sybils = []
    for i in range(4):  # each sybil: its own identity, serving the zeros, with a record signed by that identity
        p2p, signer = await _identity(att, f"sybil{i}")
        sybils.append(p2p)
        servers.append(await _serve_state(att, p2p, 1, zeros))
        records.append((signer, PeerRecord(peer_id=signer.peer_id, stage=1, throughput=1.0, queue=0, version=10**5,
                                           state="training", maddrs=[])))
    seen = await _joiner_phase(att, "pw", 1, until, records, servers, sybils)
    from_liar = any(_loaded_from(seen.log, 1, signer.peer_id) for signer, _rec in records)
    vouched = re.search(r"witnesses of a state are drawn from (\d+) peers", seen.log)
    from_init = "seeded init" in seen.log  # every honest donor vetoed, or never asked: the stage's training lost
    return {"refused": not from_liar and not from_init, "degraded": from_liar or from_init,
            "joiner_loaded_from_liar": from_liar, "joiner_outvoted": seen.counters.get("state_sync_outvoted", 0),
            "joiner_vouched_peers": int(vouched.group(1)) if vouched else None,
            "joiner_started_from_init": from_init, "sybil_records": len(records) - 1}


async def bounds_reset(att: Attacker, victims: dict[str, str], until: float) -> Evidence:
    """The attacker announces itself as a stage-0 peer and sends b (stage 1) forwards whose activations are 1000x
    a trained stage's: before, four of them in a row made b forget its learnt norm bound; now the refusals of one
    sender never reset it while another stage-0 peer (a) is announced."""
    from tools.redteam import _counters, _forward
    task = await _announcing(att, att.signer, PeerRecord(peer_id=att.signer.peer_id, stage=0, throughput=1.0,
                                                         queue=0, version=0, state="training", maddrs=[]))
    b = victims["b"]
    before = await _counters(att.status_b)
    b_, t = att.run.data.batch_size, att.run.model.block_size
    replies: dict[str, int] = {}
    n = 0
    while time.monotonic() < until - 1.0 and n < 64:
        x = 1000 * torch.randn(b_, t, att.run.model.n_embd)
        try:
            reply = await call(att.p2p, b, FORWARD_RPC, _forward(att.run, 2**40 + n, [att.signer.peer_id], x),
                               timeout=5.0)
            name = reply.code.name if isinstance(reply, Error) else type(reply).__name__
        except RemoteError as e:
            name = e.code.name
        except Exception as e:  # how the victim ended the call is the observation
            name = type(e).__name__
        replies[name] = replies.get(name, 0) + 1
        if name == Busy.__name__:  # b has not seen our record yet: not a forward it judged
            await asyncio.sleep(0.5)
            continue
        n += 1
        await asyncio.sleep(0.05)
    task.cancel()
    after = await _counters(att.status_b)
    relearnt = after.get("relearnt:activations_norm", 0) - before.get("relearnt:activations_norm", 0)
    # refused only if b judged some of them (a phase in which our record never reached b shows nothing)
    return {"refused": relearnt == 0 and n > 0, "degraded": relearnt > 0, "b_relearnt_bound": relearnt,
            "forwards_judged": n, "replies": replies}


async def state_flood(att: Attacker, victims: dict[str, str], until: float) -> Evidence:
    """The attacker asks a for a new transfer (chunk 0: a snapshot, the skeleton) as fast as answers come: before,
    every request was served; now a few are, then Busy."""
    a = victims["a"]
    replies: dict[str, int] = {}
    t0 = time.monotonic()
    while time.monotonic() < min(until, t0 + 10.0):
        try:
            reply: Message = await call(att.p2p, a, STATE_RPC, StateRequest(run_id=att.run.run_id, stage=0, chunk=0),
                                        timeout=10.0)
            name = type(reply).__name__
        except RemoteError as e:
            name = e.code.name
        except Exception as e:  # how the victim ended the call is the observation
            name = type(e).__name__
        replies[name] = replies.get(name, 0) + 1
    await asyncio.sleep(max(0.0, until - time.monotonic()))
    served = replies.get(StateChunk.__name__, 0)
    return {"refused": replies.get(Busy.__name__, 0) > served, "replies": replies, "seconds": 10.0}


async def phantom_quorum(att: Attacker, victims: dict[str, str], until: float) -> Evidence:
    """A second honest stage-0 replica (c) joins a; the attacker announces two stage-0 records that never answer.
    Before, the rounds' full quorum counted them, so every round of a and c (2 parts) was a clipped minority round
    (avg_pull_clipped); now only partners heard from count."""
    signers = [Signer.generate() for _ in range(2)]  # records only: nobody behind them answers
    tasks: list[asyncio.Task] = []
    from tools.redteam import _counters
    try:
        async with honest_peer(att, "pc", 0):
            for s in signers:
                tasks.append(await _announcing(att, s, PeerRecord(peer_id=s.peer_id, stage=0, throughput=1.0,
                                                                  queue=0, version=1, state="training", maddrs=[])))
            before = await _counters(att.status_a)
            await asyncio.sleep(max(15.0, until - time.monotonic()))  # rounds of a and c, whenever c came
            after = await _counters(att.status_a)
            await judge_now(att)
    finally:
        for t in tasks:
            t.cancel()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("avg_pull_clipped", "averaging_rounds_ok",
                                                             "avg_below_quorum")}
    return {"refused": delta["avg_pull_clipped"] == 0 and delta["averaging_rounds_ok"] > 0,
            "degraded": delta["avg_pull_clipped"] > 0, "a_rounds": delta}


async def vouch_sybils(att: Attacker, victims: dict[str, str], until: float) -> Evidence:
    """Two sybil identities announce themselves as stage-0 replicas and answer every averaging call of a with Ack
    (no part): before, any reply that was not Busy made a sybil a known peer (no refusal budget, never banned).
    Then each sends 150 garbage requests at once: a stranger is banned after its refusal budget (40) and its
    later streams are held unanswered; a known peer's are all answered."""
    sybils: list[P2P] = []
    servers: list[RpcServer] = []
    tasks: list[asyncio.Task] = []

    async def ack(msg: Message, peer: str) -> Message:
        return Ack()

    try:
        for i in range(2):
            p2p, signer = await _identity(att, f"voucher{i}")
            sybils.append(p2p)
            server = RpcServer(p2p, RpcLimits())
            await server.add_handler("avg_part", ack)
            servers.append(server)
            tasks.append(await _announcing(att, signer, PeerRecord(peer_id=signer.peer_id, stage=0, throughput=1.0,
                                                                   queue=0, version=1, state="training",
                                                                   maddrs=[])))
        await asyncio.sleep(8.0)  # a few averaging rounds of a call them
        answered: dict[str, int] = {}
        for p2p in sybils:
            got = await asyncio.gather(*(att.raw(p2p, victims["a"], FORWARD_RPC, b"\x00garbage" * 8, timeout=4.0)
                                         for _ in range(150)))
            for name in got:
                answered[name] = answered.get(name, 0) + 1
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*(s.shutdown() for s in servers), return_exceptions=True)
        await asyncio.gather(*(p.shutdown() for p in sybils), return_exceptions=True)
    await asyncio.sleep(max(0.0, until - time.monotonic()))
    # a banned stranger's streams end or are held unanswered; Busy is only the per-peer stream limit
    held = sum(n for name, n in answered.items() if name not in ("BAD_REQUEST", "Busy"))
    return {"refused": held > 0, "degraded": held == 0, "replies": answered, "requests": 300}


ATTACKS: dict[str, Callable[[Attacker, dict[str, str], float], Awaitable[Evidence]]] = {
    "poisoned_backup": poisoned_backup, "poisoned_donor_state": poisoned_donor_state,
    "witness_sybils": witness_sybils, "bounds_reset": bounds_reset, "state_flood": state_flood,
    "phantom_quorum": phantom_quorum, "vouch_sybils": vouch_sybils}
