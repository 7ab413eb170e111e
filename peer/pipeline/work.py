"""What a stage holds: a micro-batch whose gradient it awaits (``Pending``), and validated work queued for its compute
thread (``ForwardWork``, ``BackwardWork``)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from protocol.messages import Backward, Forward

__all__ = ["REFUSED", "BackwardWork", "ForwardWork", "Pending", "Refused"]


class Refused:
    """What stage 0's ``Pending.done`` resolves to when the last stage refused to train on the micro-batch."""

    def __repr__(self) -> str:
        return "REFUSED"


REFUSED = Refused()


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
    started: float = field(default_factory=time.monotonic)
    flush: int | None = None  # sync mode: the flush it belongs to (stage 0's number)


class ForwardWork(NamedTuple):
    """A validated forward waiting for the compute thread."""

    msg: Forward
    x: torch.Tensor
    targets: torch.Tensor | None
    ids: torch.Tensor | None


class BackwardWork(NamedTuple):
    """A validated backward waiting for the compute thread (``grad`` None: a drop or a refusal travelling back)."""

    msg: Backward
    grad: torch.Tensor | None
