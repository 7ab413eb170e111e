"""A stage's spot checks in flight: a micro-batch also sent to a second replica of the next stage, its two answers
held until both are in, then judged.

``SpotChecker`` (peer.pipeline.spotcheck) decides which hop is checked, with whom, and who is right; this module does
the sending and the holding for the servicer: the micro-batch's ``Pending.checks`` holds one slot per replica asked,
and its gradient is trained on only once both answers agree (their mean), never on an untrusted hop's answer alone.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from peer.ids import short_id
from peer.pipeline.work import BackwardWork, Pending
from protocol.messages import Ack

if TYPE_CHECKING:
    import torch

    from peer.membership.routing import Router
    from peer.ops.metrics import PeerMetrics
    from peer.pipeline.hops import Hops
    from peer.pipeline.spotcheck import SpotChecker
    from protocol.messages import Backward, Forward

logger = logging.getLogger(__name__)


def ban_hop(peer: str, *, stage: int, spot: SpotChecker, router: Router, metrics: PeerMetrics,
            revoke: Callable[[str], None], kind: str, contradicted_by: str) -> None:
    """Ban a next-stage hop caught returning fabricated gradients (a spot check or a re-check): routing skips it for
    ``ban_s``, it is a stranger again, ``<kind>_banned`` is counted and the operator warned."""
    router.ban(peer, spot.config.ban_s)
    revoke(peer)
    metrics.inc(f"{kind}_banned")
    metrics.warn(f"peer {peer[-8:]} of stage {stage + 1} returned gradients that {contradicted_by} contradicts; "
                 f"banned for {spot.config.ban_s:.0f} s", key=f"{kind}:{peer}")


class CrossChecks:
    """The spot checks stage ``stage`` runs on the next stage's hops.

    Args:
        spot: who is checked, with whom, and the verdicts.
        held: whether a micro-batch is still held here (``held(mb_id, pending)``: not dropped or answered meanwhile).
        requeue: queue an answer for the compute thread (the held answer of a trusted hop, trained unchecked).
        drop: drop a micro-batch here and upstream (stage 0 re-sends its sample).
        vouch: make a peer known (both replicas of a check that passed: validated work, trained on).
        revoke: make a peer a stranger again (a hop banned for fabricated gradients).
    """

    def __init__(self, spot: SpotChecker, *, stage: int, hops: Hops, router: Router, metrics: PeerMetrics,
                 held: Callable[[int, Pending], bool], requeue: Callable[[BackwardWork], None],
                 drop: Callable[[int], Awaitable[None]], vouch: Callable[[str], None] = lambda peer: None,
                 revoke: Callable[[str], None] = lambda peer: None) -> None:
        self.spot, self.stage, self.hops, self.router, self.metrics = spot, stage, hops, router, metrics
        self.held, self.requeue, self.drop, self.vouch, self.revoke = held, requeue, drop, vouch, revoke
        self.arbiter: Callable[[Pending, dict[str, tuple[Backward, torch.Tensor]]], bool] | None = None
        """Decides a disagreement from the held copy when it can (``Rechecks.arbitrate``; set by the servicer)."""

    def wants(self, peer: str, *, learning: bool) -> bool:
        """Whether a training micro-batch just sent to ``peer`` is checked (``learning``: the gradient norm bound is
        being learnt, so everything is)."""
        return self.spot.wants_check(peer, learning=learning)

    async def second(self, p: Pending, peer: str, msg: Forward, *, local_id: int | None = None) -> None:
        """Send ``msg`` to a second replica of the next stage as well; its gradient and ``peer``'s are compared.
        ``local_id``: the id this stage holds the micro-batch under, when it sent it under another."""
        mb_id = msg.mb_id if local_id is None else local_id
        stage = self.stage + 1
        others = [r.peer_id for r in self.router.candidates(self.hops.next_hops(stage), stage, exclude={peer})]
        # not with a hop that never answered and holds one of ours already: a black hole would collect every slot in
        # flight as the second replica of checks (it is judged, and banned, by the one it holds); a primary left
        # without a partner is judged like a lone replica (the re-checks and the last stage's loss check)
        others = [o for o in others if not self.router.unanswered_full(o)]
        partner = self.spot.partner(peer, others)
        if partner is None:  # a lone replica: nothing to compare with (the last stage's loss check still applies)
            return
        p.checks = {peer: None, partner: None}  # before sending: the primary's gradient may already be on its way
        p.sent_to.add(partner)
        reply = await self.hops.forward_to(partner, msg)
        if not self.held(mb_id, p):
            return
        if isinstance(reply, Ack):
            self.router.sent(partner, mb_id)
            self.metrics.inc("spotcheck_sent")
            return
        self.metrics.inc("spotcheck_unavailable")
        held = p.checks.get(peer) if p.checks is not None else None
        p.checks = None
        if self.spot.trusted(peer):  # a trusted hop's gradient is applied unchecked anyway
            if held is not None:
                self.requeue(BackwardWork(*held))
            return
        # an untrusted hop's gradient is never trained on unchecked while a partner exists: drop, stage 0 re-sends
        await self.drop(mb_id)

    def answer(self, p: Pending, peer_id: str, msg: Backward,
               grad: torch.Tensor | None) -> tuple[Backward, torch.Tensor | None] | None:
        """One answer of a checked micro-batch: None while its partner's is missing (or while the held copy decides
        between the two), else what to train on (no gradient: dropped here and upstream)."""
        assert p.checks is not None
        if grad is None:  # a drop or a refusal: nothing to compare; the micro-batch goes the way of that answer
            p.checks = None
            self.metrics.inc("spotcheck_void")
            return msg, None
        p.checks[peer_id] = (msg, grad)
        answers = [(hop, answer) for hop, answer in p.checks.items() if answer is not None]
        if len(answers) < len(p.checks):
            return None
        (a, (msg_a, grad_a)), (b, (msg_b, grad_b)) = answers
        p.checks = None
        agree = self.spot.compare(a, grad_a, b, grad_b)
        self.metrics.spot_checks = self.spot.snapshot()
        if agree:  # two replicas agree: validated work of both, trained on
            self.vouch(a)
            self.vouch(b)
            return msg_a, (grad_a + grad_b) / 2
        if self.arbiter is not None and self.arbiter(p, {a: (msg_a, grad_a), b: (msg_b, grad_b)}):
            logger.info("spot check of micro-batch %d: the gradients of %s and %s disagree; the held copy decides",
                        msg.mb_id, short_id(a), short_id(b))
            return None  # held until the copy re-computed it: answered then, trained or dropped
        caught, ban = self.spot.blame(a, b)
        logger.warning("spot check of micro-batch %d: the gradients of %s and %s disagree; neither is trained on, "
                       "%s is blamed%s", msg.mb_id, short_id(a), short_id(b), short_id(caught),
                       " and banned" if ban else "")
        if ban:
            ban_hop(caught, stage=self.stage, spot=self.spot, router=self.router, metrics=self.metrics,
                    revoke=self.revoke, kind="spotcheck", contradicted_by="another replica")
        return msg_a, None  # dropped here and upstream (stage 0 re-sends its sample)
