"""The data-parallel averaging rules as objects: what each one needs from a round and how it applies one.

A rule is looked up once by its name in the run file (``rule_of(cfg)``); the worker's averaging state, the
simulator and the daemon's averaging loop ask it instead of comparing names:

* ``averages``: whether replicas mix at all ('none' does not);
* ``whole``: rounds average whole tensors (p = 1) instead of a partition of ``round_fraction(cfg)`` of every tensor;
* ``drift``: the rule needs the replica's values at the round's begin (W_then), to know its drift since;
* ``ema``: the rule keeps a per-coordinate drift estimate e, saved with the weights;
* ``groups``: a round averages with a rotating group of partners, every ``wagma_global_every``-th with everybody;
* ``own_progress``: the drift re-applied is our own training progress since the begin only, without the corrections
  that other rounds finishing in between applied. Needed whenever rounds in flight share coordinates (every WAGMA
  round, and the 'ema' and 'delta' rounds of a run with p x tau > 1, e.g. whole-tensor rounds with tau > round_steps):
  re-applied, the others' corrections make the replicas' difference follow d(t+1) = d(t) - d(t - tau), which grows
  for tau >= 2 rounds. Where rounds in flight are disjoint it changes nothing.

``apply`` takes one round's flat tensors over the round's slice (the aggregate a of the replicas' published values,
our current values W_now, W_then and e where the rule needs them) and returns the new values (and the new e). It may
overwrite a, W_now and e, which are the caller's scratch copies: a round then allocates nothing the size of the
slice (a fresh buffer costs its page faults, about as much as the arithmetic itself).
The rules are written out in docs/design.md ("Data-parallel axis", "WAGMA group averaging").
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from trainer.config import AveragingConfig


@dataclass(frozen=True)
class RoundInputs:
    """One round at its finish, flat over the round's slice."""

    mean: torch.Tensor
    """a: the aggregate of the published values (ours, as published at begin, among them; a copy the rule may
    overwrite)."""
    now: torch.Tensor
    """W_now: our values at the finish (a copy the rule may overwrite)."""
    then: torch.Tensor | None
    """W_then: our values at the begin (rules with ``drift``)."""
    ema: torch.Tensor | None
    """e: the drift estimate (rules with ``ema``; a copy the rule may overwrite)."""
    lam: float = 1.0
    mu: float = 0.5
    bounded: bool = False
    """The aggregate's pull on our values was clipped (trainer/aggregate.py: a minority round): see ``apply_round``."""


