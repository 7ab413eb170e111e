"""setup_logging: JSON lines off a TTY, rich text on one, hivemind's records routed through the same handler."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

SCRIPT = """
import logging, sys
from peer.ops.logs import setup_logging
setup_logging("INFO", {json}, hivemind={hivemind})
setup_logging("INFO", {json}, hivemind={hivemind})  # a second call replaces, never duplicates
logging.getLogger("peer.x").info("hello %s", "world", extra={{"stage": 2}})
logging.getLogger("peer.x").debug("hidden")
try:
    1 / 0
except ZeroDivisionError:
    logging.getLogger("peer.x").exception("boom")
if {hivemind}:
    from hivemind.utils.logging import get_logger
    get_logger("hivemind.test").warning("from hivemind")
"""


def run_script(json_mode: object, hivemind: bool) -> tuple[list[str], list[str]]:
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(json=json_mode, hivemind=hivemind)],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.splitlines(), out.stderr.splitlines()


def test_json_lines_when_not_a_tty() -> None:
    stdout, lines = run_script(None, hivemind=True)  # stdout is a pipe here: JSON is picked automatically
    assert stdout == []
    records = [json.loads(line) for line in lines]
    assert [r["msg"] for r in records] == ["hello world", "boom", "from hivemind"]
    assert records[0]["level"] == "INFO" and records[0]["logger"] == "peer.x" and records[0]["stage"] == 2
    assert records[0]["ts"].endswith("Z")
    assert "ZeroDivisionError" in records[1]["exc"]
    assert records[2]["logger"] == "hivemind.test"


def test_text_when_asked() -> None:
    stdout, stderr = run_script(False, hivemind=False)
    text = "\n".join(stdout)
    assert stderr == []
    assert "hello world" in text and "boom" in text and "hidden" not in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text.splitlines()[0])


def test_unknown_level_is_refused() -> None:
    from peer.ops.logs import setup_logging

    root = logging.getLogger()
    before = (root.level, list(root.handlers))
    with pytest.raises(ValueError, match="unknown log level"):
        setup_logging("LOUD", json=True, hivemind=False)
    assert (root.level, list(root.handlers)) == before  # a refused call changes nothing


FORK_SCRIPT = """
import logging, os, sys, threading, time
from rich import get_console
from peer.ops.logs import setup_logging
setup_logging("INFO", False, hivemind=False)
held = threading.Event()
def hold():  # another thread is inside the console (drawing the dashboard) when the fork happens
    with get_console()._lock:
        held.set()
        time.sleep(5)
threading.Thread(target=hold, daemon=True).start()
held.wait()
pid = os.fork()
if pid == 0:
    logging.getLogger("child").warning("child logs without hanging")
    print("child prints", flush=True)
    os._exit(0)
deadline = time.time() + 3
while time.time() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        sys.exit(os.waitstatus_to_exitcode(status))
    time.sleep(0.05)
os.kill(pid, 9)
sys.exit(42)
"""


def test_a_child_forked_while_the_console_is_busy_can_still_log() -> None:
    out = subprocess.run([sys.executable, "-c", FORK_SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"the forked child hung (rc {out.returncode}): {out.stderr}"
    assert "child logs without hanging" in out.stderr and "child prints" in out.stdout
