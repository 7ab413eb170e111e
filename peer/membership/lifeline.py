"""Tie the hivemind DHT process and its p2pd to the life of the peer, so that neither outlives it (not even a kill -9).

hivemind runs the DHT in a forked child process, which starts p2pd as its own child. Nothing in either notices when the
peer dies abruptly: the forked child inherits the peer's signal set-up (asyncio's wakeup fd, whose handler only writes
a byte that nobody reads any more, so SIGTERM does nothing) and keeps the identity's p2pd alive, and a restart with the
same identity is then refused as "already taken". Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``) is the
kernel's own answer: the DHT process asks to be SIGKILLed when the peer dies, and it starts p2pd with the same request
about itself, so a dying peer takes the whole chain down at once.

The parent-death signal fires when the *thread* that forked the child exits, so the peer must fork the DHT process
from a thread that lives as long as the peer (its main thread): ``LifelineDHT(start=False)`` then ``.start()`` there.
Where prctl is unavailable (not Linux) this module does nothing and the DHT keeps hivemind's behaviour.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec

import hivemind

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent (thread) exits. False where unsupported."""
    libc = _libc()
    if libc is None:
        return False
    result: int = libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    return result == 0


def _reset_inherited_signals() -> None:
    """Undo what the forked child inherited of the peer's signal handling: SIGTERM kills it again (hivemind's
    ``terminate()`` relies on that) and no wakeup fd points into the parent's event loop."""
    try:
        signal.set_wakeup_fd(-1)
    except (ValueError, OSError):
        pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the peer stops us in order


_P = ParamSpec("_P")


def _spawn_with_lifeline(original: Callable[_P, Coroutine[Any, Any, asyncio.subprocess.Process]]
                         ) -> Callable[_P, Coroutine[Any, Any, asyncio.subprocess.Process]]:
    """``asyncio.create_subprocess_exec`` whose child (p2pd) is killed when the calling process dies."""

    @functools.wraps(original)
    async def spawn(*args: _P.args, **kwargs: _P.kwargs) -> asyncio.subprocess.Process:
        if "preexec_fn" not in kwargs:
            kwargs["preexec_fn"] = die_with_parent
        return await original(*args, **kwargs)

    return spawn


class LifelineDHT(hivemind.DHT):
    """hivemind's DHT process, killed with its peer and killing its p2pd with it (see the module docstring)."""

    def run(self) -> None:
        # this runs in the forked child: hivemind's __init__ recorded the peer's pid before the fork
        _reset_inherited_signals()
        if die_with_parent() and os.getppid() != self._parent_pid:
            os._exit(0)  # the peer died between the fork and the prctl: nothing to serve
        # p2pd is started by this process's event loop thread through asyncio.subprocess; patching it here changes
        # only this child process, never the peer
        asyncio.subprocess.create_subprocess_exec = _spawn_with_lifeline(asyncio.subprocess.create_subprocess_exec)
        super().run()
