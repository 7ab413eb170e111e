"""A peer's life: the one vocabulary of its states, and the one object that moves it from one to the next.

``PeerState`` names every state a peer can be in, with the exact strings its DHT record and ``/status`` carry (other
peers and tools read them). ``Lifecycle`` is owned by the daemon: it alone changes the state, refuses a transition
the life of a peer does not have, logs each one, and tells its observers (``PeerMetrics`` shows the state, it does
not decide on it). What a peer does depends on ``Lifecycle`` (``serving``), never on what the metrics show.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import StrEnum

logger = logging.getLogger(__name__)

__all__ = ["IllegalTransition", "Lifecycle", "PeerState", "StateObserver"]


class PeerState(StrEnum):
    """What a peer is doing; the value is what its record, ``/status`` and ``/metrics`` say."""

    JOINING = "joining"
    """Joining the DHT and choosing a stage."""
    LOADING_STATE = "loading_state"
    """A stage is claimed; its state is being loaded (donors, a checkpoint or the seeded init)."""
    TRAINING = "training"
    """Serving its stage: the only state in which a peer receives micro-batches."""
    DRAINING = "draining"
    """Leaving its stage (a stage move claimed, or shutting down): finishing what is in flight."""
    STOPPED = "stopped"
    """Gone: its record is withdrawn."""

    @property
    def label(self) -> str:
        """The state in words, as the start-up view of ``swarm`` shows it ('loading state')."""
        return self.value.replace("_", " ")

    @property
    def short(self) -> str:
        """The state in a dashboard table's narrow column."""
        return _SHORT[self]

    @classmethod
    def parse(cls, value: object) -> PeerState | None:
        """The state named by ``value`` (a string read from the network), or None when it names none."""
        if not isinstance(value, str):
            return None
        try:
            return cls(value)
        except ValueError:
            return None


_SHORT = {PeerState.JOINING: "join", PeerState.LOADING_STATE: "load", PeerState.TRAINING: "train",
          PeerState.DRAINING: "drain", PeerState.STOPPED: "stop"}

#: the transitions a peer's life has: join -> load -> train, a move (train -> drain -> load, or back to train when it
#: backs off), and a drain then a stop from anywhere (a shutdown may come at any point of start-up)
TRANSITIONS: dict[PeerState, frozenset[PeerState]] = {
    PeerState.JOINING: frozenset({PeerState.LOADING_STATE, PeerState.DRAINING, PeerState.STOPPED}),
    PeerState.LOADING_STATE: frozenset({PeerState.TRAINING, PeerState.DRAINING, PeerState.STOPPED}),
    PeerState.TRAINING: frozenset({PeerState.DRAINING, PeerState.STOPPED}),
    PeerState.DRAINING: frozenset({PeerState.TRAINING, PeerState.LOADING_STATE, PeerState.STOPPED}),
    PeerState.STOPPED: frozenset(),
}

#: called after every transition with the new state and, when draining, the seconds the drain may take
StateObserver = Callable[[PeerState, "float | None"], None]


class IllegalTransition(RuntimeError):
    """A transition the life of a peer does not have (a bug in the daemon, never caused by the network)."""


class Lifecycle:
    """The state of one peer. ``enter(state)`` moves it; entering the state it is in already changes nothing.

    Args:
        observers: called after each transition (``PeerMetrics.observe_state``); more with ``observe``.
    """

    def __init__(self, *observers: StateObserver) -> None:
        self._state = PeerState.JOINING
        self._observers: list[StateObserver] = list(observers)
        self.stage: int | None = None  # the stage claimed (logs only)

    @property
    def state(self) -> PeerState:
        return self._state

    @property
    def serving(self) -> bool:
        """The peer serves its stage: it takes micro-batches, generation requests and low-priority work."""
        return self._state is PeerState.TRAINING

    def observe(self, observer: StateObserver) -> None:
        """Call ``observer`` after every later transition, and once now with the current state."""
        self._observers.append(observer)
        observer(self._state, None)

    def enter(self, state: PeerState, *, stage: int | None = None) -> None:
        """Move to ``state`` (``stage``: the stage claimed, when entering LOADING_STATE). Raises IllegalTransition
        for a transition not in ``TRANSITIONS``."""
        self._move(state, stage=stage, drain_s=None)

    def drain(self, timeout_s: float) -> None:
        """Enter DRAINING for a shutdown that finishes within ``timeout_s`` (the views count it down)."""
        self._move(PeerState.DRAINING, stage=None, drain_s=max(0.0, timeout_s))

    def _move(self, state: PeerState, *, stage: int | None, drain_s: float | None) -> None:
        state = PeerState(state)
        if stage is not None:
            self.stage = stage
        if state is self._state and drain_s is None:
            return
        if state is not self._state and state not in TRANSITIONS[self._state]:
            raise IllegalTransition(f"a peer cannot go from {self._state} to {state}; allowed from {self._state}: "
                                    f"{', '.join(sorted(TRANSITIONS[self._state])) or 'none'}")
        old, self._state = self._state, state
        if old is not state:
            logger.info("peer state %s -> %s%s", old, state, "" if self.stage is None else f" (stage {self.stage})")
        for observer in self._observers:
            observer(state, drain_s)
