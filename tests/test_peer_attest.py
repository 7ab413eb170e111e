"""Signed pipeline frames (peer/pipeline/attest.py): who lied in a testimony, told from signatures alone, and the hop's
side of a proven lie (``PipelineServicer.rpc_fraud``) and of an unsigned frame."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from pathlib import Path

import pytest
import torch

from peer.config import PeerConfig
from peer.membership.records import PeerRecord
from peer.membership.routing import Router
from peer.membership.signing import Signer
from peer.ops.metrics import PeerMetrics
from peer.pipeline import attest
from peer.pipeline.attest import KeyNotary, Verdict
from peer.pipeline.servicer import LIAR_BAN_S, PipelineServicer
from peer.pipeline.work import Pending
from protocol.codecs.registry import decode, encode
from protocol.errors import ErrorCode
from protocol.messages import Ack, Backward, Error, Forward, Fraud, Testimony, pack, unpack
from trainer.config import RunConfig
from trainer.worker import StageWorker

pytestmark = pytest.mark.timeout(60)

RUN3 = RunConfig.from_toml(Path(__file__).parent / "runs" / "tiny3.toml")
A, B, C = (Signer.generate() for _ in range(3))  # stage 0, the hop (stage 1), the witness (stage 2)
NA, NB, NC = KeyNotary(A), KeyNotary(B), KeyNotary(C)
WID = 41


def _frames(x: torch.Tensor | None = None, g: torch.Tensor | None = None) -> tuple[Forward, Backward, list[bytes]]:
    """The hop's signed forward to the witness, the witness's signed gradient back, and what the hop relays of it."""
    b, t, d = RUN3.data.batch_size, RUN3.model.block_size, RUN3.model.n_embd
    x = torch.randn(b, t, d) if x is None else x
    g = torch.randn(b, t, d) if g is None else g
    fwd, answers = attest.signed_frame(NB, Forward(run_id=RUN3.run_id, mb_id=WID, route=[A.peer_id, B.peer_id],
                                                   activations=encode(x, "int8"), targets=None, is_eval=False,
                                                   sent_at=time.time()), B.peer_id)
    assert answers == attest.digest(fwd)
    bwd = attest.sign(NC, Backward(run_id=RUN3.run_id, mb_id=WID, route=[A.peer_id, B.peer_id],
                                   gradient=encode(g, "int8"), loss=2.5, is_eval=False), C.peer_id, B.peer_id, answers)
    digest = attest.signed_by(NB, bwd, C.peer_id, B.peer_id, answers)
    assert digest is not None
    return fwd, bwd, attest.relay(bwd, digest, answers)


def _judge(testimony: Testimony, relayed: list[bytes] | None, notary: attest.Notary = NA,
           by: str | None = None) -> attest.Judged:
    return attest.judge(notary, testimony, run_id=RUN3.run_id, hop=B.peer_id, witness=C.peer_id, mb_id=WID,
                        relayed=relayed, by=by)


def test_a_signed_frame_verifies_only_as_sent_by_its_sender_to_its_recipient():
    fwd, bwd, _ = _frames()
    assert attest.signed_by(NA, fwd, B.peer_id) == attest.digest(fwd)
    assert attest.signed_by(NA, fwd, C.peer_id) is None  # someone else's key
    assert attest.signed_by(NA, dataclasses.replace(fwd, mb_id=WID + 1), B.peer_id) is None
    assert attest.signed_by(NA, dataclasses.replace(fwd, route=[C.peer_id, B.peer_id]), B.peer_id) is None
    other = encode(decode(fwd.activations) + 1.0, "int8")
    assert attest.signed_by(NA, dataclasses.replace(fwd, activations=other), B.peer_id) is None
    assert attest.signed_by(NA, dataclasses.replace(fwd, signer=None, signature=None), B.peer_id) is None
    assert attest.signed_by(NA, dataclasses.replace(fwd, signer=C.public_key), B.peer_id) is None
    answers = attest.digest(fwd)
    assert attest.signed_by(NA, bwd, C.peer_id, B.peer_id, answers) is not None
    assert attest.signed_by(NA, bwd, C.peer_id, A.peer_id, answers) is None  # signed to the peer it went to
    assert attest.signed_by(NA, bwd, C.peer_id, B.peer_id) is None  # ... answering the forward it names
    assert attest.signed_by(NA, bwd, C.peer_id, B.peer_id, attest.digest(_frames()[0])) is None
    assert attest.signed_by(NA, unpack(pack(bwd)), C.peer_id, B.peer_id, answers) == attest.digest(bwd)  # wire


def test_judge_tells_an_honest_testimony_from_a_lying_witness_and_a_lying_hop():
    x = torch.randn(RUN3.data.batch_size, RUN3.model.block_size, RUN3.model.n_embd)
    fwd, bwd, relayed = _frames(x)
    honest = attest.testify(NC, C.peer_id, B.peer_id, fwd, bwd)
    judged = _judge(honest, relayed)
    assert judged.verdict is Verdict.OK and judged.forward == fwd and judged.backward == bwd

    # the witness testifies activations the hop never sent, under the hop's signature
    forged = dataclasses.replace(fwd, activations=encode(x * 0.5, "int8"))
    assert _judge(attest.testify(NC, C.peer_id, B.peer_id, forged, bwd), relayed).verdict is Verdict.WITNESS_LIED
    # ... or another gradient than it returned, signed anew by itself
    other = attest.sign(NC, dataclasses.replace(bwd, gradient=encode(-decode(bwd.gradient), "int8"), signer=None,
                                                signature=None), C.peer_id, B.peer_id)
    assert _judge(attest.testify(NC, C.peer_id, B.peer_id, fwd, other), relayed).verdict is Verdict.WITNESS_LIED
    # ... or frames of another micro-batch of the hop
    _, bwd2, relayed2 = _frames()
    moved = attest.sign(NB, dataclasses.replace(fwd, mb_id=WID + 1, signer=None, signature=None), B.peer_id)
    assert _judge(attest.testify(NC, C.peer_id, B.peer_id, moved, bwd), relayed).verdict is Verdict.WITNESS_LIED
    # the hop relays a signature the witness never made, or one of another gradient: the hop's lie
    assert _judge(honest, [relayed[0], relayed[1], relayed[2][:-1] + b"x", relayed[3]]).verdict is Verdict.HOP_LIED
    assert _judge(honest, None).verdict is Verdict.HOP_LIED
    assert _judge(honest, [relayed[0], relayed[1], relayed[2], A.public_key]).verdict is Verdict.HOP_LIED
    assert _judge(honest, [relayed[0], attest.digest(moved), *relayed[2:]]).verdict is Verdict.HOP_LIED
    assert _judge(honest, relayed[:3]).verdict is Verdict.HOP_LIED
    assert _judge(honest, relayed2).verdict is Verdict.WITNESS_LIED  # a true signature of another micro-batch
    # a testimony the witness did not sign proves nothing about anybody
    unsigned = dataclasses.replace(honest, signature=honest.signature[:-1] + b"x")
    assert _judge(unsigned, relayed).verdict is Verdict.UNUSABLE
    by_another = attest.testify(NA, A.peer_id, B.peer_id, fwd, bwd)
    assert _judge(by_another, relayed).verdict is Verdict.UNUSABLE


def test_the_hops_own_record_is_bound_by_its_witness_signature():
    """A silent witness's place is taken by the hop's own record of the two frames: the witness signed the digest of
    the forward it received with its gradient, so a record with other activations, or another gradient, is the
    hop's provable lie, and the witness's signature counts for nothing there."""
    x = torch.randn(RUN3.data.batch_size, RUN3.model.block_size, RUN3.model.n_embd)
    fwd, bwd, relayed = _frames(x)
    record = attest.testify(NB, C.peer_id, B.peer_id, fwd, bwd, by=B.peer_id)
    judged = _judge(record, relayed, by=B.peer_id)
    assert judged.verdict is Verdict.OK and judged.forward == fwd and judged.backward == bwd
    # activations the hop computes for the check, honest-looking, signed anew: not what the witness received
    recomputed = attest.sign(NB, dataclasses.replace(fwd, activations=encode(x * 0.5, "int8"), signer=None,
                                                     signature=None), B.peer_id)
    lie = attest.testify(NB, C.peer_id, B.peer_id, recomputed, bwd, by=B.peer_id)
    assert _judge(lie, relayed, by=B.peer_id).verdict is Verdict.HOP_LIED
    # another gradient than the witness returned (the hop cannot sign as the witness)
    _, bwd2, _ = _frames(x)
    assert _judge(attest.testify(NB, C.peer_id, B.peer_id, fwd, bwd2, by=B.peer_id), relayed,
                  by=B.peer_id).verdict is Verdict.HOP_LIED
    # a record signed by the witness, or a witness's testimony passed off as the hop's record, proves nothing
    witness_signed = attest.testify(NC, C.peer_id, B.peer_id, fwd, bwd)
    assert _judge(witness_signed, relayed, by=B.peer_id).verdict is Verdict.UNUSABLE
    assert _judge(record, relayed).verdict is Verdict.UNUSABLE


def test_a_witness_and_a_hop_answer_from_their_own_sides_of_the_store():
    from peer.pipeline.testimony import TestimonyStore
    from protocol.messages import TestimonyRequest

    fwd, bwd, relayed = _frames()
    counts: dict[str, int] = {}

    def count(name: str, n: int) -> None:
        counts[name] = counts.get(name, 0) + n
    witness = TestimonyStore(run_id=RUN3.run_id, stage=2, my_id=C.peer_id, notary=NC, count=count)
    hop = TestimonyStore(run_id=RUN3.run_id, stage=1, my_id=B.peer_id, notary=NB, count=count)
    witness.received(B.peer_id, fwd)
    witness.returned(B.peer_id, bwd)
    hop.sent(C.peer_id, fwd, bwd)

    async def go() -> list:
        return [await witness.rpc_testimony(TestimonyRequest(run_id=RUN3.run_id, sender=B.peer_id, mb_id=WID),
                                            A.peer_id),
                await hop.rpc_testimony(TestimonyRequest(run_id=RUN3.run_id, sender=C.peer_id, mb_id=WID,
                                                         outgoing=True), A.peer_id),
                # each side answers only for its own role
                await hop.rpc_testimony(TestimonyRequest(run_id=RUN3.run_id, sender=C.peer_id, mb_id=WID),
                                        A.peer_id),
                await witness.rpc_testimony(TestimonyRequest(run_id=RUN3.run_id, sender=B.peer_id, mb_id=WID,
                                                             outgoing=True), A.peer_id)]
    by_witness, by_hop, *missing = asyncio.run(go())
    assert _judge(by_witness, relayed).verdict is Verdict.OK
    assert _judge(by_hop, relayed, by=B.peer_id).verdict is Verdict.OK
    assert all(isinstance(m, Error) and m.code == ErrorCode.NOT_FOUND for m in missing), missing
    assert counts == {"testimony_served": 2, "testimony_not_found": 2}


def _hop() -> PipelineServicer:
    """Stage 1 of three (B), with the witness C announced as a stage-2 peer."""
    records = {p.peer_id: PeerRecord(peer_id=p.peer_id, stage=s, throughput=1.0, queue=0, version=0,
                                     state="training") for s, p in enumerate((A, B, C))}
    return PipelineServicer(run=RUN3, stage=1, worker=StageWorker(RUN3, 1), compute=None, send=None,
                            swarm=lambda: records, router=Router([1.0] * 3, rng=random.Random(0)),
                            metrics=PeerMetrics("b", 1), cfg=PeerConfig(), my_id=B.peer_id, cost=1.0, notary=NB)


def test_the_hop_bans_a_witness_only_on_a_proof_it_checks_itself():
    fwd, bwd, relayed = _frames()
    hop = _hop()
    honest = attest.testify(NC, C.peer_id, B.peer_id, fwd, bwd)
    forged = attest.testify(NC, C.peer_id, B.peer_id, dataclasses.replace(
        fwd, activations=encode(decode(fwd.activations) * 2.0, "int8")), bwd)

    def fraud(testimony: Testimony | bytes, relay: list[bytes] = relayed) -> Fraud:
        raw = testimony if isinstance(testimony, bytes) else pack(testimony)
        return Fraud(run_id=RUN3.run_id, witness=C.peer_id, mb_id=WID, testimony=raw, relayed=relay)

    async def go() -> list:
        refused = [await hop.rpc_fraud(fraud(honest), A.peer_id),  # a true testimony is no lie
                   await hop.rpc_fraud(fraud(b"\x93\x0b\x12\x90"), A.peer_id),  # not a testimony
                   await hop.rpc_fraud(fraud(pack(Ack())), A.peer_id)]
        banned_early = hop.router.penalised(C.peer_id, 0.0)
        ok = await hop.rpc_fraud(fraud(forged), A.peer_id)
        limited = [await hop.rpc_fraud(fraud(forged), A.peer_id) for _ in range(10)]
        return [refused, banned_early, ok, limited]
    refused, banned_early, ok, limited = asyncio.run(go())
    assert all(isinstance(r, Error) and r.code == ErrorCode.BAD_REQUEST for r in refused), refused
    assert not banned_early
    assert isinstance(ok, Ack) and hop.router.penalised(C.peer_id, LIAR_BAN_S - 60)
    assert any(isinstance(r, Error) and r.code == ErrorCode.RATE_LIMITED for r in limited)
    counters = hop.metrics.snapshot()["counters"]
    assert counters["liars_banned"] == 1 and counters["rejected:bad_fraud"] == 3, counters


def test_a_middle_stage_refuses_an_unsigned_gradient_and_relays_a_signed_one():
    hop = _hop()
    fwd, bwd, relayed = _frames()
    hop.pending[WID] = Pending(prev_peer=A.peer_id, next_peer=C.peer_id, route=[A.peer_id],
                               deadline=time.monotonic() + 30, sent_to={C.peer_id}, sent=(fwd, attest.digest(fwd)))
    unsigned = dataclasses.replace(bwd, signer=None, signature=None)
    other_fwd, _, _ = _frames()  # a gradient the witness signed for a forward other than the one we sent it
    elsewhere = attest.sign(NC, dataclasses.replace(bwd, signer=None, signature=None), C.peer_id, B.peer_id,
                            attest.digest(other_fwd))

    async def go() -> tuple:
        refused = await hop.rpc_backward(unsigned, C.peer_id)
        forged = await hop.rpc_backward(dataclasses.replace(bwd, loss=0.1), C.peer_id)  # changed after signing
        answers_other = await hop.rpc_backward(elsewhere, C.peer_id)
        return refused, forged, answers_other, await hop.rpc_backward(bwd, C.peer_id)
    refused, forged, answers_other, ok = asyncio.run(go())
    for r in (refused, forged, answers_other):
        assert isinstance(r, Error) and r.code == ErrorCode.BAD_REQUEST, r
    assert isinstance(ok, Ack) and hop.pending[WID].relayed[C.peer_id] == relayed
    assert hop.metrics.snapshot()["counters"]["rejected:unsigned"] == 3
    # the hop keeps both frames in its own record (for a re-check whose witness is silent)
    assert hop.testimony is not None and hop.testimony._kept[(True, C.peer_id, WID)][:2] == (fwd, bwd)


def test_a_stage_from_2_on_refuses_an_unsigned_training_forward():
    records = {p.peer_id: PeerRecord(peer_id=p.peer_id, stage=s, throughput=1.0, queue=0, version=0,
                                     state="training") for s, p in enumerate((A, B, C))}
    witness = PipelineServicer(run=RUN3, stage=2, worker=StageWorker(RUN3, 2), compute=None, send=None,
                               swarm=lambda: records, router=Router([1.0] * 3, rng=random.Random(0)),
                               metrics=PeerMetrics("c", 2), cfg=PeerConfig(), my_id=C.peer_id, cost=1.0, notary=NC)
    fwd, _, _ = _frames()
    targets = encode(torch.zeros(RUN3.data.batch_size, RUN3.model.block_size, dtype=torch.int64), "none")
    fwd = attest.sign(NB, dataclasses.replace(fwd, targets=targets, signer=None, signature=None), B.peer_id)

    async def go() -> tuple:
        refused = await witness.rpc_forward(dataclasses.replace(fwd, signer=None, signature=None), B.peer_id)
        by_another = await witness.rpc_forward(attest.sign(NA, dataclasses.replace(fwd, signer=None, signature=None),
                                                           A.peer_id), B.peer_id)
        return refused, by_another, await witness.rpc_forward(fwd, B.peer_id)
    refused, by_another, ok = asyncio.run(go())
    assert isinstance(refused, Error) and isinstance(by_another, Error), (refused, by_another)
    assert isinstance(ok, Ack), ok
    assert witness.metrics.snapshot()["counters"]["rejected:unsigned"] == 2
    assert witness.testimony is not None and (False, B.peer_id, WID) in witness.testimony._kept
    assert witness.pending[WID].answers == attest.digest(fwd)  # its gradient will be signed over this forward
