"""Red-team attacks on the pipeline's and the DHT's trust, registered in ``tools/redteam.py``'s ``ATTACKS``.

Each attack has the signature of the others there: ``attack(att, victims, until) -> evidence`` with ``att`` the
red team's ``Attacker`` (its DHT node ``att.dht``, libp2p ``att.p2p``, signer ``att.signer``, run ``att.run``, the
victims' /status readers ``att.status_a`` / ``att.status_b``), ``victims`` the peer ids of the stage-0 peer ("a")
and the stage-1 peer ("b"), and ``until`` the end of the phase (``time.monotonic()``). The evidence holds
``refused``: whether the victims refused what the attack needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import random
import signal
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer, get_dht_time

from peer.membership.records import PeerRecord, announce, fetch_swarm, swarm_key
from peer.membership.signing import Signer, seal
from peer.ops.metrics import PeerMetrics
from peer.pipeline import attest
from peer.pipeline.attest import KeyNotary
from peer.pipeline.boundary import Boundary
from peer.pipeline.hops import BACKWARD_RPC, FORWARD_RPC
from peer.pipeline.testimony import TESTIMONY_RPC
from peer.state.sync import load_state_from_peers
from protocol.codecs.registry import decode, encode
from protocol.errors import ErrorCode
from protocol.limits import RpcLimits
from protocol.messages import Ack, Backward, Busy, Error, Forward, Message, TestimonyRequest
from protocol.rpc import RpcServer, call
from protocol.validation import TensorSpec
from trainer.data import BatchStream, load_corpus
from trainer.model import build_stage
from trainer.subspace import Subspace, fixed_tables
from trainer.worker import StageWorker

SCALES = (1.0, 4.0, 0.25, 16.0, 1 / 16, 64.0, 1 / 64, 256.0, 1 / 256)


async def _counters(status: Any) -> dict[str, float]:
    return ((await asyncio.to_thread(status)) or {}).get("counters", {})


RECHECK_COUNTERS = ("recheck_sampled", "recheck_passed", "recheck_failed", "recheck_banned", "recheck_unavailable")


async def _changed(status: Any, before: dict[str, float], keys: tuple[str, ...]) -> dict[str, int]:
    """How much each of the counters ``keys`` of a victim grew since ``before``."""
    after = await _counters(status)
    return {k: int(after.get(k, 0) - before.get(k, 0)) for k in keys}


@contextlib.contextmanager
def _stopped(pids: list[int]) -> Iterator[None]:
    """The processes ``pids`` stopped (SIGSTOP) for the block, resumed after it."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def _inc(counts: dict[str, int], key: str) -> None:
    counts[key] += 1


