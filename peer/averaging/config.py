"""Timing and safety limits of averaging over the network, shared by the background loop and the sync barrier."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.codecs.names import RUN_CODECS


@dataclass(frozen=True, kw_only=True)
class NetAveragingConfig:
    """Timing and safety limits of averaging over the network (peer-local; the round clock is the run's period_s)."""

    collect_fraction: float = 0.6
    """Fraction of the period spent exchanging parts; the rest absorbs clock skew and the apply."""
    max_window_periods: float = 4.0
    """The exchange window follows the measured exchanges (``AveragingLoop.window_s``): twice the time recent rounds
    took to collect every partner's part, at least collect_fraction x period_s, at most this many periods (and at
    most the run's timeout_s). A round that missed its quorum for lack of time doubles it."""
    initiator_grace: float = 0.5
    """Fraction of the exchange window after which the larger-id peer calls a silent smaller-id peer itself."""
    call_timeout_s: float = 10.0
    """Timeout of one exchange call (capped by the round's deadline)."""
    swarm_timeout_s: float = 3.0
    """Timeout of reading the stage's peers from the DHT."""
    view_refresh_s: float = 1.0
    """The stage's peers are re-read from the DHT this often, in the background of the round clock."""
    worker_timeout_s: float = 30.0
    """Timeout of a begin/finish call on the compute thread."""
    clock_skew_s: float = 1.0
    """Accept parts for the next round this many seconds before it starts (peer clocks differ)."""
    max_rel_distance: float = 1.0
    """Reject a part farther from our values than this times their L2 norm (plus the rms allowance below)."""
    max_rms_distance: float = 0.1
    """Absolute allowance per coordinate (rms) for the distance check; lets zero-initialised tensors average."""
    outlier_factor: float = 4.0
    """Drop a part farther from the round's coordinate-wise median than this times the median distance (plus below)."""
    outlier_rms: float = 0.01
    """Absolute allowance per coordinate (rms) of the outlier check; lets parts that differ by codec noise through."""
    quorum_recent_s: float = 300.0
    """Robust aggregators: a round needs 2b + 1 contributions, b the liars tolerated among the partners that sent a
    valid part within this many seconds (0: only those of the round itself count). Long against the gaps of a loaded
    honest replica: liars always answer, so a short memory counts mostly them, and their rounds pass."""
    quorum_startup_s: float = 120.0
    """Robust aggregators: for this long after the loop starts every announced partner counts for the quorum, heard
    or not. At start nothing tells a silent record from an honest replica that has not been heard yet, and counting
    only the heard would count the liars, who answer first (a silent record delays averaging this long, no more)."""
    lone_bound: float | None = 0.05
    """Robust aggregators: a round with fewer contributions than the stage's full quorum (2b + 1 of the partners asked
    and us) moves our values by at most half this times their norm, per tensor; a lone partner's difference from ours
    is thereby clipped to this (None: not bounded; for tests of the exchange itself)."""
    member_refresh_s: float = 2.0
    """A part from a peer not in our DHT view re-reads the view at most this often before it is refused."""
    sync_timeout_s: float = 60.0
    """Blocking average: how long the barrier waits for the stage's other replicas."""
    sync_grace_s: float = 1.0
    """Blocking average: the larger-id replica calls a silent smaller-id one after this (its handler then waits)."""
    sync_codec: str = "none"
    """Blocking average: wire codec ('none' keeps the sum exact, as a synchronous baseline must)."""
    sync_max_norm_ratio: float = 100.0
    """Blocking average: reject a part whose norm exceeds ours by this factor (or 1.0, whichever is larger)."""
    sync_digest_rtol: float = 1e-5
    """Blocking average: replicas whose weight digests differ by more than this (relative, peer.averaging.fork) have
    forked, and the odd one out loads the state of one that holds the others' weights."""
    sync_resync_s: float = 30.0
    """Blocking average: how long a forked replica keeps trying to fetch that state before the next barrier's check."""

    def __post_init__(self) -> None:
        for name in ("call_timeout_s", "swarm_timeout_s", "view_refresh_s", "worker_timeout_s", "sync_timeout_s",
                     "sync_grace_s", "max_rel_distance", "sync_max_norm_ratio", "sync_digest_rtol", "sync_resync_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"averaging.{name} must be positive, got {getattr(self, name)}")
        if not 0 < self.collect_fraction < 1 or not 0 < self.initiator_grace < 1:
            raise ValueError("collect_fraction and initiator_grace must be in (0, 1)")
        if self.max_window_periods < self.collect_fraction:
            raise ValueError("max_window_periods must be at least collect_fraction")
        if self.clock_skew_s < 0 or self.max_rms_distance < 0:
            raise ValueError("clock_skew_s and max_rms_distance must be >= 0")
        if min(self.quorum_recent_s, self.quorum_startup_s) < 0 or not (self.lone_bound is None
                                                                          or self.lone_bound > 0):
            raise ValueError("quorum_recent_s and quorum_startup_s must be >= 0 and lone_bound positive")
        if self.outlier_factor < 1 or self.outlier_rms < 0 or self.member_refresh_s < 0:
            raise ValueError("outlier_factor must be >= 1; outlier_rms and member_refresh_s >= 0")
        if self.sync_codec not in RUN_CODECS:
            raise ValueError(f"sync_codec must be one of {RUN_CODECS}, got {self.sync_codec!r}")
