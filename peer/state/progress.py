"""Which state a peer starts a stage from: the most advanced one it can get, by training progress (pure functions).

Every source a joining or restarting peer can take a stage's state from is a ``StateSource``: a donor of the stage
(its announced state version), its own checkpoint of the stage, a copy of the stage kept by a neighbour (see
``peer.state.spare``), and the run's seeded init (step 0). Progress is the stage's ``local_step`` (optimiser steps
applied). ``most_advanced`` picks the highest; on a tie a live donor wins over a file (it is averaged with the stage's
other replicas and is what the swarm trains on now), and a file over the init. A less-trained source is never
preferred over a more-trained one, whatever the order in which they were found.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

#: tie-break order of source kinds at equal progress (lower wins)
KIND_RANK = {"donor": 0, "checkpoint": 1, "spare": 2, "init": 3}


@dataclass(frozen=True, kw_only=True)
class StateSource:
    """One place a stage's state can come from."""

    kind: str
    """One of KIND_RANK: 'donor', 'checkpoint', 'spare' (a neighbour's copy) or 'init'."""
    step: int
    """Its training progress: the stage's local_step (-1 when unknown, which ranks below the init)."""
    label: str = ""
    """Who or where (a peer id, a file) for the log line."""

    def __post_init__(self) -> None:
        if self.kind not in KIND_RANK:
            raise ValueError(f"kind must be one of {sorted(KIND_RANK)}, got {self.kind!r}")
        if self.step < -1:
            raise ValueError(f"step must be >= -1, got {self.step}")


def progress_key(source: StateSource) -> tuple[int, int]:
    """Sort key: more progress first, then the kind's tie-break rank."""
    return (-source.step, KIND_RANK[source.kind])


def most_advanced(sources: Iterable[StateSource]) -> StateSource:
    """The source with the most training progress (ties: donor > checkpoint > spare > init). Needs one source."""
    ranked = rank(sources)
    if not ranked:
        raise ValueError("no state source to choose from")
    return ranked[0]


def rank(sources: Iterable[StateSource]) -> list[StateSource]:
    """All sources, most advanced first (stable for equal keys)."""
    return sorted(sources, key=progress_key)
