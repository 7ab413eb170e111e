"""`join` checks its input before anything starts, and refuses a swarm of another run (one line, non-zero exit)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from swarm_utils import TINY_RUN, swarm  # noqa: F401  (fixture)

from peer.cli.checks import check_data, check_multiaddrs, check_port_free
from peer.errors import DaemonError, UserError
from peer.membership.run_guard import RunGuard
from protocol.errors import ErrorCode, RemoteError
from protocol.messages import Ack
from trainer.config import RunConfig

REPO = Path(__file__).resolve().parent.parent
PEER = "/ip4/127.0.0.1/tcp/4001/p2p/QmaLYhzAgNXNb9pdQcqAETKbifSjph7AbxA221MKDwrpq5"


def test_multiaddrs_are_parsed_and_initial_peers_must_name_a_peer():
    check_multiaddrs("--initial-peers", [PEER], need_peer_id=True)
    check_multiaddrs("--host-maddrs", ["/ip4/0.0.0.0/tcp/0", "/ip6/::/tcp/31337"])
    for bad in ("not-a-multiaddr", "/ip4/300.1.1.1/tcp/5", "/ip4/1.2.3.4/tcp/x"):
        with pytest.raises(UserError, match="is not a multiaddr") as e:
            check_multiaddrs("--host-maddrs", [bad])
        assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="append /p2p/PEER_ID"):
        check_multiaddrs("--initial-peers", ["/ip4/1.2.3.4/tcp/5"], need_peer_id=True)


def test_a_busy_port_is_a_one_line_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(UserError, match=f"--metrics-port {port}: 127.0.0.1:{port} is in use"):
            check_port_free("--metrics-port", "127.0.0.1", port)
    check_port_free("--metrics-port", "127.0.0.1", 0)


def test_data_is_checked_whatever_the_stage(tmp_path):
    run = RunConfig.from_toml(TINY_RUN)
    with pytest.raises(UserError, match="--data: data path .* does not exist"):
        check_data(run, str(tmp_path / "nonexistent"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no usable files"):
        check_data(run, str(tmp_path / "empty"))
    (tmp_path / "small.txt").write_text("too short")
    with pytest.raises(UserError, match="fewer than"):
        check_data(run, str(tmp_path / "small.txt"))
    (tmp_path / "ok.txt").write_text("".join(f"line {i} of a corpus large enough for both splits\n"
                                             for i in range(2000)))
    check_data(run, str(tmp_path / "ok.txt"))
    check_data(run, None)  # the embedded corpus


def test_the_run_guard_names_both_run_ids():
    guard = RunGuard("aaaa", "mine")

    async def refuse(pid: str, name: str, msg: object, timeout: float) -> Ack:
        raise RemoteError(ErrorCode.WRONG_RUN, "this peer trains run bbbb")

    with pytest.raises(RemoteError):
        asyncio.run(guard.wrap(refuse)("QmX", "reach", Ack(), 1.0))
    err = guard.error()
    assert isinstance(err, DaemonError) and "trains run bbbb" in str(err) and "run is aaaa" in str(err)
    assert RunGuard("a", "b").error() is None


def _join(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "peer.cli", "join", "--no-tui", *argv], cwd=REPO, text=True,
                          capture_output=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.parametrize("argv, match", [
    (("--initial-peers", "not-a-multiaddr"), "is not a multiaddr"),
    (("--stage", "-1"), "--stage must be 'auto' or a stage number >= 0"),
    (("--stage", "1", "--data", "/nonexistent/corpus"), "does not exist"),
])
def test_join_refuses_bad_input_at_once_in_one_line(argv, match, tmp_path):
    t0 = time.monotonic()
    r = _join("--run", str(TINY_RUN), "--identity", str(tmp_path / "id.key"), *argv)
    assert r.returncode == 2 and match in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "usage:" not in r.stderr, r.stderr
    assert time.monotonic() - t0 < 30  # no DHT start, no retries


def test_a_busy_metrics_port_is_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = _join("--run", str(TINY_RUN), "--metrics-port", str(s.getsockname()[1]), "--identity",
                  str(tmp_path / "id.key"))
    assert r.returncode == 2 and "is in use" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.timeout(300)
def test_a_peer_of_another_run_is_refused_and_exits_non_zero(swarm, tmp_path):  # noqa: F811
    other = tmp_path / "other.toml"
    other.write_text(TINY_RUN.read_text().replace("seed = 0", "seed = 1"))
    a = swarm.start("a", stage="0")
    b = swarm.start("b", stage="1", initial=a.wait_maddrs()[:1], run=other)
    code = b.wait_exit(180)  # two peers' start-up (torch, the DHT) on a loaded machine: well under on an idle one
    mine, theirs = RunConfig.from_toml(other).run_id, RunConfig.from_toml(TINY_RUN).run_id
    log = b.log()
    assert code != 0, log[-2000:]
    assert f"trains run {theirs}" in log and f"this peer's run is {mine}" in log, log[-2000:]
    assert "Traceback" not in log, log[-3000:]
