"""monitor: the pure swarm summary, its 80-column table, and the real command against records in a live DHT."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from peer.cli.monitor import render, swarm_view
from peer.membership.records import PeerRecord

MONITOR = [sys.executable, "-m", "peer.cli", "monitor"]


def rec(peer_id: str, stage: int, throughput: float, state: str = "training", loss: float | None = None) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, stage=stage, throughput=throughput, queue=1, version=7, state=state,
                      maddrs=[], reachable=True, tokens_per_s=throughput * 100, loss=loss)


def test_swarm_view_finds_coverage_bottleneck_and_throughput() -> None:
    records = {r.peer_id: r for r in (rec("a", 0, 5.0), rec("b", 0, 4.0), rec("c", 1, 3.0, loss=4.0),
                                      rec("d", 1, 2.0, loss=5.0), rec("e", 1, 9.0, state="joining"),
                                      rec("z", 7, 1.0))}
    view = swarm_view(records, 2, "run1")
    assert view["coverage"] == 1.0 and view["missing_stages"] == []
    assert [p["peer_id"] for p in view["stages"][1]["peers"]] == ["c", "d", "e"]
    assert view["stages"][1]["throughput"] == 5.0  # the joining peer serves nothing yet
    assert view["bottleneck_stage"] == 1
    assert view["swarm_tokens_per_s"] == pytest.approx(900.0)  # stage 0: 500 + 400
    assert view["loss"] == pytest.approx(4.5)
    assert [p["peer_id"] for p in view["other_stages"]] == ["z"]
    missing = swarm_view({"a": records["a"]}, 3, "run1")
    assert missing["coverage"] == pytest.approx(1 / 3) and missing["missing_stages"] == [1, 2]
    assert missing["bottleneck_stage"] == 1 and missing["swarm_tokens_per_s"] == 0.0
    json.dumps(view)

    console = Console(record=True, width=80, color_system=None)
    console.print(render(view))
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= 80
    assert "1 slowest" in text and "coverage 100%" in text and "900 tok/s" in text
    console.print(render(missing))
    assert "MISSING" in console.export_text()


def test_monitor_once_json_reads_every_peer_from_a_live_dht(tmp_path: Path) -> None:
    from hivemind import DHT

    from peer.membership.records import announce, record_validator
    from peer.membership.signing import Signer
    from trainer.config import RunConfig

    run = RunConfig.default()
    dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=[record_validator(run.run_id)])
    try:
        signers = [Signer.generate() for _ in range(3)]  # each record is signed by the peer it describes
        records = [rec(s.peer_id, i % run.n_stages, 1.0 + i, loss=3.0) for i, s in enumerate(signers)]

        async def publish() -> None:
            for r, s in zip(records, signers, strict=True):
                assert await announce(dht, run.run_id, r, expiration_s=60, signer=s)

        asyncio.run(publish())
        maddrs = [str(a) for a in dht.get_visible_maddrs()]
        out = subprocess.run([*MONITOR, "--initial-peers", *maddrs, "--once", "--json"],
                             capture_output=True, text=True, timeout=90)
        assert out.returncode == 0, out.stderr
        view = json.loads(out.stdout)
        by_stage = {s["stage"]: {p["peer_id"] for p in s["peers"]} for s in view["stages"]}
        for r in records:
            assert r.peer_id in by_stage[r.stage]
        assert view["n_peers"] == 3 and view["coverage"] == 1.0

        watch = subprocess.Popen([*MONITOR, "--initial-peers", *maddrs, "--json", "--interval", "0.5"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            first_line = watch.stdout.readline()  # blocks until the first read of the DHT is printed
            assert json.loads(first_line)["run_id"] == run.run_id
            watch.send_signal(signal.SIGTERM)
            assert watch.wait(timeout=60) == 0, watch.stderr.read()
        finally:
            if watch.poll() is None:
                os.killpg(watch.pid, signal.SIGKILL)
                watch.wait()
        assert not _alive_in_group(watch.pid), "monitor left its DHT process behind"

        wrong = subprocess.run([*MONITOR, "--initial-peers", *maddrs, "--once", "--json",
                                "--wait", "1", "--run", "/nonexistent.toml"], capture_output=True, text=True,
                               timeout=60)
        assert wrong.returncode != 0 and "--run" in wrong.stderr
    finally:
        dht.shutdown()


def _alive_in_group(pgid: int) -> bool:
    """Whether any process of the process group ``pgid`` is still running (after a short grace)."""
    for _ in range(20):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.25)
    os.killpg(pgid, signal.SIGKILL)
    return True
