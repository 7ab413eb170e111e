"""The one way a peer registers RPC handlers: every name once on the server, bound to whoever serves it now.

``Handlers`` sits between the ``RpcServer`` and everything that serves a name. A peer-wide handler (``reach``) is
bound for the life of the server (``serve``); a stage's handlers (``forward``, ``backward``, ``infer``, ``state``,
``avg_part``, ``sync``) are bound by the stage that serves them (``add_handler``, the ``HandlerTable`` seam the
services take) and unbound together when it leaves (``clear``), so a stage move re-binds the same names. A name
reserved or unbound answers NOT_READY and counts ``rejected:not_ready``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from protocol.errors import ErrorCode
from protocol.limits import PeerBudgets
from protocol.messages import Error, Message
from protocol.rpc import Counting, Handler, HandlerTable, RpcLimits

__all__ = ["Handlers", "not_ready_error", "once_per"]


def not_ready_error() -> Error:
    return Error(code=ErrorCode.NOT_READY, message="this peer has not chosen its stage yet; retry elsewhere")


def once_per(name: str, request: type[Message], run_id: str, interval_s: float, answer: Callable[[], Message],
             count: Callable[[str, int], None], max_peers: int = 4096) -> Callable[[Message, str], Awaitable[Message]]:
    """A handler that answers a ``request`` of run ``run_id`` with ``answer()`` at most once per ``interval_s`` to
    each peer (``RATE_LIMITED`` and ``rejected:{name}_rate_limited`` otherwise; another kind or run: BAD_REQUEST,
    ``rejected:bad_request``); each answer counts ``{name}_served``."""
    budget = PeerBudgets(rate=1.0 / interval_s, burst=1, max_peers=max_peers)

    async def handle(msg: Message, peer_id: str) -> Message:
        if not isinstance(msg, request) or getattr(msg, "run_id", None) != run_id:
            count("rejected:bad_request", 1)
            return Error(code=ErrorCode.BAD_REQUEST, message=f"{name}: expected a {request.__name__} of this run")
        if budget.empty(peer_id):
            count(f"rejected:{name}_rate_limited", 1)
            return Error(code=ErrorCode.RATE_LIMITED, message=f"{name}: at most one request per {interval_s:.0f} s")
        budget.spend(peer_id)
        count(f"{name}_served", 1)
        return answer()

    return handle


class Handlers:
    """The handler table of one RPC server.

    Args:
        rpc: the server (or any ``HandlerTable``) the names are registered on, once each.
        count: counts ``rejected:not_ready`` for a call of a name nobody serves now (None: not counted).
    """

    def __init__(self, rpc: HandlerTable, *, count: Callable[[str], None] | None = None) -> None:
        self.rpc = rpc
        self.limits: RpcLimits = rpc.limits
        self.count: Counting | None = rpc.count  # traffic accounting of the real server, for RpcTransport
        self.vouch: Callable[[str], None] | None = getattr(rpc, "vouch", None)  # for validated work (averaging)
        self._count_refusal = count
        self._stage: dict[str, Handler | None] = {}
        self._peer: set[str] = set()

    async def serve(self, name: str, fn: Handler) -> None:
        """Serve ``name`` with ``fn`` for the life of the server, whatever stage the peer serves."""
        if name in self._peer or name in self._stage:
            raise ValueError(f"handler {name!r} is registered already")
        self._peer.add(name)
        await self.rpc.add_handler(name, fn)

    async def reserve(self, *names: str) -> None:
        """Register stage handler ``names`` now, answering NOT_READY until a stage binds them."""
        for name in names:
            await self._register(name)

    async def add_handler(self, name: str, fn: Handler) -> None:
        """Bind stage handler ``name`` to ``fn`` (registered on the server on its first binding)."""
        await self._register(name)
        self._stage[name] = fn

    def clear(self) -> None:
        """The stage leaves: unbind every stage handler (they answer NOT_READY until the next stage binds them)."""
        for name in self._stage:
            self._stage[name] = None

    async def _register(self, name: str) -> None:
        if name in self._peer:
            raise ValueError(f"handler {name!r} is a peer-wide handler; a stage cannot bind it")
        if name in self._stage:
            return
        self._stage[name] = None

        async def delegate(msg: Message, peer_id: str) -> Message:
            handler = self._stage.get(name)
            return await handler(msg, peer_id) if handler is not None else self._not_ready()
        await self.rpc.add_handler(name, delegate)

    def _not_ready(self) -> Error:
        if self._count_refusal is not None:
            self._count_refusal("rejected:not_ready")
        return not_ready_error()
