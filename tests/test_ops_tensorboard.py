"""`asyncmesh-peer monitor --tensorboard DIR`: the swarm's curves written by the real command, read back from the
event file with TensorBoard's own reader. The DHT is a stand-in that serves fixed snapshots of a 2-stage swarm (the
records the peers would announce), so the test costs no peer process; skipped without the optional extra."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import pytest

from peer.cli import main
from peer.membership.records import PeerRecord

pytest.importorskip("tensorboard")

TINY_RUN = Path(__file__).parent / "runs" / "tiny.toml"
MADDR = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def _snapshot(step: int) -> dict[str, PeerRecord]:
    """The records of a 2-stage swarm at stage-0 step ``step``: tokens, losses and rates move with it."""
    return {
        "QmStage0": PeerRecord(peer_id="QmStage0", stage=0, throughput=2.0, queue=0, version=step, state="training",
                               tokens_per_s=500.0 + step, tokens=256 * step, val_loss=5.0 - step / 100),
        "QmStage1": PeerRecord(peer_id="QmStage1", stage=1, throughput=2.0, queue=0, version=step, state="training",
                               tokens_per_s=500.0 + step, loss=4.0 - step / 100, tokens=256 * step),
    }


class FakeDHT:
    """Stands in for ``hivemind.DHT`` in client mode: records the shutdown, nothing else."""

    instances: list[FakeDHT] = []

    def __init__(self, **kwargs: object) -> None:
        assert kwargs["client_mode"] is True and kwargs["initial_peers"] == [MADDR]
        self.closed = False
        FakeDHT.instances.append(self)

    def shutdown(self) -> None:
        self.closed = True


@pytest.fixture
def fake_swarm(monkeypatch):
    """Each DHT read returns the next snapshot (steps 10, 20, 30, ...); the ``stop_after``-th read presses Ctrl-C once.

    One SIGINT, sent to the main thread: a signal sent on every later read could be handled only after the monitor
    had put the process's own handler back (on a busy machine), and interrupt the test run itself."""
    import hivemind

    import peer.membership.records as records

    reads = {"n": 0, "stop_after": None}

    async def fetch_swarm(dht, run_id, *, timeout, include_stopped=False):
        reads["n"] += 1
        if reads["n"] == reads["stop_after"]:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # what Ctrl-C does to a watching monitor
        return _snapshot(10 * reads["n"])

    FakeDHT.instances.clear()
    monkeypatch.setattr(hivemind, "DHT", FakeDHT)
    monkeypatch.setattr(records, "fetch_swarm", fetch_swarm)
    return reads


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list(logdir.glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_monitor_once_logs_the_swarm_curves_for_tensorboard(fake_swarm, tmp_path, capsys):
    logdir = tmp_path / "tb"
    assert main(["monitor", "--initial-peers", MADDR, "--run", str(TINY_RUN), "--once", "--json",
                 "--tensorboard", str(logdir)]) == 0
    assert FakeDHT.instances[-1].closed
    got = _scalars(logdir)
    assert set(got) == {"swarm/tokens_per_s", "swarm/train_loss", "swarm/val_loss", "swarm/tokens", "swarm/peers",
                        "swarm/coverage"}
    assert got["swarm/tokens_per_s"] == [(10, 510.0)] and got["swarm/tokens"] == [(10, 2560.0)]
    assert got["swarm/peers"] == [(10, 2.0)] and got["swarm/coverage"] == [(10, 1.0)]
    assert got["swarm/train_loss"][0][1] == pytest.approx(3.9) and got["swarm/val_loss"][0][1] == pytest.approx(4.9)


def test_monitor_watch_logs_one_point_per_read_until_ctrl_c(fake_swarm, tmp_path, capsys):
    fake_swarm["stop_after"] = 4
    logdir = tmp_path / "tb"
    before = signal.getsignal(signal.SIGINT)
    assert main(["monitor", "--initial-peers", MADDR, "--run", str(TINY_RUN), "--interval", "0.05", "--json",
                 "--tensorboard", str(logdir)]) == 0
    assert signal.getsignal(signal.SIGINT) == before and FakeDHT.instances[-1].closed
    got = _scalars(logdir)
    steps = [s for s, _ in got["swarm/tokens"]]
    assert steps == sorted(steps) and steps[:3] == [10, 20, 30] and len(steps) >= 3
    assert [v for _, v in got["swarm/tokens"]][:3] == [2560.0, 5120.0, 7680.0]
    losses = [v for _, v in got["swarm/train_loss"]]
    assert losses[:3] == pytest.approx([3.9, 3.8, 3.7])
    assert len(capsys.readouterr().out.strip().splitlines()) == len(steps)  # one JSON line per read as well


def test_an_unwritable_tensorboard_folder_is_a_one_line_error(fake_swarm, tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    assert main(["monitor", "--initial-peers", MADDR, "--run", str(TINY_RUN), "--once",
                 "--tensorboard", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err
    assert "--tensorboard" in err and len(err.strip().splitlines()) == 1
    assert fake_swarm["n"] == 0  # refused before joining anything
