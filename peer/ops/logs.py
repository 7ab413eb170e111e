"""Logging set-up for the peer processes: readable text on a terminal, one JSON object per line everywhere else.

Call ``setup_logging(level, json=None)`` once, at the entry point of a subcommand, before anything logs. On a TTY it
installs rich's handler on the root logger, printing to rich's global console on stdout: the console the dashboard
draws on, so log lines scroll above the live dashboard instead of tearing it. When stdout is not a TTY (Docker without
``-t``, systemd, CI) it writes JSON lines to stderr, which log collectors parse without regexes. hivemind's own
handler is retired so that its records take the same path and format.
"""

from __future__ import annotations

import json as _json
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any

_STD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonLinesFormatter(logging.Formatter):
    """One JSON object per record: ts (UTC ISO-8601), level, logger, msg, plus exc and any ``extra=`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        for key, value in vars(record).items():
            if key not in _STD_ATTRS and not key.startswith("_"):
                out[key] = value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
        return _json.dumps(out, ensure_ascii=False)


_fork_hook_installed = False
_OURS: weakref.WeakSet[logging.Handler] = weakref.WeakSet()  # the handlers setup_logging installed


def _after_fork_in_child() -> None:
    """In a forked child (hivemind's DHT process is one): stop using the parent's rich console.

    Its lock may have been held by another thread of the parent at fork time, and a child that then logs through it
    hangs forever; its live display belongs to the parent. The child gets plain stderr lines, WARNING and above.
    """
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # undo rich Live's redirection
    root = logging.getLogger()
    for old in list(root.handlers):
        if old in _OURS and not isinstance(old.formatter, JsonLinesFormatter):
            root.removeHandler(old)
            plain: logging.Handler = logging.StreamHandler(sys.__stderr__)
            plain.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [pid %(process)d] %(name)s: %(message)s"))
            plain.setLevel(logging.WARNING)
            _OURS.add(plain)
            root.addHandler(plain)
    from rich import get_console

    get_console()._lock = threading.RLock()  # in case the child prints through rich anyway


def install_fork_guard() -> None:
    """Register ``_after_fork_in_child`` once per process (setup_logging and the dashboard call it)."""
    global _fork_hook_installed
    if not _fork_hook_installed and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _fork_hook_installed = True


def _parse_level(level: int | str) -> int:
    if isinstance(level, int):
        return level
    value = logging.getLevelName(str(level).upper())
    if not isinstance(value, int):
        raise ValueError(f"unknown log level {level!r}; use DEBUG, INFO, WARNING or ERROR")
    return value


def setup_logging(level: int | str = "INFO", json: bool | None = None, *, hivemind: bool = True) -> logging.Handler:
    """Install one handler on the root logger and return it. Safe to call again (it replaces its own handler).

    Args:
        level: root log level, a name ('INFO') or a number.
        json: True for JSON lines (stderr), False for rich text (stdout), None: text if stdout is a TTY.
        hivemind: also route hivemind's loggers through this handler (imports hivemind's logging module).
    """
    numeric = _parse_level(level)
    install_fork_guard()
    if json is None:
        json = not sys.stdout.isatty()
    if json:
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonLinesFormatter())
    else:
        from rich.logging import RichHandler

        handler = RichHandler(rich_tracebacks=False, show_path=False, log_time_format="[%X]")
    _OURS.add(handler)  # lets a second call find and replace it
    root = logging.getLogger()
    for old in list(root.handlers):
        if old in _OURS or isinstance(old, logging.StreamHandler) and old.stream is sys.stderr:
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    if hivemind:
        from hivemind.utils.logging import use_hivemind_log_handler

        use_hivemind_log_handler("nowhere")  # hivemind records propagate to our root handler
        logging.getLogger("hivemind").setLevel(max(numeric, logging.INFO))
    return handler
