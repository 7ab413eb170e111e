"""Stage 0's sample ledger: every training sample a peer drew stays owed until it is trained, across stage moves and
restarts, and the one way to lose one (no checkpoint folder to keep it in at exit) is counted and said out loud.

The daemon owns one ``SampleLedger`` for its whole life; each stage-0 driver draws from it first (``take``) and gives
back what it could not train when it stops (``give_back``: its re-queued samples and those in flight), so leaving
stage 0 loses nothing. At exit the daemon saves what is still owed next to its checkpoints (``save``), and a restart
loads it (``load``); without a checkpoint folder they are counted in ``lost`` (the summary's ``samples_lost``) with a
WARNING. A peer killed with SIGKILL cannot report: its in-flight samples since the last save are the one loss this
ledger cannot see.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections import deque
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

Sample = tuple[torch.Tensor, torch.Tensor]
SAMPLES_FILE = "samples-owed.pt"


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

    def save(self, directory: Path) -> Path:
        """Write the owed samples to ``directory`` atomically (an empty ledger removes the file)."""
        path = Path(directory) / SAMPLES_FILE
        if not self.owed:
            path.unlink(missing_ok=True)
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save({"samples": [list(s) for s in self.owed]}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        logger.info("%d untrained samples saved to %s for the next run of this peer", len(self.owed), path)
        return path

    def load(self, directory: Path) -> int:
        """Add the samples a previous run of this peer saved in ``directory``; returns how many (0 if none)."""
        path = Path(directory) / SAMPLES_FILE
        if not path.exists():
            return 0
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
            samples = [(x, y) for x, y in payload["samples"]]
        except Exception as e:  # a damaged file: the samples are lost, say so
            logger.warning("cannot read the untrained samples of the previous run (%s: %s); they are lost",
                           path, e)
            return 0
        self.owed.extend(samples)
        self.restored += len(samples)
        logger.info("%d untrained samples of the previous run loaded from %s", len(samples), path)
        return len(samples)
