"""Re-checks of a middle stage: the stage before it re-computes its work, and the stage after it testifies.

A stage re-checks its next stage from the copy of it it holds (``peer.pipeline.recheck``), but where the next stage
is not the last, neither half of its work can be judged from what the re-checking stage has: it knows the input it
sent, not the gradient the stage after returned to it, nor what the hop sent on. The peer the hop sent the
micro-batch to can say both. So a middle stage names that peer and the id it used in every training gradient it
returns (``Backward.downstream``, ``downstream_id``), and for a sampled micro-batch the re-checking stage asks that
peer for a few rows of what it received and returned (``TestimonyRequest``). With the copy it then re-computes the
hop's output from its own input rows, and the hop's input gradient from the witness's gradient rows, and compares
both with what the hop delivered. A transformer stage adds to its input (the residual stream), so each comparison is
of what the stage added: (received - input) against (copy's output - input), and (returned gradient - witness's
gradient) against (copy's input gradient - witness's gradient); a hop that passes its input on untouched, or its
gradient back, agrees with nothing.

What it catches: a hop that fabricates the gradient it returns, sends on activations it did not compute, or names no
peer, itself, or a peer that never trained the micro-batch. Every frame of a testimony is signed by its sender, and
the gradient the witness returned is signed together with the digest of the forward it answers
(``peer.pipeline.attest``), so a witness that lies about an honest hop contradicts its own signature: the micro-batch
is dropped unjudged and the hop is shown the proof. A witness that is silent, says it holds no such micro-batch, or
lies, is replaced by the hop's own record of the two frames (``TestimonyRequest.outgoing``): the witness's relayed
signature binds it as tightly, and a record that contradicts it fails the hop. What it does not catch: a hop and a
witness of the next stage that collude (two identities on two stages, signing whatever they agree on). A micro-batch
neither the witness nor the hop answers for is left unjudged: it is dropped (stage 0 re-sends its sample), counted
``recheck_unavailable``, and every ``UNHEARD_STRIKE``-th in a row from one hop counts as a failed re-check: a hop
that names a silent identity of the next stage and keeps no record must not have its work trained unjudged, nor go on
forever.

``TestimonyStore`` keeps both sides: as a witness, the last forwards it received from each peer and the gradients it
returned for them; as a middle stage, the forwards it sent on and the gradients it got back. Bounded in count and
bytes, answered to any peer within a rate limit (the rows are training activations any peer of an open run sees
anyway; a request costs one signature).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from peer.ids import short_id
from peer.pipeline.attest import FRAUD_RPC, Verdict, judge, relayed_ok, testify
from peer.pipeline.recheck import Rechecks, judgeable
from peer.pipeline.work import BackwardWork
from protocol.errors import ErrorCode, ProtocolError
from protocol.limits import PeerBudgets
from protocol.messages import (
    Ack,
    Backward,
    Error,
    Forward,
    Fraud,
    Message,
    Testimony,
    TestimonyRequest,
    pack,
    payload_bytes,
)

if TYPE_CHECKING:
    from peer.pipeline.attest import Notary
    from peer.pipeline.boundary import Boundary
    from peer.pipeline.work import Pending
    from peer.seams import Send
    from trainer.model import StageBase

logger = logging.getLogger(__name__)

TESTIMONY_RPC = "testimony"
#: micro-batches a witness remembers, and the bytes of their encoded activations and gradients at most
MAX_KEPT = 256
MAX_KEPT_BYTES = 64 * 2**20
#: testimonies one peer may ask for per second (burst: twice that); a re-checking stage asks for every micro-batch
#: of an untrusted hop (a few in a row), then for a sample
TESTIMONY_RATE = 20.0


class TestimonyStore:
    """What this stage received from each peer and returned to it, for the stage two before to ask about, and (a
    middle stage) what it sent each peer of the next stage and got back, for the stage before to ask when that peer
    is silent: the frames as they crossed the wire, signed by their senders (``peer.pipeline.attest``).

    Args:
        stage: the stage this peer serves.
        notary: signs our testimonies.
        count: ``count(name, n)`` the peer's counters.
    """

    def __init__(self, *, run_id: str, stage: int, my_id: str, notary: Notary, count: Callable[[str, int], None],
                 max_kept: int = MAX_KEPT, max_bytes: int = MAX_KEPT_BYTES) -> None:
        self.run_id, self.stage, self.my_id, self.notary, self.count = run_id, stage, my_id, notary, count
        self.max_kept, self.max_bytes = max_kept, max_bytes
        # (outgoing, the other peer, the sender's id) -> (forward, its gradient or None yet, bytes); both roles share
        # the bounds
        self._kept: OrderedDict[tuple[bool, str, int], tuple[Forward, Backward | None, int]] = OrderedDict()
        self._bytes = 0
        self._budget = PeerBudgets(rate=TESTIMONY_RATE, burst=int(2 * TESTIMONY_RATE))

    def received(self, sender: str, msg: Forward) -> None:
        """A signed training forward from ``sender`` was accepted (kept until its gradient is returned, or
        evicted)."""
        self._put((False, sender, msg.mb_id), msg, None, payload_bytes(msg))

    def returned(self, sender: str, msg: Backward) -> None:
        """The signed gradient ``msg`` of ``sender``'s micro-batch went back to it."""
        kept = self._kept.get((False, sender, msg.mb_id))
        if kept is not None and kept[1] is None:
            self._put((False, sender, msg.mb_id), kept[0], msg, kept[2] + payload_bytes(msg))

    def sent(self, witness: str, msg: Forward, gradient: Backward) -> None:
        """We sent ``msg`` to ``witness`` and it returned ``gradient``, signed over it (our own record)."""
        self._put((True, witness, msg.mb_id), msg, gradient, payload_bytes(msg) + payload_bytes(gradient))

    def _put(self, key: tuple[bool, str, int], msg: Forward, gradient: Backward | None, size: int) -> None:
        old = self._kept.pop(key, None)
        if old is not None:
            self._bytes -= old[2]
        self._kept[key] = (msg, gradient, size)
        self._bytes += size
        while self._kept and (len(self._kept) > self.max_kept or self._bytes > self.max_bytes):
            self._bytes -= self._kept.popitem(last=False)[1][2]

    async def rpc_testimony(self, msg: Message, peer_id: str) -> Message:
        if not isinstance(msg, TestimonyRequest) or msg.run_id != self.run_id:
            self.count("rejected:bad_request", 1)
            return Error(code=ErrorCode.BAD_REQUEST, message="testimony: expected a TestimonyRequest of this run")
        if self._budget.empty(peer_id):
            self.count("rejected:testimony_rate_limited", 1)
            return Error(code=ErrorCode.RATE_LIMITED, message=f"testimony: at most {TESTIMONY_RATE:.0f} per second")
        self._budget.spend(peer_id)
        kept = self._kept.get((msg.outgoing, msg.sender, msg.mb_id))
        if kept is None or kept[1] is None:
            self.count("testimony_not_found", 1)
            return Error(code=ErrorCode.NOT_FOUND, message=f"no trained micro-batch {msg.mb_id} "
                         f"{'sent to' if msg.outgoing else 'from'} that peer here")
        # received: we are the witness of the sender's micro-batch; outgoing: we are the hop, the peer asked about
        # is our witness
        witness, hop = (msg.sender, self.my_id) if msg.outgoing else (self.my_id, msg.sender)
        reply = await asyncio.get_running_loop().run_in_executor(None, functools.partial(
            testify, self.notary, witness, hop, kept[0], kept[1], by=self.my_id))
        self.count("testimony_served", 1)
        return reply


