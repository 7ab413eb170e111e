"""Swarm progress: tokens, step against total_steps, ETA, validation trend; in records, monitor, status, dashboards."""

from __future__ import annotations

import builtins
import json

import pytest
from rich.console import Console

from peer.cli import monitor as cmd_monitor
from peer.cli import status as cmd_status
from peer.errors import UserError
from peer.lifecycle import PeerState
from peer.membership.records import PeerRecord, RecordError
from peer.ops.dashboard import render_peer, render_swarm
from peer.ops.metrics import PeerMetrics
from peer.ops.progress import PeerFigures, SwarmProgress, from_records, trend


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_progress_sums_stage0_tokens_keeps_departed_peers_and_estimates_the_eta():
    clock = Clock()
    p = SwarmProgress(run_name="tiny", total_steps=1000, window_s=60, clock=clock)
    v = p.update([PeerFigures("a", 0, 100, 5000, None), PeerFigures("b", 0, 90, 3000, None),
                  PeerFigures("c", 1, 400, 99999, None)])  # stage 1 counts each token again: not summed
    assert v["tokens"] == 8000 and v["step"] == 100 and v["eta_s"] is None and v["run_name"] == "tiny"
    clock.t = 10
    v = p.update([PeerFigures("a", 0, 120, 6000, 4.0)])  # b left: its 3000 tokens still count
    assert v["tokens"] == 9000 and v["step"] == 120 and v["fraction"] == pytest.approx(0.12)
    assert v["steps_per_s"] == pytest.approx(2.0) and v["eta_s"] == pytest.approx(440.0)
    assert v["val_loss"] == 4.0 and v["val_trend"] is None
    for i, val in enumerate((3.9, 3.9, 3.8, 3.7, 3.6)):  # repeats of one evaluation are one point
        clock.t += 10
        v = p.update([PeerFigures("a", 0, 130 + 10 * i, 7000, val)])
    assert v["val_loss_history"] == [4.0, 3.9, 3.8, 3.7, 3.6] and v["val_trend"] is None  # 5 < 6 points
    clock.t += 10
    v = p.update([PeerFigures("a", 0, 1000, 9000, 3.5)])
    assert v["val_trend"] == "falling" and v["eta_s"] == 0.0
    assert trend([1, 1, 1, 1, 1, 1]) == "flat" and trend([1, 1, 1, 2, 2, 2]) == "rising"


def test_records_carry_the_optional_progress_fields_and_read_records_without_them():
    r = PeerRecord(peer_id="QmA", stage=0, throughput=1.0, queue=0, version=5, state="training", tokens=1234,
                   val_loss=3.5)
    assert PeerRecord.from_value("QmA", r.to_value()) == r
    old = r.to_value()
    del old["tokens"], old["val_loss"]  # a record announced by a peer without these fields
    parsed = PeerRecord.from_value("QmA", old)
    assert parsed.tokens == 0 and parsed.val_loss is None
    for bad in ({"tokens": -1}, {"tokens": 1.5}, {"val_loss": float("nan")}, {"val_loss": "x"}):
        with pytest.raises(RecordError):
            PeerRecord.from_value("QmA", {**r.to_value(), **bad})
    assert from_records([r]) == [PeerFigures("QmA", 0, 5, 1234, 3.5)]


def _snap(step: int, tokens: int, swarm: dict | None) -> dict:
    m = PeerMetrics("12D3KooWpeerAAAAAAAA", stage=0)
    m.observe_state(PeerState.TRAINING)
    m.local_step, m.tokens_total, m.run_name = step, tokens, "tiny"
    m.swarm_progress = swarm
    return m.snapshot()


def test_status_monitor_and_both_dashboards_show_the_swarm_progress(capsys):
    prog = SwarmProgress(run_name="tiny", total_steps=2000)
    view = prog.update([PeerFigures("a", 0, 120, 1_200_000, 4.31)])
    snap = _snap(120, 1_200_000, view)
    line = cmd_status.summary(snap)
    assert "run tiny · step 120/2000 (6%)" in line and "1.2M tokens" in line and "val 4.310" in line
    assert "\n" not in line
    console = Console(record=True, width=80)
    console.print(render_peer(snap, "tiny"))
    console.print(render_swarm([{**snap, "name": "peer0"}, {"name": "peer1", "phase": "starting"}], "tiny"))
    text = console.export_text()
    assert text.count("step 120/2000") == 2, text
    rec = PeerRecord(peer_id="QmA", stage=0, throughput=1.0, queue=0, version=120, state="training",
                     tokens=1_200_000, val_loss=4.31)
    mview = cmd_monitor.swarm_view({"QmA": rec}, 2, "rid", view)
    assert json.loads(json.dumps(mview))["progress"]["step"] == 120
    console = Console(record=True, width=80)
    console.print(cmd_monitor.render(mview))
    assert "step 120/2000" in console.export_text()
    scalars = cmd_monitor.tensorboard_scalars(mview)
    assert scalars["swarm/tokens"] == 1_200_000 and scalars["swarm/val_loss"] == pytest.approx(4.31)


def test_tensorboard_is_an_optional_extra(monkeypatch, tmp_path):
    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kw):
        if name == "torch.utils.tensorboard":
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(UserError, match=r"pip install 'asyncmesh\[tensorboard\]'"):
        cmd_monitor.tensorboard_writer(str(tmp_path / "tb"))
    monkeypatch.undo()
    pytest.importorskip("tensorboard")
    writer = cmd_monitor.tensorboard_writer(str(tmp_path / "tb"))
    cmd_monitor._log_tb(type("A", (), {"tb_writer": writer})(), {"time": 1.0, "loss": 3.0, "progress": {"step": 5}})
    writer.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
