"""tools/confine.py on a stand-in for the cgroup v1 cpu hierarchy (a folder with its files): the quota and the
calling thread are written where the kernel reads them, everything is moved back on close, and a machine without a
v1 cpu controller is refused with a message instead of running the attacker unconfined."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tools.confine import PERIOD_US, ConfineError, CpuQuota


def _fake_root(tmp_path: Path) -> Path:
    root = tmp_path / "cpu"
    root.mkdir()
    for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us", "tasks"):
        (root / name).write_text("")
    return root


def test_the_quota_and_the_calling_thread_are_written_and_moved_back(tmp_path: Path):
    root = _fake_root(tmp_path)
    with CpuQuota(0.25, root=root, name="attacker") as quota:
        group = root / "attacker"
        assert (group / "cpu.cfs_period_us").read_text() == str(PERIOD_US)
        assert (group / "cpu.cfs_quota_us").read_text() == str(PERIOD_US // 4)
        assert (group / "tasks").read_text() == str(threading.get_native_id())
        (group / "cpu.stat").write_text("nr_periods 10\nnr_throttled 4\nthrottled_time 2500000000\n")
        assert quota.throttled_s() == 2.5
    assert (root / "tasks").read_text() == str(threading.get_native_id())  # moved back to the parent group


def test_no_v1_cpu_controller_is_refused(tmp_path: Path):
    with pytest.raises(ConfineError):
        CpuQuota(0.5, root=tmp_path)
    with pytest.raises(ValueError):
        CpuQuota(0.0, root=_fake_root(tmp_path))