def middle_reference(module: StageBase, x: torch.Tensor, g_out: torch.Tensor, *,
                     bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A middle stage's output for input rows ``x`` [r, T, d] and its input gradient for output gradient ``g_out``
    (same shape), at ``module``'s weights (fp32, on the CPU)."""
    device = next(module.parameters()).device
    xr = x.detach().to(device, torch.float32).requires_grad_(True)
    with torch.enable_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        y = module(xr)
    (g,) = torch.autograd.grad(y.float(), [xr], grad_outputs=g_out.to(device, torch.float32))
    return y.detach().float().cpu(), g.float().cpu()


def as_carried(boundary: Boundary, t: torch.Tensor, ids: torch.Tensor | None = None, *,
               gradient: bool = False) -> torch.Tensor:
    """Activation rows (``ids``: their input ids) or gradient rows as far as the wire can carry them: projected into
    the run's subspace where it has one, else as they are. The codec's rounding is left out: it is noise that would
    only blur the comparison (``along``)."""
    sub = boundary.subspace
    if sub is None:
        return t.cpu()
    if gradient:
        return sub.grad_rebuild(sub.grad_coefficients(t.cpu())).cpu()
    assert ids is not None  # subspace runs' forwards carry their window
    return sub.rebuild(sub.coefficients(t.cpu(), ids), ids).cpu()


Agreement = tuple[float, float]  # (share of the copy's change carried, norm ratio)


def along(delivered: torch.Tensor, expected: torch.Tensor) -> Agreement:
    """How much of the change ``expected`` (the copy's) the change ``delivered`` carries, <d, e> / |e|^2 (1 when
    they agree, 0 for a change orthogonal to it or none, -1 negated), and the ratio of the larger norm to the smaller;
    a zero or non-finite change gives (-1, inf).

    Not a cosine: the codec's rounding adds noise of a fixed size to what a hop delivers, which can exceed what a
    middle stage adds to a gradient that is mostly the residual stream's (the tiny run: the stage's part 5 % of the
    gradient, int8's rounding 9 %), and a cosine then falls to the noise's level for honest and lazy hops alike. The
    noise is spread over every coordinate, so its projection on the copy's change is that small share only."""
    d, e = delivered.float().flatten(), expected.float().flatten()
    nd, ne = float(torch.linalg.vector_norm(d)), float(torch.linalg.vector_norm(e))
    if not (nd > 0 and ne > 0 and nd < float("inf") and ne < float("inf")):
        return -1.0, float("inf")
    return float(torch.dot(d, e)) / (ne * ne), max(nd, ne) / min(nd, ne)


def middle_agreement(x: torch.Tensor, received: torch.Tensor, copy_out: torch.Tensor, g_out: torch.Tensor,
                     returned: torch.Tensor, copy_grad: torch.Tensor) -> tuple[Agreement, Agreement]:
    """(``along`` of what the stage added to the activations, the same of what it added to the gradient):
    ``received`` (the witness's rows) against ``copy_out`` over input ``x``; ``returned`` (the hop's gradient rows)
    against ``copy_grad`` over the witness's ``g_out``."""
    return along(received - x, copy_out - x), along(returned - g_out, copy_grad - g_out)


#: a middle stage is judged only from a copy first seen at a third of our current step or later: what a middle stage
#: adds drifts from an older copy's faster than a last stage's gradient does (the tiny run: honest cosines as low as
#: -0.13 against copies 1,950 steps old, at least 0.21 within this bound; docs/security.md)
MAX_COPY_GROWTH = 3.0
#: ... and first seen once our step reached this many times the run's warm-up steps: the tiny run's honest middle
#: stage failed 34 of 248 checks against copies of steps 40-79 (4-8 x its warm-up), none of 1,872 against later ones
MIN_COPY_WARMUPS = 8
#: re-checks of one hop left unjudged in a row (a witness it named did not answer) that count as one failed re-check
UNHEARD_STRIKE = 4
#: proven lies kept (hop, witness), and the sends of one proof to a hop that does not answer before it counts as shown
MAX_PROOFS = 4096
TELL_TRIES = 3


class MiddleRechecks(Rechecks):
    """``Rechecks`` of a next stage that is not the last: its work is judged with a witness's testimony (above), from
    a copy recent enough (``MAX_COPY_GROWTH``; else the hop is treated as when no copy is held).

    Args (beyond ``Rechecks``'):
        send: ``await send(peer, name, msg)`` one RPC.
    """

    def __init__(self, *args: Any, send: Send, notary: Notary | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.send, self.notary = send, notary
        self._unheard: dict[str, int] = {}  # hop -> re-checks left unjudged in a row (its witnesses were silent)
        # (hop, witness) -> the witness's proven lie about the hop; when the hop was shown it; attempts to show it
        self._proofs: OrderedDict[tuple[str, str], Fraud] = OrderedDict()
        self._told: dict[tuple[str, str], tuple[float, int]] = {}  # when, and the hop's restarts seen then
        self._tries: dict[tuple[str, str], int] = {}
        self._showing: set[tuple[str, str]] = set()

    def usable(self) -> bool:
        after = MIN_COPY_WARMUPS * self.copy.run.optim.warmup_steps
        return self.notary is not None and self.copy.available() and self.copy.recent(MAX_COPY_GROWTH, after=after)

    def answer(self, p: Pending, peer: str, msg: Backward, grad: torch.Tensor | None, learning: bool) -> bool:
        """As ``Rechecks.answer``; and a gradient computed from a witness proven to lie about this hop is never
        trained on: dropped while the hop may not know yet (or restarted since it was shown the proof, and may have
        forgotten it: it is shown again), a failed re-check once it was shown the proof before we sent it the
        micro-batch (it went on working with the liar)."""
        liar = next((w for w in msg.downstream or [] if (peer, w) in self._proofs), None)
        if liar is None or grad is None:
            return super().answer(p, peer, msg, grad, learning)
        p.recheck = None
        told = self._told.get((peer, liar))
        if told is not None and self.router.restarts(peer) != told[1]:  # it restarted since: it may have forgotten
            del self._told[(peer, liar)]
            told = None
        if told is not None and p.started > told[0]:
            self.metrics.inc("recheck_sampled")
            self.conclude(p, peer, msg, grad, (-1.0, float("inf")),
                          f"it still sends work to {short_id(liar)}, which it was shown lies about it", copy=None)
        else:
            self.metrics.inc("liar_named")
            self._tell(peer, liar)
            self.requeue(BackwardWork(msg, None))
        return True

    def _proven(self, hop: str, witness: str, proof: Fraud, why: str) -> None:
        if (hop, witness) not in self._proofs:
            logger.warning("witness %s lied about the work of %s (%s; its own signatures prove it): showing %s the "
                           "proof", short_id(witness), short_id(hop), why, short_id(hop))
            self.metrics.inc("liars_proven")
        self._proofs[(hop, witness)] = proof
        while len(self._proofs) > MAX_PROOFS:
            old = self._proofs.popitem(last=False)[0]
            self._told.pop(old, None)
            self._tries.pop(old, None)
        self._tell(hop, witness)

    def _tell(self, hop: str, witness: str) -> None:
        """Show ``hop`` the proof that ``witness`` lies about it, once (a hop that does not answer: ``TELL_TRIES``
        times, then it counts as shown)."""
        key = (hop, witness)
        if key not in self._told and key not in self._showing:
            self._showing.add(key)
            self.spawn(self._show(key))

    async def _show(self, key: tuple[str, str]) -> None:
        try:
            proof = self._proofs.get(key)
            if proof is None:
                return
            try:
                reply: Message | None = await self.send(key[0], FRAUD_RPC, proof)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                logger.debug("showing %s the proof failed: %r", short_id(key[0]), e)
                reply = None
            tries = self._tries.pop(key, 0) + 1
            if reply is not None or tries >= TELL_TRIES:  # an Ack, or a refusal: it has had the proof
                self._told[key] = (time.monotonic(), self.router.restarts(key[0]))
                self.metrics.inc("liars_shown" if isinstance(reply, Ack) else "liar_proof_refused")
            else:
                self._tries[key] = tries
        finally:
            self._showing.discard(key)

    def _rows(self, fwd: Forward) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        x, window = self.boundary.decode_forward(fwd, self.my_id)
        rows = torch.randperm(x.shape[0])[: self.config.rows].tolist()
        return x[rows], None if window is None else window[rows, :-1], rows

    async def _testimony(self, peer: str, msg: Backward, rows: list[int]) -> tuple[str, Any]:
        """("ok", (the rows each witness received, the mean of the gradient rows they returned)), ("fail", why) when
        the hop's answer cannot be true, or ("unavailable", why) when a witness could not be heard or lied (then the
        hop is shown the proof). The witnesses are the peers the hop names: one, or the two replicas of a spot check
        whose mean gradient it trained on; the hop relays each one's signature of the gradient it returned."""
        witnesses, wid = msg.downstream, msg.downstream_id
        if not witnesses or wid is None:
            return "fail", "it named no peer it sent the micro-batch on to"
        if len(set(witnesses)) != len(witnesses):
            return "fail", "it named one peer twice"
        if peer in witnesses or self.my_id in witnesses:
            return "fail", "it named itself or us as the next hop"
        relayed = msg.relayed or []
        assert self.notary is not None  # usable() is False without one
        if len(relayed) != len(witnesses) or not all(
                relayed_ok(self.notary, w, peer, r) for w, r in zip(witnesses, relayed, strict=True)):
            return "fail", "it relayed no signed gradient of a peer it named"
        # whatever stage our view of a named peer's record shows: a record seconds old may still show a peer's
        # previous stage (a 6-peer swarm banned an honest hop for it); its signature proves it returned a gradient
        said = await asyncio.gather(*(self._ask(w, peer, wid, r, rows)
                                      for w, r in zip(witnesses, relayed, strict=True)))
        for kind, what in said:
            if kind != "ok":
                return kind, what
        received = [what[0] for _, what in said]
        return "ok", (received, torch.stack([what[1] for _, what in said]).mean(dim=0))

    async def _ask(self, witness: str, peer: str, wid: int, relayed: list[bytes], rows: list[int]) -> tuple[str, Any]:
        """What ``witness`` testifies of the hop ``peer``'s micro-batch ``wid``; when it is silent, says it holds
        none, or lies, the hop's own record of it, which the witness's relayed signature binds as tightly (a hop
        whose record contradicts that signature fails). "unavailable" only when neither was heard."""
        kind, what = await self._hear(witness, witness, peer, wid, relayed, rows)
        if kind == "ok":
            return kind, what
        own_kind, own = await self._hear(peer, witness, peer, wid, relayed, rows)
        if own_kind != "unavailable":
            self.metrics.inc("recheck_by_record")
            return own_kind, own
        return kind, f"{what}; its own record: {own}"

    async def _hear(self, teller: str, witness: str, peer: str, wid: int, relayed: list[bytes],
                    rows: list[int]) -> tuple[str, Any]:
        """Ask ``teller`` (the witness, or the hop ``peer`` for its own record) about micro-batch ``wid``; ("ok",
        rows), ("fail", why) when the hop's own record is a lie, ("unavailable", why) otherwise."""
        own = teller == peer
        req = TestimonyRequest(run_id=self.boundary.run.run_id, sender=witness if own else peer, mb_id=wid,
                               outgoing=own)
        who = "the hop" if own else "the witness"
        try:
            reply = await self.send(teller, TESTIMONY_RPC, req)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            return "unavailable", f"{who} did not answer ({type(e).__name__})"
        if not isinstance(reply, Testimony):  # NOT_FOUND too: the witness signed a gradient for it (evicted, or
            # evasive)
            return "unavailable", f"{who} answered {type(reply).__name__}"
        assert self.notary is not None
        try:
            judged = await asyncio.get_running_loop().run_in_executor(None, functools.partial(
                judge, self.notary, reply, run_id=self.boundary.run.run_id, hop=peer, witness=witness, mb_id=wid,
                relayed=relayed, by=teller))
            if judged.verdict is Verdict.WITNESS_LIED:
                fraud = Fraud(run_id=self.boundary.run.run_id, witness=witness, mb_id=wid, testimony=pack(reply),
                              relayed=relayed)
                self._proven(peer, witness, fraud, judged.why)
                return "unavailable", f"the witness lied ({judged.why})"
            if judged.verdict is Verdict.HOP_LIED and own:
                return "fail", f"its own record contradicts its witness's signature ({judged.why})"
            if judged.verdict is not Verdict.OK or judged.forward is None or judged.backward is None:
                self.metrics.inc("rejected:bad_testimony")
                return "unavailable", f"{who}'s testimony was unusable ({judged.why})"
            fwd, bwd = judged.forward, judged.backward
            y, g = await asyncio.get_running_loop().run_in_executor(None, self._witnessed_rows, fwd, bwd, peer,
                                                                    witness, rows)
        except ProtocolError as e:  # frames their receivers decoded once: a signed lie we cannot read
            self.metrics.inc("rejected:bad_testimony")
            if own:  # the frames its witness's signature names did decode there
                return "fail", f"its own record does not decode ({e})"
            return "unavailable", f"{who}'s testimony was malformed ({e})"
        return "ok", (y, g)

    def _witnessed_rows(self, fwd: Forward, bwd: Backward, peer: str, witness: str,
                        rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampled rows of the activations the witness received (as it decoded them) and of its gradient."""
        assert bwd.gradient is not None  # judge() passes only a training gradient
        x, _ = self.boundary.decode_forward(fwd, peer)
        g = self.boundary.decode_gradient(bwd.gradient, witness)
        return x[rows].float(), g[rows].float()

    def _recompute_middle(self, module: StageBase, x: torch.Tensor,
                          g_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        out = middle_reference(module, x, g_out, bf16=self.bf16)
        self.compute_s += time.perf_counter() - t0
        return out

    async def _verdict(self, peer: str, fwd: Forward, msg: Backward,
                       grad: torch.Tensor) -> tuple[tuple[float, float] | None, str, bool, int | None]:
        """(the verdict on ``peer``'s answer or None, what disagreed, whether it was left unjudged because a witness
        it named was silent, the step of the copy that judged it: None when proven without one); every
        ``UNHEARD_STRIKE``-th unjudged one in a row is a failure."""
        loop = asyncio.get_running_loop()
        verdict: tuple[float, float] | None = None
        why, unheard, copy = "", False, None
        try:
            x, ids, rows = await loop.run_in_executor(None, self._rows, fwd)
            kind, said = await self._testimony(peer, msg, rows)
            unheard = kind == "unavailable"
            if kind == "fail":
                why, verdict = said, (-1.0, float("inf"))
            elif kind == "ok":
                built = await loop.run_in_executor(None, self.copy.judge)
                if built is not None:
                    module, copy = built
                    received, g_out = said
                    y, g = await self.compute(self._recompute_middle, module, x, g_out)
                    y = await loop.run_in_executor(None, as_carried, self.boundary, y, ids)
                    g = await loop.run_in_executor(None, functools.partial(as_carried, self.boundary, g,
                                                                           gradient=True))
                    if not judgeable(y - x, g - g_out):
                        raise ValueError("the held copy's own change is zero or not finite: it judges nothing")
                    # what every witness received, and the gradient the hop returned: each must pass
                    judged = [middle_agreement(x, r, y, g_out, grad[rows], g) for r in received]
                    pairs = [fwd for fwd, _ in judged] + [judged[0][1]]
                    verdict = (min(c for c, _ in pairs), max(r for _, r in pairs))
                    self.seen.extend(pairs)
                    names = ["output"] * len(received) + ["gradient"]
                    why = "; ".join(f"{what} carries {c:.3f} of the copy's change, norm ratio {r:.2f}"
                                    for what, (c, r) in zip(names, pairs, strict=True))
            else:
                logger.info("re-check of micro-batch %d left unjudged and dropped: %s", msg.mb_id, said)
        except Exception as e:  # our own failure, never the hop's: its gradient goes on as if unsampled
            logger.warning("re-check of micro-batch %d failed here: %s: %s", msg.mb_id, type(e).__name__, e)
            self.metrics.inc("recheck_errors")
            verdict, unheard = None, False
        streak = self._unheard.pop(peer, 0) + 1  # any judged verdict ends the streak
        if not unheard:
            streak = 0
        if streak >= UNHEARD_STRIKE:  # a silent witness again and again: held against the hop that named it
            verdict, why, streak = (-1.0, float("inf")), f"{UNHEARD_STRIKE} of its witnesses in a row were silent", 0
        if streak:
            self._unheard[peer] = streak
            while len(self._unheard) > 4096:
                del self._unheard[next(iter(self._unheard))]
        return verdict, why, unheard and verdict is None, copy

    async def _judge(self, p: Pending, peer: str, fwd: Forward, msg: Backward, grad: torch.Tensor) -> None:
        verdict, why, unheard, copy = await self._verdict(peer, fwd, msg, grad)
        self.conclude(p, peer, msg, grad, verdict, why, copy=copy, unheard=unheard)

    async def _arbitrate(self, p: Pending, fwd: Forward, answers: dict[str, tuple[Backward, torch.Tensor]]) -> None:
        """Each answer judged as a re-check of its own, with the testimony of the witnesses its own hop names: a liar's
        colluding witness can get its answer passed too (then neither is trained on); an honest answer fails only
        if a witness of its own lies."""
        said = await asyncio.gather(*(self._verdict(peer, fwd, msg, grad) for peer, (msg, grad) in answers.items()))
        self.decide(p, answers, {peer: (verdict, why, copy)
                                 for peer, (verdict, why, _, copy) in zip(answers, said, strict=True)})