def _taker(work: Callable[[str, Forward], Awaitable[None]], tasks: set[asyncio.Task], counted: Callable[[], None], *,
           targets: bool = False) -> Callable[[Message, str], Awaitable[Message]]:
    """The forward handler of a red-team stage: a training forward (one with targets where ``targets``) is acked at
    once, counted and handed to ``work`` in the background; anything else is answered Busy (it goes elsewhere)."""
    async def take(msg: Message, peer: str) -> Message:
        if not isinstance(msg, Forward) or msg.is_eval or (targets and msg.targets is None):
            return Busy(retry_after_s=0.0)
        counted()
        task = asyncio.ensure_future(work(peer, msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return Ack()
    return take


async def fake_next_stage_alone(att: Any, victims: dict[str, str], until: float) -> dict[str, Any]:
    """``fake_next_stage`` with the attacker as the next stage's only replica: the attacked swarm's honest stage-1
    peers are stopped (SIGSTOP) for the phase, so their records expire and stage 0 has no replica to spot-check the
    attacker against; it holds the copy of stage 1 it took from them before (with ``--victim-set backup_every_s=5``).
    They are resumed when the phase ends, before the judge fetches their weights."""
    with _stopped([p.proc.pid for p in att.swarm.peers[1]]):
        return await fake_next_stage(att, victims, until, alone=True)


async def fake_next_stage(att: Any, victims: dict[str, str], until: float, *, alone: bool = False,
                          patient: bool = False) -> dict[str, Any]:
    """A stranger announces itself as a stage-1 replica with throughput 1e9, acks every training forward at once and
    returns within milliseconds the negation of the gradient its own (untrained) stage-1 copy computes: a gradient
    of the right shape that trains stage 0 the wrong way, with a plausible loss (the honest stage-1 peer's latest).
    It learns the norm stage 0 accepts from its replies: a gradient refused for its norm makes it try the next scale
    of ``SCALES`` until one passes.
    Evaluation forwards are answered Busy (they go to the honest peer). Stage 0 must not train on its gradients.

    ``patient`` (``patient_liar``): for the first half of the phase it answers honestly, with the honest stage-1
    peer's weights fetched every 2 s as any peer may, and so earns passed spot checks and re-checks, more of them
    than each honest replica since it takes most of the traffic; then it lies as above. Under the spot checks' history
    rule, the replica it disagrees with would be blamed and banned; stage 0's held copy must decide instead: the
    liar is banned and no honest replica is."""
    run = att.run
    before = await _counters(att.status_a)
    worker = StageWorker(run, 1)
    turn_at = (time.monotonic() + until) / 2 if patient else 0.0
    answered = {"honest": 0, "fabricated": 0}
    bans: set[str] = set()
    b, t, d = run.data.batch_size, run.model.block_size, run.model.n_embd
    act, tok = TensorSpec((b, t, d), torch.float32), TensorSpec((b, t), torch.int64)
    server = RpcServer(att.p2p, RpcLimits())
    taken = sent = 0
    loss_seen, scale = [2.5], [0]
    tasks: set[asyncio.Task] = set()

    async def sync_weights() -> None:  # the honest stage-1 peer's state, as any joiner may fetch it
        state = await load_state_from_peers(p2p=att.p2p, run=run, stage=1, metrics=PeerMetrics("attacker", 1),
                                            donors=[victims["b"]])
        if state is not None:
            worker.load_state_dict(state)

    async def answer(peer: str, msg: Forward) -> None:
        nonlocal sent
        x, targets = decode(msg.activations, act), decode(msg.targets, tok)
        loss, grad = worker.forward_loss(msg.mb_id, x, targets)
        honest = time.monotonic() < turn_at
        answered["honest" if honest else "fabricated"] += 1
        fake = grad if honest else -grad * SCALES[scale[0]]
        reply = Backward(run_id=run.run_id, mb_id=msg.mb_id, route=msg.route, gradient=encode(fake, "int8"),
                         loss=float(loss) if honest else loss_seen[0], is_eval=False)
        try:
            await call(att.p2p, peer, BACKWARD_RPC, reply, timeout=5)
            sent += 1
        except Exception as e:  # refused: the victim's verdict is in its counters
            if "norm" in str(e):
                scale[0] = (scale[0] + 1) % len(SCALES)

    def took() -> None:
        nonlocal taken
        taken += 1

    async def banned_seen() -> None:  # who the stage-0 peers banned for fabricated gradients (their warnings)
        for peer in att.swarm.peers[0]:
            status = (await asyncio.to_thread(peer.status)) or {}
            bans.update(w["text"].split()[1] for w in status.get("warnings", []) if "; banned for" in w["text"])

    if patient:
        await sync_weights()
    await server.add_handler(FORWARD_RPC, _taker(answer, tasks, took, targets=True))
    rec = PeerRecord(peer_id=att.signer.peer_id, stage=1, throughput=1e9, queue=0, version=0, state="training",
                     maddrs=[])
    try:
        tick = 0
        while time.monotonic() < until:
            await announce(att.dht, run.run_id, rec, 4.0, signer=att.signer)
            if not alone:  # the honest stage-1 peer's latest loss (stopped when the attacker is alone)
                loss = ((await asyncio.to_thread(att.status_b)) or {}).get("train_loss")
                loss_seen[0] = float(loss) if loss else loss_seen[0]
            if patient:
                tick += 1
                if tick % 2 == 0 and time.monotonic() < turn_at:
                    await sync_weights()
                await banned_seen()
            await asyncio.sleep(1.0)
    finally:
        await server.shutdown()
        for task in list(tasks):
            task.cancel()
    seen = await _changed(att.status_a, before, (
        "spotcheck_sent", "spotcheck_passed", "spotcheck_failed", "spotcheck_arbitrated", "spotcheck_banned",
        "spotcheck_unavailable", "rejected:gradients_norm", "relearnt:gradients_norm", *RECHECK_COUNTERS))
    caught = seen["spotcheck_banned"] + seen["recheck_banned"] >= 1
    evidence = {"refused": caught, "forwards_taken": taken, "fabricated_gradients_delivered": sent,
                "scale_used": SCALES[scale[0]], "stage0_counters": seen}
    if patient:
        await banned_seen()
        me = att.signer.peer_id[-8:]
        honest_banned = sorted(b for b in bans if b != me)
        evidence.update(answered=answered, liar_banned=me in bans, honest_replicas_banned=honest_banned,
                        refused=me in bans and not honest_banned)
    return evidence


async def fake_middle_stage(att: Any, victims: dict[str, str], until: float) -> dict[str, Any]:
    """In a run of 3 stages or more (``--run tests/runs/tiny3.toml``): a stranger announces itself as stage 1's only
    replica (the honest stage-1 peers are stopped for the phase, as in ``fake_next_stage_alone``, so stage 0 has
    nobody to spot-check it against) and does no work: it sends every training forward of stage 0 on to the honest
    stage-2 peer untouched (under an id of its own, as a middle stage does) and returns the gradient stage 2 sends
    back untouched, naming stage 2's peer and the id as the protocol asks. Stage 1's weights never touch the
    micro-batch, and the residual stream makes its output and gradient look plausible in norm and direction. Stage 0
    must not train on its gradients: its re-checks from the copy of stage 1 (``--victim-set backup_every_s=5``), with
    stage 2's testimony, find that the hop added nothing. It signs its forwards and relays stage 2's signature of each
    gradient, as the protocol asks (``peer.pipeline.attest``): an unsigned one would be refused before any check."""
    if "c" not in victims:
        raise ValueError("fake_middle_stage needs a run of 3 stages or more (--run tests/runs/tiny3.toml)")
    run, me, notary = att.run, att.signer.peer_id, KeyNotary(att.signer)
    before = await _counters(att.status_a)
    server = RpcServer(att.p2p, RpcLimits())
    held: dict[int, tuple[str, Forward]] = {}  # our id -> (the stage-0 sender, its forward)
    sent: dict[int, bytes] = {}  # our id -> the digest of the forward we signed (its gradient signs it too)
    counts = {"forwards_taken": 0, "forwarded": 0, "gradients_returned": 0, "returns_refused": 0}
    tasks: set[asyncio.Task] = set()

    async def pass_on(peer: str, msg: Forward) -> None:
        mine = random.getrandbits(62)
        held[mine] = (peer, msg)
        onward, answers = attest.signed_frame(notary, Forward(
            run_id=run.run_id, mb_id=mine, route=[*msg.route, me], activations=msg.activations, targets=msg.targets,
            is_eval=False, sent_at=time.time(), tokens=msg.tokens), me)  # signed, as the code asks
        sent[mine] = answers
        try:
            if isinstance(await call(att.p2p, victims["c"], FORWARD_RPC, onward, timeout=5), Ack):
                counts["forwarded"] += 1
        except Exception:  # refused by stage 2: stage 0's micro-batch times out
            held.pop(mine, None)
            sent.pop(mine, None)

    async def give_back(msg: Message, peer: str) -> Message:
        if not isinstance(msg, Backward) or msg.mb_id not in held:
            return Ack()
        sender, fwd = held.pop(msg.mb_id)
        answers = sent.pop(msg.mb_id, b"")
        digest = attest.signed_by(notary, msg, peer, me, answers)  # stage 2's signature, relayed as an honest hop
        back = Backward(run_id=run.run_id, mb_id=fwd.mb_id, route=fwd.route, gradient=msg.gradient, loss=msg.loss,
                        is_eval=False, refused=msg.refused, downstream=[peer], downstream_id=msg.mb_id,
                        relayed=None if digest is None else [attest.relay(msg, digest, answers)])
        try:
            await call(att.p2p, sender, BACKWARD_RPC, back, timeout=5)
            counts["gradients_returned"] += 1
        except Exception:
            counts["returns_refused"] += 1
        return Ack()

    await server.add_handler(FORWARD_RPC, _taker(pass_on, tasks, lambda: _inc(counts, "forwards_taken")))
    await server.add_handler(BACKWARD_RPC, give_back)
    rec = PeerRecord(peer_id=me, stage=1, throughput=1e9, queue=0, version=0, state="training", maddrs=[])
    try:
        with _stopped([p.proc.pid for p in att.swarm.peers[1]]):
            while time.monotonic() < until:
                await announce(att.dht, run.run_id, rec, 4.0, signer=att.signer)
                await asyncio.sleep(1.0)
    finally:
        await server.shutdown()
        for task in list(tasks):
            task.cancel()
    seen = await _changed(att.status_a, before, (*RECHECK_COUNTERS, "spotcheck_sent", "spotcheck_banned",
                                                  "rejected:gradients_norm"))
    return {"refused": seen["recheck_banned"] >= 1, **counts, "stage0_counters": seen}


async def lying_witness(att: Any, victims: dict[str, str], until: float, *, silent: bool = False) -> dict[str, Any]:
    """In a run of 3 stages (``--run tests/runs/tiny3.toml``): a stranger announces itself as a replica of the last
    stage (throughput 1e9, so stage 1 sends it most of its traffic once it earned trust) and trains honestly, with the
    honest stage-2 peer's weights fetched every 2 s as any peer may: stage 1's re-checks of it pass. Asked by stage 0
    to testify about stage 1's work, it lies: it testifies activations stage 1 never sent (noise of their scale, under
    stage 1's signature). Unsigned, that lie got the honest stage-1 hop banned (docs/security.md, "A lying witness").
    Stage 0 must hold nothing against the hop, prove the lie with the signatures, and show the hop, which must stop
    sending work to the liar.

    ``silent`` (``silent_witness``): it answers every testimony request ``NOT_FOUND`` instead, which proves nothing
    about anybody; before, every 4th in a row failed the honest hop's re-check. Stage 0 must judge the hop by the hop's
    own record (``recheck_by_record``) and hold nothing against it."""
    if "c" not in victims:
        raise ValueError("lying_witness needs a run of 3 stages (--run tests/runs/tiny3.toml)")
    run, me, notary = att.run, att.signer.peer_id, KeyNotary(att.signer)
    if run.n_stages != 3:
        raise ValueError("lying_witness plays the last stage of a 3-stage run")
    before_a, before_b = await _counters(att.status_a), await _counters(att.status_b)
    worker = StageWorker(run, 2)
    b, t, d = run.data.batch_size, run.model.block_size, run.model.n_embd
    act, tok = TensorSpec((b, t, d), torch.float32), TensorSpec((b, t), torch.int64)
    server = RpcServer(att.p2p, RpcLimits())
    kept: dict[tuple[str, int], tuple[Forward, Backward]] = {}
    counts = {"forwards_taken": 0, "gradients_returned": 0, "testimonies_asked": 0, "lies_told": 0}
    tasks: set[asyncio.Task] = set()

    one_at_a_time = asyncio.Lock()

    async def sync_weights() -> None:
        state = await load_state_from_peers(p2p=att.p2p, run=run, stage=2, metrics=PeerMetrics("attacker", 2),
                                            donors=[victims["c"]])
        if state is not None:
            async with one_at_a_time:
                worker.load_state_dict(state)

    async def answer(peer: str, msg: Forward) -> None:
        x, targets = decode(msg.activations, act), decode(msg.targets, tok)
        async with one_at_a_time:  # one worker: its steps must not interleave
            loss, grad = await asyncio.to_thread(worker.forward_loss, msg.mb_id, x, targets)
        reply = attest.sign(notary, Backward(run_id=run.run_id, mb_id=msg.mb_id, route=msg.route,
                                             gradient=encode(grad, run.compression.gradients), loss=float(loss),
                                             is_eval=False), me, peer, attest.digest(msg))
        kept[(peer, msg.mb_id)] = (msg, reply)
        while len(kept) > 512:
            del kept[next(iter(kept))]
        try:
            await call(att.p2p, peer, BACKWARD_RPC, reply, timeout=5)
            counts["gradients_returned"] += 1
        except Exception:
            pass

    async def testify(msg: Message, peer: str) -> Message:
        counts["testimonies_asked"] += 1
        if silent or not isinstance(msg, TestimonyRequest) or msg.outgoing or (msg.sender, msg.mb_id) not in kept:
            return Error(code=ErrorCode.NOT_FOUND, message="no such micro-batch")
        fwd, bwd = kept[(msg.sender, msg.mb_id)]
        x = decode(fwd.activations, act)
        noise = encode(torch.randn_like(x) * x.std(), run.compression.activations)
        forged = dataclasses.replace(fwd, activations=noise)  # stage 1's signature kept: it no longer fits
        counts["lies_told"] += 1
        return attest.testify(notary, me, msg.sender, forged, bwd)

    await sync_weights()
    await server.add_handler(FORWARD_RPC, _taker(answer, tasks, lambda: _inc(counts, "forwards_taken"), targets=True))
    await server.add_handler(TESTIMONY_RPC, testify)
    rec = PeerRecord(peer_id=me, stage=2, throughput=1e9, queue=0, version=0, state="training", maddrs=[])
    try:
        tick = 0
        while time.monotonic() < until:
            await announce(att.dht, run.run_id, rec, 4.0, signer=att.signer)
            tick += 1
            if tick % 2 == 0:
                await sync_weights()
            await asyncio.sleep(1.0)
    finally:
        await server.shutdown()
        for task in list(tasks):
            task.cancel()
    keys = (*RECHECK_COUNTERS, "recheck_by_record", "liars_proven", "liars_shown", "liar_proof_refused",
            "liar_named")
    seen_a = await _changed(att.status_a, before_a, keys)
    seen_b = await _changed(att.status_b, before_b, ("liars_banned", "rejected:unsigned", "testimony_served"))
    framed = seen_a["recheck_banned"] > 0 or seen_a["recheck_failed"] > 0
    if silent:
        refused = counts["testimonies_asked"] > 0 and seen_a["recheck_by_record"] >= 1 and not framed
    else:
        refused = counts["lies_told"] > 0 and seen_a["liars_proven"] >= 1 and seen_b["liars_banned"] >= 1 \
            and not framed
    return {"refused": refused, "honest_hop_framed": framed, **counts, "stage0_counters": seen_a,
            "stage1_counters": seen_b}


Items = list[tuple[str, bytes | int, float, str | None]]
"""DHT items a red-team node offers: (key, value or a size of random bytes, expiration, subkey)."""


async def _store_at(dht: Any, node: Any, peer: str, items: Items) -> list[bool]:
    """Inside the attacker's DHT process: ask the victim ``peer`` itself to store ``items`` (key, value or a size of
    random bytes made here, expiration, subkey); its own answer per item (True: stored)."""
    out: list[bool] = []
    for key, value, exp, subkey in items:
        data = MSGPackSerializer.dumps(os.urandom(value)) if isinstance(value, int) else value
        got = await node.protocol.call_store(PeerID.from_base58(peer), [DHTID.generate(source=key)], [data], exp,
                                             subkeys=None if subkey is None else [subkey])
        out.append(bool(got and got[0]))
    return out


async def _stored(att: Any, peer: str, items: Items) -> list[bool]:
    """``_store_at`` run in the attacker's DHT process (only small items cross the pipe to it)."""
    return await att.dht.run_coroutine(functools.partial(_store_at, peer=peer, items=items), return_future=True)


async def dht_flood(att: Any, victims: dict[str, str], until: float) -> dict[str, Any]:
    """A stranger asks each victim's DHT node directly to store values under keys other than the run's (4 of 256 KiB,
    and 64 subkeys of 4 KiB under one key) and a 256-KiB value under the run's key, again and again while the phase
    lasts. The victims must refuse them all (their own answer per item: stored or not)."""
    rng = random.Random(0)
    big, small = 256 * 1024, 4 * 1024
    offered: dict[str, int] = {}
    stored: dict[str, int] = {}
    rounds = 0
    while time.monotonic() < until - 2:
        exp = get_dht_time() + 60
        items: Items = [
            (f"junk-{rng.getrandbits(64)}", big, exp, None) for _ in range(4)]
        junk_key = f"junk-dict-{rng.getrandbits(64)}"
        items += [(junk_key, small, exp, f"sub{i}") for i in range(64)]
        items += [(swarm_key(att.run.run_id), big, exp, att.signer.peer_id)]
        for name, peer in victims.items():
            try:
                answers = await asyncio.wait_for(_stored(att, peer, items), timeout=max(1.0, until - time.monotonic()))
            except Exception:  # a victim that stops answering is the stall figure's business
                continue
            offered[name] = offered.get(name, 0) + len(items)
            stored[name] = stored.get(name, 0) + sum(answers)
        rounds += 1
    return {"refused": bool(offered) and not any(stored.values()), "items_offered": offered,
            "items_stored_by_victim": stored, "rounds": rounds, "bytes_offered_per_round": 5 * big + 64 * small}


def costly_key_signer(rng: random.Random) -> Signer:
    """An RSA-2048 identity whose public exponent is a random ~2040-bit number (valid RSA, ~90x the verification cost
    of e = 65537)."""
    base = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_numbers()
    p, q = base.p, base.q
    phi = (p - 1) * (q - 1)
    while True:
        e = rng.getrandbits(2040) | 1
        try:
            d = pow(e, -1, phi)
            break
        except ValueError:  # e shares a factor with phi: draw again
            continue
    numbers = rsa.RSAPrivateNumbers(p, q, d, d % (p - 1), d % (q - 1), pow(q, -1, p), rsa.RSAPublicNumbers(e, p * q))
    return Signer(numbers.private_key())


async def costly_keys(att: Any, victims: dict[str, str], until: float) -> dict[str, Any]:
    """A stranger makes 4 identities with RSA keys of a ~2040-bit public exponent and announces each as a training
    peer of stage 1 (valid signatures), asking each victim's node directly to store them, every second: each would
    cost a reader ~8 ms to verify, on its event loop, every time it reads the swarm. The victims must refuse them and
    an honest reader must never see them."""
    rng = random.Random(1)
    signers = [costly_key_signer(rng) for _ in range(4)]
    key = swarm_key(att.run.run_id)
    offered = stored = seen = rounds = 0
    while rounds == 0 or time.monotonic() < until - 2:  # at least one round, however long the keys took
        rounds += 1
        exp = get_dht_time() + 30
        items = []
        for signer in signers:
            rec = PeerRecord(peer_id=signer.peer_id, stage=1, throughput=1.0, queue=0, version=0, state="training",
                             maddrs=[])
            items.append((key, MSGPackSerializer.dumps(seal(signer, key, rec.to_value(), exp)), exp, signer.peer_id))
        for peer in victims.values():
            try:
                answers = await asyncio.wait_for(_stored(att, peer, items), timeout=10)
            except Exception:
                continue
            offered += len(items)
            stored += sum(answers)
        view = await fetch_swarm(att.reader, att.run.run_id, timeout=5.0)
        seen = max(seen, sum(1 for s in signers if s.peer_id in view))
        await asyncio.sleep(1.0)
    return {"refused": offered > 0 and stored == 0 and seen == 0, "rounds": rounds, "records_offered": offered,
            "stored_by_victims": stored, "seen_by_honest_reader": seen}



class _Stage0Pose:
    """A stranger posing as a stage-0 peer: its ``verdict`` handler takes the Backwards the last stage sends it,
    ``announce()`` re-announces its stage-0 record (at most once a second) and ``send`` forwards a micro-batch to a
    victim, counting the reply's kind in ``replies``."""

    def __init__(self, att: Any, verdict: Callable[[Message, str], Any], first_id: int) -> None:
        self.att, self.verdict, self.mb = att, verdict, first_id
        self.server = RpcServer(att.p2p, RpcLimits())
        self.rec = PeerRecord(peer_id=att.signer.peer_id, stage=0, throughput=1.0, queue=0, version=0,
                              state="training", maddrs=[])
        self.replies: dict[str, int] = {}
        self._announced = 0.0

    async def start(self) -> None:
        await self.server.add_handler(BACKWARD_RPC, self.verdict)
        await self.announce()
        await asyncio.sleep(2.0)  # the record reaches the last stage before the first forward

    async def announce(self) -> None:
        if time.monotonic() - self._announced > 1.0:
            await announce(self.att.dht, self.att.run.run_id, self.rec, 4.0, signer=self.att.signer)
            self._announced = time.monotonic()

    async def forward(self, peer: str, acts: Any, targets: torch.Tensor, tokens: Any) -> tuple[int, str]:
        """Send ``peer`` a training forward of activations ``acts`` (an envelope), ``targets`` and token window
        ``tokens`` under the next id of our own; (that id, the reply's kind)."""
        self.mb += 1
        sub = self.att.run.compression.subspace  # a subspace run's forward carries its targets in the window only
        msg = Forward(run_id=self.att.run.run_id, mb_id=self.mb, route=[self.att.signer.peer_id], activations=acts,
                      targets=None if sub else encode(targets, "none"), is_eval=False, sent_at=time.time(),
                      tokens=tokens)
        return self.mb, await self.send(peer, msg)

    async def send(self, peer: str, msg: Forward) -> str:
        try:
            name = type(await call(self.att.p2p, peer, FORWARD_RPC, msg, timeout=5)).__name__
        except Exception as e:  # a refusal
            name = getattr(getattr(e, "code", None), "name", type(e).__name__)
        self.replies[name] = self.replies.get(name, 0) + 1
        return name


async def loss_window_drift(att: Any, victims: dict[str, str], until: float) -> dict[str, Any]:
    """A stranger fetches stage 0's weights from a (as any joiner may), announces itself as a stage-0 peer and sends
    the last stage forwards of real data through that honest copy, with a share of each micro-batch's targets
    scrambled so that its loss lands just under the last stage's loss ceiling: it reads each verdict (the loss in
    the Backward, trained or refused) and scrambles more after a trained one, less after a refused one, to drag the
    ceiling up and have ever worse micro-batches trained. The ceiling's window takes only trained losses of senders
    known for 30 s, at most 16 per sender, and the median it is set from rises at most 10 % per 300 s. The attacker
    also runs a copy of stage 1 (fetched from b, refreshed every 15 s) on the same batches unscrambled: its honest
    losses give the ceiling honest traffic alone sets (median + max(0.5 x median, 1.0), the guard's rule); the
    highest loss b trained in the last third of the phase must stay within 10 % of it."""
    run = att.run
    state = await load_state_from_peers(p2p=att.p2p, run=run, stage=0, metrics=PeerMetrics("attacker", 0),
                                        donors=[victims["a"]])
    if state is None:
        return {"refused": False, "error": "could not read a's stage-0 state"}
    stage0 = build_stage(run, 0)
    stage0.load_state_dict(state["model"])
    stage0.eval()
    stage1 = build_stage(run, 1)
    stage1.eval()
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = stage1.loss  # type: ignore[assignment]
    honest: list[float] = []  # the copy's losses of the same batches, unscrambled
    fetched_at, have_copy = -1e9, False
    corpus = load_corpus(run.data, run.model.vocab_size)
    stream = BatchStream(corpus.train, run.model.block_size, run.data.batch_size, seed=987654321)
    gen = torch.Generator().manual_seed(0)
    t0 = time.monotonic()
    sent: dict[int, float] = {}  # mb_id -> the scrambled share it carried
    verdicts: list[tuple[float, float, bool, float]] = []  # (time since start, loss, trained, share)
    share, unjudged = [0.3], [0]
    boundary = Boundary(run, None)
    before = await _counters(att.status_b)

    async def verdict(msg: Message, peer: str) -> Message:
        if isinstance(msg, Backward) and msg.mb_id in sent:
            f = sent.pop(msg.mb_id)
            if msg.loss is None:  # refused before any loss was computed (a failed forward re-check)
                unjudged[0] += 1
            else:
                verdicts.append((time.monotonic() - t0, float(msg.loss), not msg.refused, f))
            share[0] = min(1.0, share[0] + 0.02) if not msg.refused else max(0.0, share[0] - 0.06)
        return Ack()

    pose = _Stage0Pose(att, verdict, 2**41)
    await pose.start()
    try:
        while time.monotonic() < until - 1.0:
            await pose.announce()
            if time.monotonic() - fetched_at > 15.0:
                fetched_at = time.monotonic()
                copy = await load_state_from_peers(p2p=att.p2p, run=run, stage=1, donors=[victims["b"]],
                                                   metrics=PeerMetrics("attacker", 1))
                if copy is not None:
                    stage1.load_state_dict(copy["model"])
                    have_copy = True
            x, y = stream.next()
            if have_copy:
                with torch.no_grad():
                    honest.append(float(loss_of(stage1(stage0(x)), y)))
            mask = torch.rand(y.shape, generator=gen) < share[0]
            y = torch.where(mask, torch.randint(0, run.model.vocab_size, y.shape, generator=gen), y)
            # the token window its targets agree with, and activations of that window's inputs through the honest
            # copy: the last stage's forward re-check (peer.pipeline.fwdcheck) then finds them stage 0's own
            window = torch.cat([x[:, :1], y], dim=1)
            with torch.no_grad():
                h = stage0(window[:, :-1])
            acts, tokens = boundary.encode_forward(h, window)
            sent[pose.mb + 1] = share[0]  # before the send: its verdict may come back before the reply
            mb, reply = await pose.forward(victims["b"], acts, y, tokens)
            if reply != "Ack":
                sent.pop(mb, None)
            await asyncio.sleep(0.05 if reply == "Ack" else 0.2)
    finally:
        await pose.server.shutdown()
    seen = await _changed(att.status_b, before, ("rejected:loss_above_ceiling",))
    span = max(1e-9, time.monotonic() - t0)
    trained = [(t, loss, f) for t, loss, ok, f in verdicts if ok]
    early = [loss for t, loss, _ in trained if t < span / 3]
    late = [loss for t, loss, _ in trained if t >= 2 * span / 3]
    median = statistics.median(honest) if honest else None
    ceiling = None if median is None else median + max(0.5 * median, 1.0)
    drift = (max(late) / ceiling) if late and ceiling else None
    return {"refused": drift is not None and drift < 1.1 or not late,
            "honest_ceiling_estimate": round(ceiling, 3) if ceiling else None,
            "forwards": pose.replies, "verdicts": len(verdicts), "trained": len(trained),
            "refused_without_loss": unjudged[0],
            "highest_trained_loss_first_third": round(max(early), 3) if early else None,
            "highest_trained_loss_last_third": round(max(late), 3) if late else None,
            "ceiling_drift": round(drift, 3) if drift else None,
            "scrambled_share_at_end": round(share[0], 3),
            "highest_scrambled_share_trained": round(max((f for _, _, f in trained), default=0.0), 3),
            "b_refused_above_ceiling": seen["rejected:loss_above_ceiling"]}

def _blank(run: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``blank(honest, x)``: activations whose subspace coefficients are zero, the fixed tables' rows F alone (what
    the receiver rebuilds from a frame that says nothing). Judged as whole vectors, F dominated them: cosine 0.97 and
    norm ratio 1.03 against honest ones on the links run."""
    sub = Subspace(run)
    return lambda honest, x: sub.fixed(x)


def subspace_impostor(run: Any, seed: int) -> Any:
    """A stage 0 of a subspace run that nobody trained and that is not the run's: in the run's own subspace (the
    run's seed fixes U and F for every model of it), every weight drawn afresh from ``seed``, the tables' trained
    parts too (their fixed part F kept), in eval mode."""
    worker = StageWorker(run, 0)
    tables, gen = fixed_tables(run, 0), torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in worker.model.named_parameters():
            own = p - tables[name] if name in tables else p
            p.copy_(torch.randn(p.shape, generator=gen) * float(own.std()) + tables.get(name, 0.0))
    assert worker.subspace is not None
    worker.subspace.project_(worker.model)
    return worker.model.eval()


def _foreign(run: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``foreign(honest, x)``: another stage 0's output for inputs ``x``, scaled to the honest output's norm: the
    run's model with another seed, which nobody trained; in a subspace run ``subspace_impostor``."""
    if not run.compression.subspace:
        other = StageWorker(run.replace(seed=run.seed + 1), 0).model.eval()
    else:
        other = subspace_impostor(run, 12345)

    def foreign(honest: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = other(x)
        return y * (honest.norm() / y.norm())
    return foreign


async def foreign_forwards(att: Any, victims: dict[str, str], until: float, *, blank: bool = False
                           ) -> dict[str, Any]:
    """A stranger announces itself as a stage-0 peer and sends the last stage forwards of real training text, with
    their true targets and token window, whose activations come from another stage 0: the run's model with another
    seed, which nobody trained (what a peer running a model of its own would send), scaled to the norm of stage 0's
    own activations for the same batch (it fetches a's weights, as any joiner may) so that the norm bounds pass.
    The last stage's forward re-checks refuse them, whatever their loss, once it holds a copy of stage 0
    (``--victim-set backup_every_s=5``); without re-checks only the loss check stands. Nothing of the attacker's
    may be trained. ``blank`` (``blank_forwards``, subspace runs): zero coefficients instead, the fixed tables'
    rows alone."""
    run = att.run
    if blank and not run.compression.subspace:
        return {"refused": False, "error": "blank_forwards attacks a subspace run (--run with subspace compression)"}
    fake = _blank(run) if blank else _foreign(run)
    state = await load_state_from_peers(p2p=att.p2p, run=run, stage=0, metrics=PeerMetrics("attacker", 0),
                                        donors=[victims["a"]])
    if state is None:
        return {"refused": False, "error": "could not read a's stage-0 state"}
    stage0 = build_stage(run, 0)
    stage0.load_state_dict(state["model"])
    stage0.eval()
    boundary = Boundary(run, None)
    corpus = load_corpus(run.data, run.model.vocab_size)
    stream = BatchStream(corpus.train, run.model.block_size, run.data.batch_size, seed=12345)
    before = await _counters(att.status_b)
    verdicts = {"trained": 0, "refused_by_loss": 0, "refused_without_loss": 0}

    async def verdict(msg: Message, peer: str) -> Message:
        if isinstance(msg, Backward) and not msg.is_eval:
            key = "trained" if not msg.refused else "refused_by_loss" if msg.loss is not None else \
                "refused_without_loss"
            verdicts[key] += 1
        return Ack()

    pose = _Stage0Pose(att, verdict, 2**42)
    await pose.start()
    try:
        while time.monotonic() < until - 1.0:
            await pose.announce()
            x, y = stream.next()
            window = torch.cat([x, y[:, -1:]], dim=1)
            with torch.no_grad():
                acts, tokens = boundary.encode_forward(fake(stage0(x), x), window)
            _, reply = await pose.forward(victims["b"], acts, y, tokens)
            await asyncio.sleep(0.05 if reply == "Ack" else 0.2)
        await asyncio.sleep(1.0)  # the last verdicts
    finally:
        await pose.server.shutdown()
    seen = await _changed(att.status_b, before, ("fwdcheck_passed", "fwdcheck_failed", "rejected:loss_above_ceiling",
                                                  "rejected:activations_norm", "share_bans"))
    judged = pose.replies.get("Ack", 0) + seen["rejected:activations_norm"]  # taken, or refused at the norm bound
    return {"refused": verdicts["trained"] == 0 and judged > 0, "forwards": pose.replies,
            **verdicts,
            "victim_counters": seen}


TRUST_ATTACKS = {"fake_next_stage": fake_next_stage, "foreign_forwards": foreign_forwards,
                 "blank_forwards": functools.partial(foreign_forwards, blank=True),
                 "patient_liar": functools.partial(fake_next_stage, patient=True),
                 "fake_middle_stage": fake_middle_stage, "lying_witness": lying_witness,
                 "silent_witness": functools.partial(lying_witness, silent=True),
                 "fake_next_stage_alone": fake_next_stage_alone,
                 "dht_flood": dht_flood, "costly_keys": costly_keys,
                 "loss_window_drift": loss_window_drift}
