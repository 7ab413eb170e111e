"""Which stage a peer serves: pure functions of a DHT snapshot (after petals' ``server/block_selection.py``).

The swarm trains only as fast as its slowest stage. A stage's *capacity* is the summed throughput of its training
peers over the stage's relative cost (the stage with the LM head needs more peers); a 'draining' peer counts for
none. A joiner takes the stage of least capacity; a serving peer moves only when that raises the swarm's minimum
capacity by more than the hysteresis factor ``1 / quality``, so the objective strictly improves with each move and
peers cannot flap. Leaving is claimed first (``peer.membership.moves``, ``may_leave``). Every choice takes ``fits``,
the stages this peer's memory holds (``peer.budget``; ``None``: no limit known), and never picks another.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Collection, Mapping

from peer.lifecycle import PeerState
from peer.membership.records import PeerRecord

EPS = 1e-9
RECOMPUTE = 4.0 / 3.0  # a stage that recomputes its forward for the backward: forward x 2 + backward (x 2) over 3
#: record states of peers that no longer count for their stage's capacity
LEAVING = (PeerState.DRAINING, PeerState.STOPPED)


def stage_costs(n_layer_per_stage: list[int], *, n_embd: int, vocab_size: int) -> list[float]:
    """Relative compute per micro-batch of each stage, in units of one transformer block's forward and backward.

    A block costs ~24 d^2 flops per token, the LM head 2 d V, so the head weighs V / (12 d) blocks; the embedding is
    a lookup (counted as 0.05 blocks so an empty stage is never free). Every stage but the last runs its forward
    twice (without autograd when the micro-batch passes, again with it for the backward: ``StageWorker.backward``),
    a third more than the last stage's single forward with autograd and its backward (forward 1, backward 2).
    """
    k = len(n_layer_per_stage)
    costs = []
    for s, blocks in enumerate(n_layer_per_stage):
        cost = (float(blocks) + 0.05 * (s == 0)) * (RECOMPUTE if s < k - 1 else 1.0)
        if s == k - 1:
            cost += vocab_size / (12.0 * n_embd)
        costs.append(max(cost, 0.05))
    return costs


def capacities(records: Mapping[str, PeerRecord], costs: list[float], *, exclude: str | None = None,
               ) -> list[float]:
    """Micro-batches per second each stage can serve: summed announced throughput / stage cost."""
    cap = [0.0] * len(costs)
    for pid, r in records.items():
        if pid == exclude or r.state in LEAVING or not 0 <= r.stage < len(costs):
            continue
        cap[r.stage] += r.throughput / costs[r.stage]
    return cap


def estimate_throughput(records: Mapping[str, PeerRecord], *, default: float = 1.0) -> float:
    """A newcomer's guess at its own throughput before it has measured one: the swarm's median (or ``default``)."""
    known = [r.throughput for r in records.values() if r.throughput > 0 and r.state != PeerState.STOPPED]
    return statistics.median(known) if known else default


def best_versions(records: Mapping[str, PeerRecord], n_stages: int) -> list[int]:
    """The highest state version announced on each stage (-1 for a stage nobody serves)."""
    best = [-1] * n_stages
    for r in records.values():
        if r.state != PeerState.STOPPED and 0 <= r.stage < n_stages:
            best[r.stage] = max(best[r.stage], r.version)
    return best


class NoStageFits(ValueError):
    """No stage of the run fits in the memory this peer may use."""


def choose_stage(records: Mapping[str, PeerRecord], costs: list[float], *, held: Mapping[int, int] | None = None,
                 last: int | None = None, rng: random.Random | None = None, tolerance: float = 0.05,
                 fits: Collection[int] | None = None) -> int:
    """The stage whose checkpoint this peer holds ahead of every announced version of it, else the stage of least
    capacity; ties (within ``tolerance`` relative) are settled by the checkpoints held, then at random to spread
    joiners. Only stages in ``fits`` (all when None) are candidates; raises NoStageFits when it is empty.

    held: stage -> step of this peer's checkpoints. A checkpoint ahead of every announced version of its stage is the
    most advanced state of that stage in the swarm: without this peer that training would be lost, so it outweighs
    capacity (which rebalancing evens out later, moving state along). This is what brings every peer of a whole-swarm
    restart back to its own stage: the peers that came back before it announce version 0 until they loaded. Among
    several such stages, ``last`` (the stage whose checkpoint was written last: the one it served before), else the
    most advanced checkpoint. Among tied stages, then, any stage it holds a checkpoint for (it resumes without a
    download).
    """
    allowed = [s for s in range(len(costs)) if fits is None or s in fits]
    if not allowed:
        raise NoStageFits(f"none of the {len(costs)} stages fits in this peer's memory")
    held = {s: step for s, step in (held or {}).items() if s in allowed}
    best = best_versions(records, len(costs))
    ahead = [s for s in held if held[s] > max(best[s], 0)]
    if ahead:
        return last if last in ahead else max(ahead, key=lambda s: (held[s], -s))
    cap = capacities(records, costs)
    lowest = min(cap[s] for s in allowed)
    candidates = [s for s in allowed if cap[s] <= lowest * (1 + tolerance) + EPS]
    kept = [s for s in candidates if s in held]
    return (rng or random).choice(kept or candidates)


def leaves_for_an_empty_stage(records: Mapping[str, PeerRecord], n_stages: int, chosen: int,
                              last: int | None) -> bool:
    """True when a restarting peer would leave the stage it served last for ``chosen`` only because nobody announces
    ``chosen`` yet: in a whole-swarm restart that stage's own peers may be a few seconds from announcing, and a peer
    taking it from an old checkpoint of it would train there far behind them (its own stage's state lives on with
    its other peers, or as this peer's copy). The caller reads the swarm again for a few announce periods first."""
    if last is None or chosen == last or not 0 <= last < n_stages:
        return False
    return best_versions(records, n_stages)[chosen] < 0


def should_move(records: Mapping[str, PeerRecord], costs: list[float], my_id: str, *, quality: float = 0.75,
                fits: Collection[int] | None = None) -> int | None:
    """The stage this peer should move to, or None to stay.

    Moves only when the swarm's minimum capacity after the move exceeds the current minimum by the factor
    ``1 / quality`` (hysteresis). A peer whose stage has no other server never moves (it would empty its stage), and
    never to a stage outside ``fits`` (all stages when None).
    """
    if not 0 < quality <= 1:
        raise ValueError(f"quality must be in (0, 1], got {quality}")
    me = records.get(my_id)
    if me is None or not 0 <= me.stage < len(costs):
        return None
    current = capacities(records, costs)
    without = capacities(records, costs, exclude=my_id)
    if without[me.stage] <= EPS:
        return None
    allowed = [s for s in range(len(costs)) if fits is None or s in fits or s == me.stage]
    target = min(allowed, key=lambda s: (without[s], s))
    if target == me.stage:
        return None
    without[target] += me.throughput / costs[target]
    if min(without) > min(current) / quality + EPS:
        return target
    return None


def may_leave(records: Mapping[str, PeerRecord], my_id: str) -> bool:
    """Whether this peer, having claimed its move (its record says 'draining'), may now leave its stage.

    Only when another peer of its stage is still training (its stage never empties) and no other peer of its stage
    is leaving at the same time: of two simultaneous claimants both back off (and retry after a random cool-down),
    which is safe whatever the order in which they read each other's claims.
    """
    me = records.get(my_id)
    if me is None:
        return False
    others = [r for pid, r in records.items() if pid != my_id and r.stage == me.stage]
    if any(r.state == PeerState.DRAINING for r in others):
        return False
    return any(r.state == PeerState.TRAINING for r in others)
