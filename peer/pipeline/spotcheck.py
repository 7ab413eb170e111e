"""Spot checks of the next stage: a micro-batch sent to two of its replicas, and their gradients compared.

A stage trains on the gradient a next-stage peer returns, and routing favours fast answers, so a peer returning
fabricated gradients quickly would train everyone upstream. The same ``Forward`` therefore also goes to a second
replica (the *partner*, a trusted one when there is one: a hop cannot tell a check from ordinary traffic), and the two
gradients must agree in direction and norm before either is trained on. A hop not yet trusted is checked on every
micro-batch and held to a share of the traffic, a trusted one on a random ``fraction``, every hop while the gradient
norm bound is (re)learnt. A next stage with a single replica cannot be checked this way; where it is the last stage,
the re-checks from the held copy of it (peer.pipeline.recheck) can, and their verdicts are kept here too. The rules
and what they were set from: docs/security.md, "Spot checks of the next stage".
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, kw_only=True)
class SpotCheckConfig:
    """How often and how strictly a stage checks its next hops."""

    fraction: float = 0.05
    """Share of a trusted hop's micro-batches also sent to a partner replica."""
    trust_after: int = 4
    """Checks a hop must pass before its gradients are applied unchecked."""
    untrusted_share: float = 0.25
    """Most of our micro-batches that untrusted hops together get while a trusted hop exists."""
    min_cosine: float = 0.1
    """Two gradients of one micro-batch whose cosine similarity is lower disagree (noise: |cosine| ~0.01 here)."""
    max_norm_ratio: float = 16.0
    """Two gradients of one micro-batch whose norms differ by a larger factor disagree (loose: honest replicas differ
    most early in training, and the norm bound and gradient clipping bound the magnitude anyway)."""
    ban_after: int = 3
    """Failed checks in a row after which a hop is banned."""
    blame_span_s: float = 5.0
    """Failed spot checks blamed by the hops' history (no held copy could decide) ban a hop only when they span this
    long: disagreements of micro-batches in flight together are one moment of one replica, which a loss spike of an
    honest one makes too (a red-team run banned an honest stage-1 replica 6 s into training for 3 disagreements
    within 74 ms with its honest partner)."""
    one_copy_ban_s: float = 30.0
    """Failed re-checks from the held copy ban a hop only when a stale copy cannot explain them: judged against two
    different copies, or one of them proven without a copy (a signed lie), or the hop failing every re-check against
    one copy for this long (a lone hop whose stage nobody else can give a fresher copy of). An honest stage in a
    loss spike disagrees with a copy a few steps old and agrees again with a fresher one (docs/security.md,
    "Re-checks from the held copy")."""
    ban_s: float = 600.0
    """How long a hop caught returning fabricated gradients is banned from our routing."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0 or not 0.0 < self.untrusted_share <= 1.0:
            raise ValueError("SpotCheckConfig: fraction must be in [0, 1] and untrusted_share in (0, 1]")
        if self.trust_after < 0 or self.ban_after < 1 or min(self.ban_s, self.blame_span_s, self.one_copy_ban_s) < 0:
            raise ValueError("SpotCheckConfig: trust_after >= 0, ban_after >= 1, and ban_s, blame_span_s and "
                             "one_copy_ban_s >= 0 are required")
        if not -1.0 <= self.min_cosine < 1.0 or self.max_norm_ratio < 1.0:
            raise ValueError("SpotCheckConfig: min_cosine must be in [-1, 1) and max_norm_ratio >= 1")


@dataclass
class _Hop:
    first_seen: float
    passed: int = 0
    failed: int = 0
    strikes: int = 0  # failed checks in a row
    since: float = 0.0  # when the first of them came
    rechecked: int = 0  # re-checks from the held copy passed since the last failed one (peer.pipeline.recheck)
    re_strikes: int = 0  # failed re-checks in a row (passed spot checks do not reset them: colluders vouch so)
    re_copies: set[int] = field(default_factory=set)  # the copies (their steps) those failures were judged against
    re_proven: bool = False  # one of them was proven without a copy
    re_since: float = 0.0  # when the first of them came


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative distance of two gradients: 0 equal, 1 one of them zero, 2 opposite (inf: not finite)."""
    a, b = a.float(), b.float()
    scale = max(float(torch.linalg.vector_norm(a)), float(torch.linalg.vector_norm(b)))
    if scale == 0.0:
        return 0.0
    d = float(torch.linalg.vector_norm(a - b)) / scale
    return d if d == d else float("inf")


