"""The one copy of a neighbour stage's state a peer keeps, so that a stage whose every peer dies can be restored.

A peer on stage s keeps a copy of stage (s+1) mod n, fetched now and then from a training peer of that stage
(``peer.state.backup``). The copy lives in the peer's checkpoint folder as ``backup-stage-<N>.pt`` (the checkpoint
format, plus who it came from and when it was taken), never in the peer's own ``stage-<N>.pt``, so it neither
replaces the peer's own checkpoint nor steers its stage choice. A peer without a checkpoint folder keeps it in memory.

A copy never goes backwards: ``offer`` keeps the held copy when the new one of the same stage is less advanced. A
copy of another stage (the peer moved, so its neighbour changed) replaces it: the record announces one copy.

The copy is announced in the peer's record (``backup_stage``, ``backup_step``, ``backup_taken_at``), served by its
state server for that stage, and considered by ``peer.state.restore`` when a peer takes a stage that has no donor.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from peer.state.checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    checkpoint_path,
    checkpoint_steps,
    load_checkpoint,
    previous_path,
    write_atomic,
)
from trainer.config import RunConfig

logger = logging.getLogger(__name__)

PREFIX = "backup-stage-"


@dataclass(frozen=True, kw_only=True)
class SpareInfo:
    """Which copy is held: its stage, training step, when it was taken (Unix time) and from which peer."""

    stage: int
    step: int
    taken_at: float
    source: str = ""


def spare_path(directory: str | Path, stage: int) -> Path:
    """Where the copy of ``stage`` lives inside a checkpoint folder."""
    if stage < 0:
        raise ValueError(f"stage must be >= 0, got {stage}")
    return Path(directory) / f"{PREFIX}{stage}.pt"


def _step_of(state: object) -> int:
    step = state.get("local_step", -1) if isinstance(state, dict) else -1
    return int(step) if isinstance(step, int) and not isinstance(step, bool) else -1


class SpareStore:
    """The copy held by this peer: on disk in ``directory`` when given, else in memory. Methods that touch files are
    blocking (call them in an executor); ``info`` is cheap and read by the record and the state server."""

    def __init__(self, run: RunConfig, directory: Path | None) -> None:
        self.run, self.directory = run, directory
        self.info: SpareInfo | None = None
        self._state: dict[str, Any] | None = None  # the copy itself when there is no folder
        self._lock = threading.Lock()  # offer and read run in executor threads
        self.fresh_wanted = asyncio.Event()  # a re-check doubts the held copy: the backup loop takes one soon

    def want_fresh(self) -> None:
        """Ask the backup loop for a fresher copy than the held one (call on the event loop's thread)."""
        self.fresh_wanted.set()

    def scan(self) -> SpareInfo | None:
        """Find the copy a previous life of this peer left in the folder (blocking; unreadable files are skipped)."""
        if self.directory is None or not self.directory.is_dir():
            return None
        best: SpareInfo | None = None
        for stage in range(self.run.n_stages):
            path = spare_path(self.directory, stage)
            if not path.exists():
                continue
            try:
                payload = _read(path, self.run, stage, mmap=True)
            except CheckpointError as e:
                logger.warning("%s", e)
                continue
            info = SpareInfo(stage=stage, step=int(payload["step"]), taken_at=float(payload["taken_at"]),
                             source=str(payload.get("source", "")))
            if best is None or info.taken_at > best.taken_at:
                best = info
        self.info = best
        if best is not None:
            logger.info("holding a copy of stage %d at step %d taken %.0f s ago", best.stage, best.step,
                        time.time() - best.taken_at)
        return best

    def offer(self, stage: int, state: dict[str, Any], *, source: str, taken_at: float) -> bool:
        """Keep ``state`` as the copy of ``stage`` unless the held copy of that stage is more advanced (blocking).
        Returns whether it was kept. Raises OSError when the folder cannot be written."""
        step = _step_of(state)
        with self._lock:
            held = self.info
            if held is not None and held.stage == stage and step < held.step:
                logger.info("keeping the copy of stage %d at step %d: the new one (step %d) is less advanced", stage,
                            held.step, step)
                return False
            info = SpareInfo(stage=stage, step=step, taken_at=taken_at, source=source)
            if self.directory is not None:
                payload = {"format": FORMAT_VERSION, "run_id": self.run.run_id, "run_name": self.run.name,
                           "stage": int(stage), "step": step, "saved_at": time.time(), "taken_at": float(taken_at),
                           "source": source, "state": state}
                write_atomic(spare_path(self.directory, stage), payload)
                if held is not None and held.stage != stage:
                    try:
                        os.unlink(spare_path(self.directory, held.stage))
                    except FileNotFoundError:
                        pass
            else:
                self._state = state
            self.info = info
            return True

    def read(self, stage: int) -> dict[str, Any] | None:
        """The held copy of ``stage`` (blocking), or None when the copy held is of another stage or unreadable."""
        with self._lock:
            info = self.info
            if info is None or info.stage != stage:
                return None
            if self.directory is None:
                return self._state
            try:
                state: dict[str, Any] = _read(spare_path(self.directory, stage), self.run, stage)["state"]  # checked
                return state
            except CheckpointError as e:
                logger.warning("%s", e)
                return None


def _read(path: Path, run: RunConfig, stage: int, *, mmap: bool = False) -> dict[str, Any]:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # torch raises a variety of pickle/zip/OS errors for a damaged or foreign file
        raise CheckpointError(f"cannot read the neighbour copy {path}: {type(e).__name__}: {e}; it is ignored") from e
    ok = (isinstance(payload, dict) and payload.get("format") == FORMAT_VERSION
          and isinstance(payload.get("state"), dict) and payload.get("run_id") == run.run_id
          and payload.get("stage") == stage and isinstance(payload.get("step"), int)
          and isinstance(payload.get("taken_at"), float))
    if not ok:
        raise CheckpointError(f"{path} is not a neighbour copy of stage {stage} of this run; it is ignored")
    checked: dict[str, Any] = payload
    return checked


def adopt_checkpoint(spares: SpareStore, directory: Path | None, run: RunConfig, stage: int) -> SpareInfo | None:
    """Offer this peer's checkpoint of another stage than ``stage`` (the one it took) as its copy (blocking).

    A peer that comes back on another stage than before (a whole-swarm restart, where the capacity rule placed it
    elsewhere) may hold the most advanced state of its former stage; announced as a copy, the peers restoring that
    stage rank it with the rest instead of leaving it unused on this disk. It replaces the copy held only when that
    one is older (by step for the same stage, by time for another); the next neighbour backup replaces it in turn.
    Returns what was adopted, or None."""
    if directory is None:
        return None
    others = {t: step for t, step in checkpoint_steps(directory, run).items() if t != stage and step > 0}
    if not others:
        return None
    former = max(others, key=lambda t: others[t])
    path = checkpoint_path(directory, former)
    taken_at = (path if path.exists() else previous_path(directory, former)).stat().st_mtime
    held = spares.info
    if held is not None and (held.step >= others[former] if held.stage == former else held.taken_at >= taken_at):
        return None
    try:
        state = load_checkpoint(directory, run, former)
    except CheckpointError as e:
        logger.warning("%s", e)
        return None
    if state is None or not spares.offer(former, state, source="this peer's checkpoint", taken_at=taken_at):
        return None
    logger.info("offering this peer's checkpoint of stage %d (step %d) to the swarm as a copy", former,
                others[former])
    return spares.info


def spare_fields(info: SpareInfo | None) -> dict[str, Any]:
    """The record fields announcing ``info`` (``PeerRecord.backup_*``); empty when no copy is held."""
    if info is None or info.step < 0:
        return {}
    return {"backup_stage": info.stage, "backup_step": info.step, "backup_taken_at": info.taken_at}
