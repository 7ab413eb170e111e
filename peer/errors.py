"""The errors a user can fix, as a type of their own.

``UserError`` carries a message that says what happened and what to do; ``asyncmesh-peer`` prints it as one line and
exits with its ``exit_code``. Anything else that escapes a command is a bug and keeps its traceback.
``user_input`` turns the ``ValueError``/``OSError`` of a config constructor or file reader (trainer/ and protocol/
do not know about users) into a ``UserError`` at the command-line boundary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class UserError(Exception):
    """Bad input or environment: a flag, a run file, a port, a folder. The message says what to do."""

    exit_code = 2


class DaemonError(UserError):
    """The peer cannot start or go on (the DHT, its identity, its checkpoint); the message says what to do."""

    exit_code = 1


@contextlib.contextmanager
def user_input(what: str = "") -> Iterator[None]:
    """Inside this block a ``ValueError`` or ``OSError`` is the user's input at fault: re-raise it as a UserError,
    prefixed with ``what`` when given (e.g. ``--run tests/runs/x.toml``)."""
    try:
        yield
    except UserError:
        raise
    except (ValueError, OSError) as e:
        raise UserError(f"{what}: {e}" if what else str(e)) from e
