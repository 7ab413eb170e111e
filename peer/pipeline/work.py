"""What a stage holds: a micro-batch whose gradient it awaits (``Pending``), and validated work queued for its compute
thread (``ForwardWork``, ``BackwardWork``)."""

from __future__ import annotations

import asyncio
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from protocol.messages import Backward, Forward

__all__ = ["REFUSED", "BackwardWork", "ForwardWork", "MicroBatchIds", "Pending", "Refused"]


class Refused:
    """What stage 0's ``Pending.done`` resolves to when the last stage refused to train on the micro-batch."""

    def __repr__(self) -> str:
        return "REFUSED"


REFUSED = Refused()


class MicroBatchIds:
    """The ids a peer gives the micro-batches it sends: a random 30-bit prefix of its own and a counter, so that ids
    of different senders do not meet. Every stage labels what it sends (stage 0 its new micro-batches, a later stage
    the ones it forwards), so a micro-batch that a spot check sent to two replicas reaches the stages after them
    as two micro-batches, not as a replay of one; ``local(sent)`` maps the id a gradient comes back under to the one
    this peer holds the micro-batch under (the last ``remember`` sends)."""

    def __init__(self, remember: int = 16384) -> None:
        self._prefix = random.getrandbits(30) << 32
        self._next = 0
        self._local: OrderedDict[int, int] = OrderedDict()
        self._remember = remember

    def new(self, local: int | None = None) -> int:
        """A fresh id; with ``local``, one that ``local(...)`` maps back to ``local``."""
        self._next += 1
        sent = self._prefix | (self._next & 0xFFFFFFFF)
        if local is not None:
            self._local[sent] = local
            while len(self._local) > self._remember:
                self._local.popitem(last=False)
        return sent

    def local(self, sent: int) -> int:
        """The id this peer holds the micro-batch sent as ``sent`` under (``sent`` itself when it labelled none)."""
        return self._local.get(sent, sent)


@dataclass
class Pending:
    """A micro-batch whose gradient this stage still waits for."""

    prev_peer: str | None
    next_peer: str | None
    route: list[str]
    deadline: float
    is_eval: bool = False
    sent_to: set[str] = field(default_factory=set)  # next-stage peers we tried; only they may send the gradient
    done: asyncio.Future[float | Refused | None] | None = None  # stage 0: the loss (None when dropped, REFUSED)
    checks: dict[str, tuple[Backward, torch.Tensor] | None] | None = None  # a spot check: hop -> its answer
    recheck: Forward | None = None  # what was sent to the next stage, kept for a re-check from the held copy
    sent_id: int | None = None  # the id it went on under (a middle stage names it in the gradient it returns)
    trained_from: list[str] | None = None  # the next-stage peers whose gradients were averaged (a spot check's two)
    relayed: dict[str, list[bytes]] = field(default_factory=dict)  # next-stage peer -> its signed gradient's
    # [digest, forward digest, signature, key], relayed in the gradient we return (peer.pipeline.attest)
    answers: bytes = b""  # from stage 2 on: the digest of the signed forward received, signed with its gradient
    sent: tuple[Forward, bytes] | None = None  # a middle stage: the signed forward sent on, and its digest
    fwdcheck: bool = False  # the last stage: its activations are re-computed from the held copy before training
    started: float = field(default_factory=time.monotonic)
    flush: int | None = None  # sync mode: the flush it belongs to (stage 0's number)


class ForwardWork(NamedTuple):
    """A validated forward waiting for the compute thread."""

    msg: Forward
    x: torch.Tensor
    targets: torch.Tensor | None
    window: torch.Tensor | None  # subspace runs: the token window [B, T+1] passed on to the next stage


class BackwardWork(NamedTuple):
    """A validated backward waiting for the compute thread (``grad`` None: a drop or a refusal travelling back)."""

    msg: Backward
    grad: torch.Tensor | None
