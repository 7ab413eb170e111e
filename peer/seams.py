"""The callables the daemon hands to its services, typed once so that every module reads the same shape.

Objects that cross modules are typed by their own classes (``PeerMetrics``, ``StageWorker``, ``PipelineServicer``,
hivemind's ``P2P`` and ``DHT``) or by a ``Protocol`` where a test or a second implementation stands in
(``protocol.rpc.Transport`` and ``HandlerTable``, ``peer.host.StageNetwork``). This module holds the function types.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from protocol.messages import Message
    from trainer.worker import StageWorker

T = TypeVar("T")


class WorkerCall(Protocol):
    """Run ``fn(worker)`` on the compute thread and return its result (whatever ``fn`` returns): a Protocol, as one
    callable serves every ``T``."""

    def __call__(self, fn: Callable[[StageWorker], T], /) -> Awaitable[T]: ...


class Compute(Protocol):
    """Run ``fn(*args)`` on the compute thread (``urgent``: before queued micro-batches) and return its result."""

    def __call__(self, fn: Callable[..., T], *args: Any, urgent: bool = False) -> Awaitable[T]: ...


#: send ``msg`` to RPC ``name`` of peer ``peer_id`` (keyword ``timeout`` in seconds) and return the reply
Send = Callable[..., Awaitable["Message"]]