@dataclass(frozen=True)
class AveragingRule(abc.ABC):
    """One averaging rule; see the module docstring for the flags."""

    name: str
    averages: bool = True
    whole: bool = False
    drift: bool = False
    ema: bool = False
    groups: bool = False
    own_progress: bool = False

    def round_fraction(self, cfg: AveragingConfig) -> float:
        """Fraction of every tensor one round averages: the run's p x round_steps, or 1 for whole-tensor rules."""
        return 1.0 if self.whole else cfg.round_fraction

    def apply_round(self, r: RoundInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(new values, new drift estimate or None). A round whose pull was clipped moves our values by exactly that
        pull: W <- a + (W_now - W_then), our own drift, and the drift estimate is left as it was. The clip bounds
        how far a round that liars may dominate moves us; a + lam e would move us by the pull plus lam e - drift,
        which the bound does not cover (e is an average over past rounds, not this round's drift), and feeding the
        round's drift into e would let such a round steer later ones."""
        if r.bounded and self.drift:
            assert r.then is not None
            return r.now.sub_(r.then).add_(r.mean), None
        return self.apply(r)

    @abc.abstractmethod
    def apply(self, r: RoundInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(new values, new drift estimate or None)."""


class _NoAveraging(AveragingRule):
    """'none': replicas never mix; callers check ``averages`` before asking for a round."""

    def apply(self, r: RoundInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise ValueError(f"averaging.rule {self.name!r} does not average; set a rule to use averaging")


class _Overwrite(AveragingRule):
    def apply(self, r: RoundInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        return r.mean, None


class _Delta(AveragingRule):
    """W <- a + lam x drift; WAGMA uses it with lam 1 (see WAGMA below)."""

    def apply(self, r: RoundInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert r.then is not None
        return r.now.sub_(r.then).mul_(r.lam).add_(r.mean), None


class _Ema(AveragingRule):
    """e <- mu e + (1 - mu) drift (e itself on a coordinate's first update, read from e == 0); W <- a + lam e."""

    def apply(self, r: RoundInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert r.then is not None and r.ema is not None
        drift = r.now.sub_(r.then)
        fresh = r.ema == 0
        e = r.ema.lerp_(drift, 1.0 - r.mu)  # mu e + (1 - mu) drift
        e = torch.where(fresh, drift, e, out=e)
        return r.mean.add_(e, alpha=r.lam), e


class _Wagma(AveragingRule):
    """WAGMA over a network's delay, in the delta form: our published copy is tau steps old like the partners', so
    the group's mean of the published models is the paper's group average as of the round's begin, and our own
    progress since is applied on top, W <- a + progress, on group and global rounds alike. The progress is the
    drift less what other rounds' finishes changed in the meantime (``own_progress``): every WAGMA round covers
    every coordinate, so with tau rounds in flight each would otherwise re-apply the corrections of the others and
    the replicas' difference would follow d(t+1) = d(t) - d(t - tau), which oscillates and grows for tau >= 2.
    (Replacing only our own published copy by our current values, a + drift / G, throws away (G - 1) / G of every
    replica's progress of the delay at every round: the paper's rule assumes partners a step stale, not tau.)"""

    def apply(self, r: RoundInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert r.then is not None
        return r.now.sub_(r.then).add_(r.mean), None


RULES: dict[str, AveragingRule] = {rule.name: rule for rule in (
    _Ema("ema", drift=True, ema=True, own_progress=True),
    _Delta("delta", drift=True, own_progress=True),
    _Overwrite("avg"),
    _Overwrite("full", whole=True),
    _Wagma("wagma", whole=True, drift=True, groups=True, own_progress=True),
    _NoAveraging("none", averages=False),
)}


def rule_of(cfg: AveragingConfig) -> AveragingRule:
    """The run's averaging rule (the config validated its name)."""
    return RULES[cfg.rule]


# --- WAGMA groups ------------------------------------------------------------------------------------------------

def wagma_phase(round_no: int, rounds_per_tick: int = 1) -> int:
    """The group phase of round ``round_no`` when rounds are numbered ``tick * rounds_per_tick + slot``: tick +
    slot. The groups and the global rounds follow the phase, not the round number: a daemon that opens only slot 0
    of most ticks has even round numbers only, and with two digit fields its groups would never rotate."""
    tick, slot = divmod(round_no, rounds_per_tick)
    return tick + slot


def wagma_n_fields(n_replicas: int, group_size: int) -> int:
    """Digit fields L = ceil(log_G R): groups rotate through them, one per phase."""
    if n_replicas < 1 or group_size < 2:
        raise ValueError(f"need n_replicas >= 1 and group_size >= 2, got {n_replicas}, {group_size}")
    fields, span = 0, 1
    while span < n_replicas:
        span *= group_size
        fields += 1
    return max(1, fields)


def wagma_group(replica: int, phase: int, n_replicas: int, group_size: int) -> list[int]:
    """Replicas averaging together with ``replica`` at ``phase`` (sorted, including ``replica`` itself).

    Phase t uses base-G digit field f = t mod L of the replica index: the group is every index that differs from
    ``replica`` only in digit f. For G a power of two this is the released code's XOR butterfly (partners
    ``replica ^ (m << f*log2 G)``). Groups are disjoint and symmetric, and after L phases every replica has mixed
    with every other. When R is not a power of G the index space is padded to G^L and indices >= R are left out, so
    some groups are smaller than G (possibly just the replica itself); any 2L consecutive phases still mix every
    replica into every other (move down the digits that decrease in the first L phases, then up the rest; all
    intermediate indices stay below max(i, j) < R), and the averaging divisor uses the actual group size.
    """
    if not 0 <= replica < n_replicas:
        raise ValueError(f"replica must be in [0, {n_replicas}), got {replica}")
    L = wagma_n_fields(n_replicas, group_size)
    unit = group_size ** (phase % L)
    digit = (replica // unit) % group_size
    base = replica - digit * unit
    return [m for m in (base + d * unit for d in range(group_size)) if m < n_replicas]


def wagma_is_global(phase: int, every: int) -> bool:
    """True when ``phase`` is a global-average phase: t mod (tau + 1) == tau with every = tau + 1."""
    return phase % every == every - 1


def wagma_members(replica: int, phase: int, n_replicas: int, cfg: AveragingConfig) -> list[int]:
    """Who averages with ``replica`` at ``phase`` under the run's WAGMA settings (itself included): everybody on a
    global phase, else its rotating group."""
    if wagma_is_global(phase, cfg.wagma_global_every):
        return list(range(n_replicas))
    return wagma_group(replica, phase, n_replicas, cfg.wagma_group_size)