def agreement(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(cosine similarity, ratio of the larger norm to the smaller) of two gradients; a zero or non-finite gradient
    gives (-1, inf)."""
    a, b = a.float().flatten(), b.float().flatten()
    na, nb = float(torch.linalg.vector_norm(a)), float(torch.linalg.vector_norm(b))
    if not (na > 0 and nb > 0 and na < float("inf") and nb < float("inf")):
        return -1.0, float("inf")
    return float(torch.dot(a, b)) / (na * nb), max(na, nb) / min(na, nb)


def quantiles(name: str, values: Sequence[float]) -> dict[str, float | None]:
    """``{name}_min``, ``_p10``, ``_p50``, ``_p90``, ``_max`` of ``values`` (NaNs left out; None when empty): the
    figures /status gives of recent checks."""
    vs = sorted(v for v in values if not math.isnan(v))
    return {f"{name}_{label}": vs[min(len(vs) - 1, int(q * len(vs)))] if vs else None
            for label, q in (("min", 0.0), ("p10", 0.1), ("p50", 0.5), ("p90", 0.9), ("max", 1.0))}


class SpotChecker:
    """Trust in the next stage's hops, earned by checks. ``count(name)`` is told of every check and its outcome."""

    def __init__(self, config: SpotCheckConfig | None = None, *, count: Callable[[str], None] = lambda n: None,
                 rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or SpotCheckConfig()
        self.count, self.rng, self.clock = count, rng or random.Random(), clock
        self._hops: dict[str, _Hop] = {}
        self.seen: deque[tuple[float, float, float]] = deque(maxlen=512)  # (cosine, norm ratio, distance): /status
        self.extremes = [1.0, 1.0, 0.0, 0]  # since start: lowest cosine, highest norm ratio, largest distance, checks

    def _hop(self, peer_id: str) -> _Hop:
        hop = self._hops.get(peer_id)
        if hop is None:
            if len(self._hops) >= 4096:  # bounded: forget the hop with the least history
                del self._hops[min(self._hops, key=lambda p: self._hops[p].passed + self._hops[p].failed)]
            hop = self._hops[peer_id] = _Hop(first_seen=self.clock())
        return hop

    def trusted(self, peer_id: str) -> bool:
        return self._hop(peer_id).passed >= self.config.trust_after

    def wants_check(self, peer_id: str, *, learning: bool = False) -> bool:
        """Whether a training micro-batch sent to ``peer_id`` is also sent to a partner (``learning``: the gradient
        norm bound is being learnt, so everything is checked)."""
        return learning or not self.trusted(peer_id) or self.rng.random() < self.config.fraction

    def recheck_trusted(self, peer_id: str) -> bool:
        """Whether ``peer_id`` passed ``trust_after`` re-checks from the held copy since its last failed one."""
        return self._hop(peer_id).rechecked >= self.config.trust_after

    def wants_recheck(self, peer_id: str, *, fraction: float, learning: bool = False, busy: bool = False) -> bool:
        """Whether a training micro-batch sent to ``peer_id`` is re-computed from the held copy of its stage
        (peer.pipeline.recheck): every one until the hop passed ``trust_after`` re-checks in a row (and while the
        norm bound is learnt), then a random ``fraction``, none of those while the compute queue is ``busy``."""
        if learning or not self.recheck_trusted(peer_id):
            return True
        return not busy and self.rng.random() < fraction

    def recheck_verdict(self, peer_id: str, passed: bool, *, copy: int | None) -> bool:
        """Record a re-check of ``peer_id``'s work against the held copy of its stage (``copy``: that copy's step;
        None for a failure proven without a copy); returns whether it is now to be banned. The copy is no replica
        that could be the liar, so the hop alone takes the blame: a failure costs it its trust (spot checks' and
        re-checks'), ``ban_after`` failed re-checks in a row ban it once a stale copy cannot explain them
        (``one_copy_ban_s``), and a passed one counts as a passed check."""
        hop = self._hop(peer_id)
        if passed:
            hop.passed += 1
            hop.rechecked += 1
            hop.strikes = hop.re_strikes = 0
            self.count("recheck_passed")
            return False
        hop.rechecked = 0
        if hop.re_strikes == 0:
            hop.re_copies, hop.re_proven, hop.re_since = set(), False, self.clock()
        if copy is None:
            hop.re_proven = True
        elif len(hop.re_copies) < 2:
            hop.re_copies.add(copy)
        return self._strike(hop, recheck=True)

    def one_copy_only(self, peer_id: str) -> bool:
        """Whether ``peer_id``'s failed re-checks in a row were all judged against one copy (a fresher copy would
        tell a stale copy from a liar: worth taking one now)."""
        hop = self._hop(peer_id)
        return hop.re_strikes > 0 and not hop.re_proven and len(hop.re_copies) < 2

    def partner(self, primary: str, candidates: Sequence[str]) -> str | None:
        """A second replica for a check of ``primary``: a trusted one when there is one, else any other."""
        others = [c for c in candidates if c != primary]
        if not others:
            return None
        trusted = [c for c in others if self.trusted(c)]
        return self.rng.choice(trusted or others)

    def cap_weights(self, peer_ids: Sequence[str], weights: Sequence[float]) -> list[float]:
        """Scale untrusted hops' routing weights down so that together they get at most ``untrusted_share`` of the
        choices while a trusted hop exists (a fast fabricator cannot win most of the traffic)."""
        trusted = [self.trusted(p) for p in peer_ids]
        w_t = sum(w for w, t in zip(weights, trusted, strict=True) if t)
        w_u = sum(w for w, t in zip(weights, trusted, strict=True) if not t)
        share = self.config.untrusted_share
        if w_t <= 0 or w_u <= 0 or share >= 1.0 or w_u / (w_t + w_u) <= share:
            return list(weights)
        scale = share / (1 - share) * w_t / w_u
        return [w if t else w * scale for w, t in zip(weights, trusted, strict=True)]

    def judge(self, a: str, grad_a: torch.Tensor, b: str, grad_b: torch.Tensor) -> tuple[str | None, bool]:
        """Compare the two gradients of one micro-batch: (the hop that takes the blame, None when they agree;
        whether it is now to be banned): ``compare``, then ``blame`` when they disagree."""
        if self.compare(a, grad_a, b, grad_b):
            return None, False
        return self.blame(a, b)

    def compare(self, a: str, grad_a: torch.Tensor, b: str, grad_b: torch.Tensor) -> bool:
        """Whether the two gradients of one micro-batch agree (then both hops count a passed check); a disagreement
        is counted, and blames nobody yet."""
        cos, ratio = agreement(grad_a, grad_b)
        d = distance(grad_a, grad_b)
        self.seen.append((cos, ratio, d))
        ext = self.extremes
        ext[0], ext[1], ext[2], ext[3] = min(ext[0], cos), max(ext[1], ratio), max(ext[2], d), ext[3] + 1
        ha, hb = self._hop(a), self._hop(b)
        if cos >= self.config.min_cosine and ratio <= self.config.max_norm_ratio:
            for hop in (ha, hb):
                hop.passed += 1
                hop.strikes = 0
            self.count("spotcheck_passed")
            return True
        self.count("spotcheck_failed")
        return False

    def blame(self, a: str, b: str) -> tuple[str, bool]:
        """Two hops disagreed and nothing better can tell which is wrong: (the one blamed, whether it is now to be
        banned). The hop with fewer passed checks (on a tie, the one met later) is blamed and loses its trust;
        ``ban_after`` blames in a row ban it once they span ``blame_span_s``, so one honest outlier bans nobody. A
        patient liar with more history than an honest partner gets the partner blamed: the servicer asks the held
        copy first when it has one (``peer.pipeline.recheck.Rechecks.arbitrate``)."""
        ha, hb = self._hop(a), self._hop(b)
        caught = a if (ha.passed, -ha.first_seen) < (hb.passed, -hb.first_seen) else b
        return caught, self._strike(self._hops[caught], recheck=False)

    def _strike(self, hop: _Hop, *, recheck: bool) -> bool:
        """A failed check of ``hop`` (``recheck``: from the held copy, else a spot check): its trust is gone and one
        more strike of that kind counted; whether that makes ``ban_after`` in a row (then counted afresh)."""
        hop.failed += 1
        hop.passed = 0
        if recheck:
            self.count("recheck_failed")
            hop.re_strikes += 1
            conclusive = (hop.re_proven or len(hop.re_copies) >= 2
                          or self.clock() - hop.re_since >= self.config.one_copy_ban_s)
            ban = hop.re_strikes >= self.config.ban_after and conclusive
            hop.re_strikes = 0 if ban else hop.re_strikes
        else:
            hop.since = self.clock() if hop.strikes == 0 else hop.since
            hop.strikes += 1
            ban = hop.strikes >= self.config.ban_after and self.clock() - hop.since >= self.config.blame_span_s
            hop.strikes = 0 if ban else hop.strikes
        return ban

    def snapshot(self) -> dict[str, object]:
        """Figures for /status: the last checks' cosines, norm ratios and relative distances (quantiles), and how
        many hops are trusted."""
        out: dict[str, object] = {"checks": self.extremes[3], "cosine_lowest": self.extremes[0],
                                  "norm_ratio_highest": self.extremes[1], "distance_highest": self.extremes[2],
                                  "trusted_hops": sum(1 for h in self._hops.values()
                                                      if h.passed >= self.config.trust_after)}
        for i, name in enumerate(("cosine", "norm_ratio", "distance")):
            out.update(quantiles(name, [v[i] for v in self.seen]))
        return out
