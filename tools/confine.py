"""Confine one thread, and every thread and process it starts afterwards, to a share of the machine's CPU.

Why: ``tools/redteam.py`` runs the attacker (its event loop, its DHT process and one libp2p daemon per identity) on
the machine that runs the victims. Unconfined, a flood's stall mixes what the victims spend on hostile streams with
the CPU the attacker's own processes take from them, which a remote attacker (whose daemons burn its own CPU) would
not cause. Confined to a quota, the attacker models a remote one whose traffic still arrives, at the rate that share
of CPU lets it produce (the tool reports that rate, so runs can be compared).

Only the calling thread is moved (cgroup v1 ``tasks`` takes thread ids): the tool's measuring thread stays outside
the quota. New threads and child processes inherit their creator's cgroup. cgroup v2 can only confine whole processes
(threads only in "threaded" subtrees), and ``nice`` does not work across sessions while the kernel's autogroup
scheduling is on (the victims run in sessions of their own), so both are refused with a message rather than
silently giving a weaker confinement. Needs root.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

__all__ = ["CpuQuota", "ConfineError"]

CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")
#: CFS period: short, so a throttled attacker thread that holds the GIL delays the measuring thread by milliseconds
PERIOD_US = 10_000


class ConfineError(RuntimeError):
    """This machine (or this user) cannot confine a thread to a CPU quota."""


class CpuQuota:
    """A cgroup v1 cpu group limited to ``cores`` CPUs (0.25: a quarter of one core), holding the caller's thread.

    ``enter()`` moves the calling thread in; ``close()`` moves every task still in it back to the parent group and
    removes the group. Use as a context manager around the attacker's work.
    """

    def __init__(self, cores: float, *, root: Path = CGROUP_V1_CPU, name: str | None = None) -> None:
        if not cores > 0:
            raise ValueError(f"cores must be > 0, got {cores!r}")
        if not (root / "cpu.cfs_quota_us").exists():
            raise ConfineError(f"no cgroup v1 cpu controller at {root} (cgroup v2 cannot confine one thread of a "
                               "process; nice does not cross autogroups): run unconfined or on a host that has one")
        self.cores, self.root = cores, root
        self.path = root / (name or f"asyncmesh-redteam-{os.getpid()}")
        self.tids: list[int] = []

    def enter(self) -> CpuQuota:
        try:
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(max(1000, round(self.cores * PERIOD_US))))
            tid = threading.get_native_id()
            (self.path / "tasks").write_text(str(tid))
        except OSError as e:
            self.close()
            raise ConfineError(f"cannot set up {self.path}: {e} (root needed)") from e
        self.tids.append(tid)
        return self

    def throttled_s(self) -> float:
        """Seconds the group was held back by its quota so far (cpu.stat throttled_time)."""
        with contextlib.suppress(OSError, ValueError):
            for line in (self.path / "cpu.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "throttled_time":
                    return int(value) / 1e9
        return 0.0

    def close(self) -> None:
        if not self.path.exists():
            return
        with contextlib.suppress(OSError):
            for tid in (self.path / "tasks").read_text().split():
                with contextlib.suppress(OSError):  # a task that exited meanwhile
                    (self.root / "tasks").write_text(tid)
        with contextlib.suppress(OSError):
            self.path.rmdir()

    def __enter__(self) -> CpuQuota:
        return self.enter()

    def __exit__(self, *exc: object) -> None:
        self.close()
