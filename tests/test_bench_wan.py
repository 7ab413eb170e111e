"""tools/wan.py on this machine: namespaces come up, the emulator adds the configured delay, nothing is left behind.

Needs root, iproute2 and /dev/net/tun (the emulator is tools/netem.py, tested on its own in tests/test_netem.py);
marked ``wan`` (run with ``pytest -m wan``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.wan import Wan, WanConfig, WanError, check_available  # noqa: E402

pytestmark = [pytest.mark.wan, pytest.mark.timeout(120)]
REASON = check_available()


def our_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"amb-{os.getpid()}-")]


@pytest.fixture(autouse=True)
def _needs_wan():
    if REASON:
        pytest.skip(REASON)


@pytest.mark.parametrize("delay_ms", [0.0, 25.0])
def test_rtt_is_twice_the_delay_and_teardown_is_complete(delay_ms: float):
    with Wan(WanConfig(n=3, delay_ms=delay_ms, rate_mbit=100)) as wan:
        assert sorted(our_namespaces()) == sorted(wan.names)
        rtt = wan.rtt(0, 2, samples=7)
        # delay is added once per direction; scheduling on a busy 2-core machine adds a few ms, never removes any
        assert 2 * delay_ms / 1000 * 0.95 <= rtt <= 2 * delay_ms / 1000 + 0.025, rtt
        assert wan.run(1, ["ip", "-br", "addr"]).stdout.count(wan.ip(1)) == 1
        sleeper = wan.popen(1, ["sleep", "60"])
        emulator = wan.emulator
    assert our_namespaces() == []
    assert sleeper.poll() is not None and emulator.poll() is not None


def test_link_counters_see_traffic():
    with Wan(WanConfig(n=2, delay_ms=1)) as wan:
        before = wan.link_bytes(0)
        wan.rtt(0, 1, samples=3)
        after = wan.link_bytes(0)
        assert after["tx"] > before["tx"] and after["rx"] > before["rx"]
    assert wan.emulator_log[-1].startswith("netem exit")  # the emulator's own packet counts are kept
    assert wan.counters(refresh=False)["forwarded"] >= 6


@pytest.mark.parametrize("restart", [True, False])
def test_slow_start_after_idle_is_set_per_namespace_and_the_host_keeps_its_own(restart: bool):
    path = "/proc/sys/net/ipv4/tcp_slow_start_after_idle"
    host = Path(path).read_text()
    with Wan(WanConfig(n=2, slow_start_after_idle=restart)) as wan:
        assert [wan.run(i, ["cat", path]).stdout.strip() for i in range(2)] == [str(int(restart))] * 2
    assert Path(path).read_text() == host


def test_cleanup_after_an_error_inside_the_block():
    with pytest.raises(RuntimeError, match="boom"), Wan(WanConfig(n=2)) as wan:
        proc = wan.popen(0, ["sleep", "60"])
        raise RuntimeError("boom")
    assert our_namespaces() == [] and proc.poll() is not None


def test_a_process_ignoring_sigterm_is_killed_with_what_it_left_in_the_namespace():
    script = "import signal, subprocess, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
             "subprocess.Popen(['sleep', '60'], start_new_session=True); time.sleep(60)"
    t0 = time.monotonic()
    with Wan(WanConfig(n=2, stop_timeout_s=1.0)) as wan:
        proc = wan.popen(0, [sys.executable, "-c", script])
        time.sleep(1.0)
        pids = subprocess.run(["ip", "netns", "pids", wan.names[0]], capture_output=True, text=True).stdout.split()
        assert len(pids) == 2
    assert proc.poll() is not None and time.monotonic() - t0 < 30
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    assert our_namespaces() == []


def test_bad_configs_are_refused_with_advice():
    with pytest.raises(ValueError, match="100.64"):
        WanConfig(n=2, subnet="198.18.0")
    with pytest.raises(ValueError, match="loss"):
        WanConfig(n=2, loss=1.5)
    with pytest.raises(WanError, match="does not exist"), Wan(WanConfig(n=2, emulator=Path("/nonexistent/netem.py"))):
        pass
    assert our_namespaces() == []
