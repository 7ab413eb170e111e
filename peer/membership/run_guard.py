"""Refuse to join a swarm that trains another run.

Records live under a key derived from the run id, so a peer started with another run file than the swarm's finds
an empty swarm for its run and would train alone while looking healthy. The first exchange with an initial peer (the
reachability request, which carries our run id) reveals it: that peer answers WRONG_RUN naming its own run id.
``RunGuard.call`` wraps the RPC call used for that exchange and remembers such an answer; ``RunGuard.error`` turns it
into the one-line error the peer exits with.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from peer.errors import DaemonError
from protocol.errors import ErrorCode, RemoteError
from protocol.messages import Message

Call = Callable[[str, str, Message, float], Awaitable[Message]]
_THEIRS = re.compile(r"trains run (\S+)")


class WrongRunError(DaemonError):
    """The swarm at --initial-peers trains another run than this peer's run file."""


class RunGuard:
    """Remembers a WRONG_RUN answer from a peer we joined through.

    Args:
        run_id: this peer's run id.
        run_name: its run's name (shown in the error).
    """

    def __init__(self, run_id: str, run_name: str) -> None:
        self.run_id, self.run_name = run_id, run_name
        self.theirs: str | None = None
        self.helper = ""

    def wrap(self, call: Call) -> Call:
        async def guarded(peer_id: str, name: str, msg: Message, timeout: float) -> Message:
            try:
                return await call(peer_id, name, msg, timeout)
            except RemoteError as e:
                if e.code == ErrorCode.WRONG_RUN and self.theirs is None:
                    m = _THEIRS.search(e.message)
                    self.theirs, self.helper = (m.group(1) if m else "another run"), peer_id
                raise
        return guarded

    def error(self) -> WrongRunError | None:
        """The error to exit with, or None when no peer we joined through trains another run."""
        if self.theirs is None:
            return None
        return WrongRunError(
            f"the swarm at --initial-peers trains run {self.theirs}, but this peer's run is {self.run_id} "
            f"({self.run_name!r}); start it with the swarm's run file (--run) or join a swarm of run {self.run_id}")
