"""Red-team attacks on the pipeline's and the DHT's trust, registered in ``tools/redteam.py``'s ``ATTACKS``.

Each attack has the signature of the others there: ``attack(att, victims, until) -> evidence`` with ``att`` the
red team's ``Attacker`` (its DHT node ``att.dht``, libp2p ``att.p2p``, signer ``att.signer``, run ``att.run``, the
victims' /status readers ``att.status_a`` / ``att.status_b``), ``victims`` the peer ids of the stage-0 peer ("a")
and the stage-1 peer ("b"), and ``until`` the end of the phase (``time.monotonic()``). The evidence holds
``refused``: whether the victims refused what the attack needed.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from peer.membership.records import PeerRecord, announce
from protocol.codecs.registry import decode, encode
from protocol.limits import RpcLimits
from protocol.messages import Ack, Backward, Busy, Forward, Message
from protocol.rpc import RpcServer, call
from protocol.validation import TensorSpec
from trainer.worker import StageWorker

SCALES = (1.0, 4.0, 0.25, 16.0, 1 / 16, 64.0, 1 / 64, 256.0, 1 / 256)


async def _counters(status: Any) -> dict[str, float]:
    return ((await asyncio.to_thread(status)) or {}).get("counters", {})


async def fake_next_stage(att: Any, victims: dict[str, str], until: float) -> dict[str, Any]:
    """A stranger announces itself as a stage-1 replica with throughput 1e9, acks every training forward at once and
    returns within milliseconds the negation of the gradient its own (untrained) stage-1 copy computes: a gradient
    of the right shape that trains stage 0 the wrong way, with a plausible loss (the honest stage-1 peer's latest).
    It learns the norm stage 0 accepts from its replies: a gradient refused for its norm makes it try the next scale
    of ``SCALES`` until one passes.
    Evaluation forwards are answered Busy (they go to the honest peer). Stage 0 must not train on its gradients."""
    run = att.run
    before = await _counters(att.status_a)
    worker = StageWorker(run, 1)
    b, t, d = run.data.batch_size, run.model.block_size, run.model.n_embd
    act, tok = TensorSpec((b, t, d), torch.float32), TensorSpec((b, t), torch.int64)
    server = RpcServer(att.p2p, RpcLimits())
    taken = sent = 0
    loss_seen, scale = [2.5], [0]
    tasks: set[asyncio.Task] = set()

    async def answer(peer: str, msg: Forward) -> None:
        nonlocal sent
        x, targets = decode(msg.activations, act), decode(msg.targets, tok)
        _, grad = worker.forward_loss(msg.mb_id, x, targets)
        fake = -grad * SCALES[scale[0]]
        reply = Backward(run_id=run.run_id, mb_id=msg.mb_id, route=msg.route, gradient=encode(fake, "int8"),
                         loss=loss_seen[0], is_eval=False)
        try:
            await call(att.p2p, peer, "backward", reply, timeout=5)
            sent += 1
        except Exception as e:  # refused: the victim's verdict is in its counters
            if "norm" in str(e):
                scale[0] = (scale[0] + 1) % len(SCALES)

    async def take(msg: Message, peer: str) -> Message:
        nonlocal taken
        if not isinstance(msg, Forward) or msg.is_eval or msg.targets is None:
            return Busy(retry_after_s=0.0)
        taken += 1
        task = asyncio.ensure_future(answer(peer, msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return Ack()

    await server.add_handler("forward", take)
    rec = PeerRecord(peer_id=att.signer.peer_id, stage=1, throughput=1e9, queue=0, version=0, state="training",
                     maddrs=[])
    try:
        while time.monotonic() < until:
            await announce(att.dht, run.run_id, rec, 4.0, signer=att.signer)
            loss = ((await asyncio.to_thread(att.status_b)) or {}).get("train_loss")
            loss_seen[0] = float(loss) if loss else loss_seen[0]
            await asyncio.sleep(1.0)
    finally:
        await server.shutdown()
        for task in list(tasks):
            task.cancel()
    after = await _counters(att.status_a)
    seen = {k: int(after.get(k, 0) - before.get(k, 0)) for k in (
        "spotcheck_sent", "spotcheck_passed", "spotcheck_failed", "spotcheck_banned", "spotcheck_unavailable",
        "rejected:gradients_norm", "relearnt:gradients_norm")}
    return {"refused": seen["spotcheck_banned"] >= 1, "forwards_taken": taken, "fabricated_gradients_delivered": sent,
            "scale_used": SCALES[scale[0]], "stage0_counters": seen}


TRUST_ATTACKS = {"fake_next_stage": fake_next_stage}
