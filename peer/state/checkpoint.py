"""Periodic local checkpoints of one stage's state, so that a restarted peer resumes where it stopped.

A checkpoint is one file per stage, ``<dir>/stage-<N>.pt``: the worker's ``state_dict()`` with the run id, the run's
name, the stage and the local step. It is written atomically (temporary file, fsync, ``os.replace``), so a crash
mid-save leaves the previous checkpoint intact, and it never goes backwards: a less-trained state does not replace a
more-trained one (``StaleCheckpointError``), and the file replaced is kept as ``stage-<N>.prev.pt``, the fallback when
the main file is missing or damaged. Loading refuses, saying what to do, a checkpoint of another run or stage, and
reads with ``torch.load(weights_only=True)``: a checkpoint folder may be shared or copied, and the restricted
unpickler cannot run code. ``save_checkpoint`` does file I/O: the daemon calls it in an executor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from trainer.config import RunConfig

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint exists but cannot be used (another run or stage, unreadable, or not ours)."""


class StaleCheckpointError(CheckpointError):
    """Saving would replace a checkpoint of a higher step with a less-trained state; nothing was written."""


def checkpoint_path(directory: str | Path, stage: int) -> Path:
    """Where the checkpoint of ``stage`` lives inside ``directory``."""
    if stage < 0:
        raise ValueError(f"stage must be >= 0, got {stage}")
    return Path(directory) / f"stage-{stage}.pt"


def previous_path(directory: str | Path, stage: int) -> Path:
    """Where the checkpoint replaced by the latest save of ``stage`` is kept."""
    return checkpoint_path(directory, stage).with_suffix(".prev.pt")


def save_checkpoint(directory: str | Path, run: RunConfig, stage: int, state: dict[str, Any], *,
                    allow_older: bool = False) -> Path:
    """Write ``state`` (a worker's ``state_dict()``) for ``stage`` of ``run`` atomically; returns the file's path.

    The step recorded is ``state['local_step']`` when the state carries one. Raises OSError when the folder cannot be
    written (the caller logs it and keeps training: a failed checkpoint must not stop the peer), and
    StaleCheckpointError, writing nothing, when the checkpoint there holds a higher step (unless ``allow_older``).
    The replaced checkpoint is kept as ``previous_path``.
    """
    if not isinstance(state, dict):
        raise TypeError(f"state must be the dict returned by StageWorker.state_dict(), got {type(state).__name__}")
    path = checkpoint_path(directory, stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    step = state.get("local_step", -1)
    step = int(step) if isinstance(step, int) else -1
    held = checkpoint_steps(directory, run).get(stage)
    if held is not None and step < held and not allow_older:
        raise StaleCheckpointError(
            f"not replacing checkpoint {path} of step {held} with a less-trained state of step {step}")
    payload = {
        "format": FORMAT_VERSION,
        "run_id": run.run_id,
        "run_name": run.name,
        "stage": int(stage),
        "step": step,
        "saved_at": time.time(),
        "state": state,
    }
    write_atomic(path, payload, previous=previous_path(directory, stage))
    logger.info("checkpoint saved: %s (run %s, stage %d, step %s)", path, run.run_id, stage, payload["step"])
    return path


def write_atomic(path: Path, payload: dict[str, Any], *, previous: Path | None = None) -> None:
    """``torch.save(payload)`` to ``path`` atomically (temporary file, fsync, rename); the file it replaces is moved
    to ``previous`` when given. Raises OSError when the folder cannot be written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        if previous is not None and path.exists():
            os.replace(path, previous)
        os.replace(tmp_name, path)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)


def load_checkpoint(directory: str | Path, run: RunConfig, stage: int) -> dict[str, Any] | None:
    """The saved state of ``stage`` for ``run``, or None when ``directory`` holds no checkpoint for that stage.

    Raises CheckpointError when the file is unreadable, is not an asyncmesh checkpoint, or belongs to another run or
    stage; the message names both runs and says how to proceed.
    """
    path = checkpoint_path(directory, stage)
    prev = previous_path(directory, stage)
    if not path.exists() and not prev.exists():
        return None
    try:
        payload = _read(path) if path.exists() else None
    except CheckpointError as e:
        if not prev.exists():
            raise
        logger.warning("%s; falling back to the previous checkpoint %s", e, prev)
        payload = None
    if payload is None:
        path, payload = prev, _read(prev)
    if payload["run_id"] != run.run_id:
        raise CheckpointError(
            f"checkpoint {path} belongs to run {payload['run_id']} ({payload.get('run_name', '?')!r}), but this peer "
            f"runs {run.run_id} ({run.name!r}): the run settings differ. Use another --checkpoint-dir for this run, "
            f"or delete {path} if that run is over."
        )
    if payload["stage"] != stage:
        raise CheckpointError(
            f"checkpoint {path} holds stage {payload['stage']}, not stage {stage} (was the file renamed?). "
            f"Move it back to {checkpoint_path(directory, payload['stage']).name} or delete it."
        )
    logger.info("checkpoint loaded: %s (stage %d, step %d)", path, stage, payload["step"])
    state: dict[str, Any] = payload["state"]  # a dict: _read checked it
    return state


def checkpoint_steps(directory: str | Path, run: RunConfig) -> dict[int, int]:
    """Step of each usable checkpoint of ``run`` in ``directory`` (stage -> step); the tensors are memory-mapped,
    not read. A stage whose main file is missing or damaged counts its previous checkpoint."""
    steps: dict[int, int] = {}
    for stage in range(run.n_stages):
        for path in (checkpoint_path(directory, stage), previous_path(directory, stage)):
            if not path.exists():
                continue
            try:
                payload = _read(path, mmap=True)
            except CheckpointError as e:
                logger.warning("%s", e)
                continue
            if payload["run_id"] == run.run_id and payload["stage"] == stage:
                steps[stage] = int(payload.get("step", -1))
                break
    return steps


def newest_checkpoint_stage(directory: str | Path, stages: Iterable[int]) -> int | None:
    """Of ``stages`` (those ``checkpoint_steps`` found), the one whose checkpoint was written last: the stage this
    peer served last (steps of different stages are not comparable: stages step at different rates)."""
    times = {}
    for stage in stages:
        for path in (checkpoint_path(directory, stage), previous_path(directory, stage)):
            with contextlib.suppress(OSError):
                times[stage] = path.stat().st_mtime
                break
    return max(times, key=lambda s: times[s]) if times else None


def _read(path: Path, *, mmap: bool = False) -> dict[str, Any]:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # torch raises a variety of pickle/zip/OS errors for a damaged or foreign file
        raise CheckpointError(
            f"cannot read checkpoint {path}: {type(e).__name__}: {e}. Delete it to start from peers or the seeded "
            f"init, or restore it from a backup."
        ) from e
    if not isinstance(payload, dict) or payload.get("format") != FORMAT_VERSION or not isinstance(
        payload.get("state"), dict
    ):
        raise CheckpointError(
            f"{path} is not an asyncmesh checkpoint of format {FORMAT_VERSION}. Delete it or point --checkpoint-dir "
            f"elsewhere."
        )
    if not isinstance(payload.get("run_id"), str) or not isinstance(payload.get("stage"), int):
        raise CheckpointError(f"{path} lacks its run id or stage; delete it or point --checkpoint-dir elsewhere.")
    return payload


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
