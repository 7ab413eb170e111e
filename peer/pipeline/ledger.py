"""Stage 0's sample ledger: every training sample a peer drew stays owed until it is trained, across stage moves and
restarts, together with the data position of the stream it draws from, so that a restart neither skips nor repeats
data.

The daemon owns one ``SampleLedger`` for its whole life: each stage-0 driver draws from it first (``take``), gives
back what it could not train when it stops (``give_back``), and leaves its stream's position there (``attach``,
``position``). The ledger is saved next to the checkpoints with every checkpoint and at exit (``save``) and loaded on
a restart (``load``). What that guarantees after a SIGTERM or a kill -9, and what is lost without a checkpoint folder
(``lost``, the summary's ``samples_lost``, with a warning): docs/data.md, "The data position".
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

logger = logging.getLogger(__name__)

Sample = tuple[torch.Tensor, torch.Tensor]
SAMPLES_FILE = "samples-owed.pt"


class PositionedStream(Protocol):
    """A stage-0 stream whose position can be saved and resumed (``trainer.data.BatchStream``,
    ``trainer.stream.ShardStream``)."""

    key: str
    """Which stream: a position is resumed only by a stream of the same key (same data, shard or seed)."""

    def position_dict(self) -> dict[str, Any]: ...


class SampleLedger:
    """Training samples drawn but not yet trained, owed by this peer (see the module docstring)."""

    def __init__(self) -> None:
        self.owed: deque[Sample] = deque()
        self.handed_back = 0
        """Samples given back by a stage-0 driver that stopped before training them."""
        self.restored = 0
        """Samples loaded from a previous run's file."""
        self.lost = 0
        """Samples that will never be trained (given up at exit with nowhere to keep them)."""
        self.positions: dict[str, dict[str, Any]] = {}
        """Stream key -> its data position when it last stopped (or was loaded from the previous run)."""
        self.last_key: str | None = None
        """The key of the stream read last (a restart prefers to continue it)."""
        self.stream: PositionedStream | None = None
        """The live stream of this peer's stage-0 driver, if any."""

    def attach(self, stream: PositionedStream) -> None:
        """A stage-0 driver starts drawing from ``stream``."""
        self.stream, self.last_key = stream, stream.key

    def detach(self, stream: PositionedStream) -> None:
        """A stage-0 driver stops drawing from ``stream``: keep its position."""
        self.positions[stream.key] = stream.position_dict()
        if self.stream is stream:
            self.stream = None

    def position(self, key: str) -> dict[str, Any] | None:
        """The saved position of the stream ``key``, or None (start it from its beginning)."""
        return self.positions.get(key)

    def _positions_now(self) -> dict[str, dict[str, Any]]:
        now = dict(self.positions)
        if self.stream is not None:
            now[self.stream.key] = self.stream.position_dict()
        return now

    def __len__(self) -> int:
        return len(self.owed)

    def take(self) -> Sample | None:
        """The oldest owed sample, or None."""
        return self.owed.popleft() if self.owed else None

    def give_back(self, samples: list[Sample]) -> None:
        """A stopping driver returns the samples it drew and did not train (they are trained first next time)."""
        self.owed.extendleft(reversed(samples))
        self.handed_back += len(samples)
        if samples:
            logger.info("%d untrained samples kept for the next stage-0 driver of this peer", len(samples))

    def lose_all(self, why: str) -> int:
        """Give up every owed sample (counted in ``lost``); returns how many. The caller warns the operator."""
        n = len(self.owed)
        self.owed.clear()
        self.lost += n
        if n:
            logger.warning("%d training samples lost: %s", n, why)
        return n

    def settle(self, directory: Path | None, *, run_over: bool) -> str | None:
        """At exit: save what is owed in ``directory``, else give it up (unless the run is over: nothing would train
        it then). Returns the operator-facing warning when samples were lost, else None."""
        if directory is not None:
            try:
                self.save(directory)
                return None
            except OSError as e:
                why = f"saving them to {directory} failed: {e}"
        else:
            why = "no --checkpoint-dir to keep them in for the next run"
        if run_over:
            return None
        lost = self.lose_all(why)
        return f"{lost} training samples lost at exit: {why}" if lost else None

    def snapshot(self, in_flight: Sequence[Sample] = ()) -> dict[str, Any]:
        """What ``save`` writes, taken now (on the event loop, at the same moment as the driver's ``in_flight``: the
        untrained samples besides the ledger's own), so that position and owed samples agree."""
        return {"samples": [list(s) for s in (*self.owed, *in_flight)], "positions": self._positions_now(),
                "last": self.last_key}

    def save(self, directory: Path, snapshot: dict[str, Any] | None = None) -> Path:
        """Write a ``snapshot`` (default: taken now) to ``directory`` atomically; nothing to keep removes the file."""
        path = Path(directory) / SAMPLES_FILE
        payload = snapshot if snapshot is not None else self.snapshot()
        if not payload["samples"] and not payload["positions"]:
            path.unlink(missing_ok=True)
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(payload, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        logger.info("%d untrained samples and %d data positions saved to %s", len(payload["samples"]),
                    len(payload["positions"]), path)
        return path

    def load(self, directory: Path) -> int:
        """Add the samples and data positions a previous run of this peer saved in ``directory``; returns how many
        samples (0 if none)."""
        path = Path(directory) / SAMPLES_FILE
        if not path.exists():
            return 0
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
            samples = [(x, y) for x, y in payload["samples"]]
            positions = payload.get("positions") or {}
            if not isinstance(positions, dict) or not all(isinstance(v, dict) for v in positions.values()):
                raise ValueError("positions is not a dict of dicts")
        except Exception as e:  # a damaged file: the samples are lost, say so
            logger.warning("cannot read the untrained samples of the previous run (%s: %s); they are lost and its "
                           "data stream starts again from its beginning", path, e)
            return 0
        self.owed.extend(samples)
        self.restored += len(samples)
        self.positions.update({str(k): v for k, v in positions.items()})
        last = payload.get("last")
        self.last_key = last if isinstance(last, str) else self.last_key
        logger.info("%d untrained samples and %d data positions of the previous run loaded from %s", len(samples),
                    len(positions), path)
        return len(samples)
