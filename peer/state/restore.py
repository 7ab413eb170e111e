"""Loading a stage's state when a peer takes it: every source compared by training progress, the most advanced wins.

The sources are the stage's donors (their announced state versions), this peer's checkpoint of the stage, the
neighbour copies of the stage (``peer.state.spare``: those other peers announce, and this peer's own) and the run's
seeded init, ranked by ``peer.state.progress``; donors are asked only when one announces at least the progress of the
best local file. A state from another peer is loaded only when replicas of the stage witness it
(``peer.state.witness``) and is compared again by its witnessed step before it replaces anything, so a restarted peer
never trades its trained checkpoint for a less-trained donor's state. A copy is loaded unwitnessed only when the
stage lost every replica and nobody can witness its one announced copy (with a WARNING naming its holder, step and
age): the alternative is the seeded init.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from peer.lifecycle import PeerState
from peer.state.checkpoint import checkpoint_steps, load_checkpoint
from peer.state.progress import StateSource, most_advanced, rank
from peer.state.spare import SpareStore
from peer.state.sync import StateSyncConfig, choose_donors, load_state_from_peers, vouched_first
from peer.state.witness import witness_vetter

if TYPE_CHECKING:
    from hivemind import DHT
    from hivemind.p2p import P2P

    from peer.membership.records import PeerRecord
    from peer.ops.metrics import PeerMetrics
    from peer.seams import Compute
    from trainer.config import RunConfig

logger = logging.getLogger(__name__)

STAGE_LOST = "so its training so far is lost"
"""Ends the warning of a stage that starts from the init with no other replica (tools/bench_churn.py counts it)."""
REPLICA_STARTS_OVER = "this replica starts from the run's seeded init"
"""Begins the warning of a replica that starts from the init while others of its stage keep the stage's training."""
T = TypeVar("T")

DONOR_WAIT_S = 8.0  # how long a joiner with nothing but the init keeps looking for a donor in a swarm that trained
DONOR_RETRY_S = 2.0  # between two reads of the swarm while it looks


@dataclass(frozen=True, kw_only=True)
class Restored:
    """What ``restore_state`` chose: the source, and the state dict to load (None: keep the seeded init)."""

    source: StateSource
    state: dict[str, Any] | None


def _step_of(state: object) -> int:
    step = state.get("local_step", -1) if isinstance(state, dict) else -1
    return int(step) if isinstance(step, int) else -1


async def _reread(refresh: Callable[[], Awaitable[dict[str, PeerRecord]]],
                  wait_s: float) -> AsyncIterator[dict[str, PeerRecord]]:
    """The swarm's records, read again every ``DONOR_RETRY_S`` for up to ``wait_s`` (time spent by the caller between
    two reads counts)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        await asyncio.sleep(DONOR_RETRY_S)
        yield await refresh()


async def restore_state(*, run: RunConfig, stage: int, my_id: str,
                        refresh: Callable[[], Awaitable[dict[str, PeerRecord]]], p2p: P2P, dht: DHT,
                        metrics: PeerMetrics, reference: dict[str, Any],
                        checkpoint_dir: Path | None, io: Compute, timeout_s: float,
                        donor_wait_s: float = DONOR_WAIT_S, spare: SpareStore | None = None,
                        trusted: Callable[[], list[str]] | None = None, witness_wait_s: float = 0.0) -> Restored:
    """The most advanced state of ``stage`` among donors, the checkpoint in ``checkpoint_dir`` and the init.

    refresh: reads the swarm's records. When the swarm has trained but no donor of the stage is visible and there is
    no checkpoint, the records are read again for up to ``donor_wait_s`` (a view read while the stage's peers were
    still starting, or a DHT read that timed out, would otherwise throw the stage's training away). io: runs a
    blocking function off the event loop (``await io(fn, *args)``). timeout_s: bound on the donor transfer (the
    files are tried anyway). Raises CheckpointError when the local checkpoint exists but is unusable. spare:
    this peer's own neighbour copy (considered, with the copies others announce, only when no donor delivered).
    trusted: the peers this peer has validated work from (preferred as witnesses). witness_wait_s: how long, when
    no donor's state could be loaded, the records are read again for a change of the stage's replicas (a dead
    witness's record lapsing) before the copies, the checkpoint or the init are taken instead.
    """
    vouched = trusted() if trusted is not None else []
    files = [StateSource(kind="init", step=0, label="the run's seeded init")]
    if checkpoint_dir is not None:
        held = (await io(checkpoint_steps, checkpoint_dir, run)).get(stage)
        if held is not None:
            files.append(StateSource(kind="checkpoint", step=held, label=str(checkpoint_dir)))
    best_file = most_advanced(files)
    records = await refresh()

    def lacks_donor(records: dict[str, PeerRecord]) -> bool:
        """Nothing but the init here, no donor visible, and yet the swarm has trained."""
        return not choose_donors(records, stage, my_id) and best_file.kind == "init" \
            and max((r.version for r in records.values()), default=0) > 0

    if lacks_donor(records):
        logger.info("no donor of stage %d visible yet while the swarm has trained; reading the swarm again", stage)
        async for records in _reread(refresh, donor_wait_s):
            if not lacks_donor(records):
                break

    def donor_sources(records: dict[str, PeerRecord]) -> list[StateSource]:
        return [StateSource(kind="donor", step=records[d].version, label=d)
                for d in choose_donors(records, stage, my_id)]

    donors = donor_sources(records)
    listed = ", ".join(f"{s.kind} {s.label[:16]} step {s.step}" for s in rank([*donors, *files]))
    logger.info("stage %d state sources, most advanced first: %s", stage, listed)

    def worth(records: dict[str, PeerRecord]) -> list[str]:
        """The stage's donors announcing at least the best local file's progress, vouched ones first."""
        return vouched_first([d.label for d in rank(donor_sources(records)) if d.step >= best_file.step], vouched)

    async def ask(records: dict[str, PeerRecord], asking: list[str]) -> dict[str, Any] | None:
        try:
            config = StateSyncConfig()
            vet = witness_vetter(run=run, stage=stage, config=config, metrics=metrics,
                                 announced=choose_donors(records, stage, my_id), trusted=vouched)
            return await asyncio.wait_for(load_state_from_peers(
                p2p=p2p, run=run, stage=stage, metrics=metrics, dht=dht, reference=reference, donors=asking,
                config=config, vet=vet), timeout=timeout_s)
        except TimeoutError:
            logger.warning("loading stage %d's state from donors took over %.0f s; using the best local source",
                           stage, timeout_s)
            return None

    delivered: dict[str, Any] | None = None
    worth_asking = worth(records)
    if worth_asking:
        delivered = await ask(records, worth_asking)
        # No donor's state could be loaded (each refused by its witnesses, or unreachable). A replica that died
        # keeps its record for up to its TTL and, drawn as the only witness of its stage's last live replica, ties
        # the vote: the joiner would start over. So while the announced replicas change (a record lapses, another
        # replica appears), the donors are asked again, up to ``witness_wait_s``; a view that stays the same is not.
        seen = set(choose_donors(records, stage, my_id))
        if delivered is None and max(d.step for d in donors) > best_file.step:  # only then can waiting gain anything
            async for records in _reread(refresh, witness_wait_s):
                now = set(choose_donors(records, stage, my_id))
                if now == seen:
                    continue
                seen = now
                if again := worth(records):
                    logger.info("stage %d: the stage's announced replicas changed (%d now); asking its donors again",
                                stage, len(now))
                    if (delivered := await ask(records, again)) is not None:
                        break
    elif donors:
        logger.info("stage %d: no donor is ahead of the %s (step %d); not downloading", stage, best_file.kind,
                    best_file.step)

    candidates = list(files)
    # Copies count when no donor delivered (a dead peer's record outlives it by up to its TTL) and when one is ahead
    # of every donor (a former peer of the stage offers its checkpoint after a whole-swarm restart put it elsewhere);
    # in a steady swarm they trail the donors they were taken from, and nothing is downloaded.
    floor = max(best_file.step, _step_of(delivered))
    copy = await _from_copies(run=run, stage=stage, my_id=my_id, records=records, p2p=p2p, metrics=metrics,
                              reference=reference, spare=spare, io=io, floor=floor, timeout_s=timeout_s,
                              ahead_of_donor=delivered is not None, trusted=vouched)
    if copy is not None:
        return copy
    if delivered is not None:
        candidates.append(StateSource(kind="donor", step=_step_of(delivered), label="the donor's delivered state"))
    chosen = most_advanced(candidates)
    if delivered is not None and chosen.kind != "donor":
        logger.warning("stage %d: discarding the donor's state (step %d): it is behind the %s (step %d)", stage,
                       _step_of(delivered), chosen.kind, chosen.step)
    if chosen.kind == "donor":
        return Restored(source=chosen, state=delivered)
    if chosen.kind == "checkpoint":
        state = await io(load_checkpoint, checkpoint_dir, run, stage)
        if state is not None:
            return Restored(source=StateSource(kind="checkpoint", step=_step_of(state), label=chosen.label),
                            state=state)
    swarm_step = max((r.version for r in records.values()), default=0)
    if swarm_step > 0:  # the swarm has trained, and this replica starts over
        others = len(choose_donors(records, stage, my_id))  # the stage's other training replicas
        if others:  # the stage's training lives on in them; averaging pulls this replica towards them
            text = (f"stage {stage}: {REPLICA_STARTS_OVER} while the swarm is at step {swarm_step}: no donor, "
                    f"checkpoint or copy it could verify was available; the stage's {others} other replica(s) keep "
                    f"its training, and averaging pulls this one towards them")
        else:
            text = (f"stage {stage} starts from the run's seeded init while the swarm is at step {swarm_step}: no "
                    f"donor, checkpoint or copy of this stage was available, {STAGE_LOST}")
        logger.warning("%s", text)
        metrics.warn(text)
    return Restored(source=most_advanced(files[:1]), state=None)


async def _from_copies(*, run: RunConfig, stage: int, my_id: str, records: dict[str, PeerRecord], p2p: P2P,
                       metrics: PeerMetrics, reference: dict[str, Any], spare: SpareStore | None,
                       io: Compute, floor: int, timeout_s: float,
                       ahead_of_donor: bool = False, trusted: list[str] | None = None) -> Restored | None:
    """A copy of ``stage`` ahead of ``floor`` (the best step of the local files and the donor's delivered state)
    that its witnesses vouch for, or None: of the copies this peer or its vouched holders hold, the most advanced,
    then of the others. ahead_of_donor: a donor delivered (only the log line differs)."""
    holders = {r.peer_id: r for r in records.values() if r.backup_stage == stage and r.state == PeerState.TRAINING
               and r.peer_id != my_id and r.backup_step is not None and r.backup_step > floor}
    held = spare.info if spare is not None else None
    copies = [StateSource(kind="spare", step=int(r.backup_step or 0), label=r.peer_id) for r in holders.values()]
    if held is not None and held.stage == stage and held.step > floor:
        copies.append(StateSource(kind="spare", step=held.step, label=my_id))
    if not copies:
        return None
    logger.info("stage %d: copies ahead of step %d, most advanced first: %s", stage, floor,
                ", ".join(f"{c.label[:16]} step {c.step}" for c in rank(copies)))
    deadline = time.monotonic() + timeout_s
    replicas = choose_donors(records, stage, my_id)
    holding = [r.peer_id for r in records.values() if r.backup_stage == stage and r.state == PeerState.TRAINING
               and r.peer_id != my_id]
    own = await io(spare.read, stage) if held is not None and held.stage == stage and spare is not None else None
    # this peer's own copy and those of holders with validated work (ours or our initial peers') before the others,
    # most advanced first within each: copies announced at huge steps by identities nobody vouches for would
    # otherwise each cost a transfer, and the restore deadline, before an honest one is asked
    for copy in vouched_first(rank(copies), [my_id, *(trusted or [])], key=lambda c: c.label):
        if copy.label == my_id:
            assert spare is not None and held is not None
            state, taken_at = await io(spare.read, stage), held.taken_at
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            config = StateSyncConfig(max_donors=1)
            vet = witness_vetter(run=run, stage=stage, config=config, metrics=metrics, trusted=trusted,
                                 announced=[*replicas, *holding],
                                 local={"this peer's copy": own} if own is not None else None,
                                 allow_alone=not replicas, what="a backup copy")
            try:
                state = await asyncio.wait_for(load_state_from_peers(
                    p2p=p2p, run=run, stage=stage, metrics=metrics, reference=reference, donors=[copy.label],
                    config=config, vet=vet), timeout=left)
            except TimeoutError:
                state = None
            taken_at = float(holders[copy.label].backup_taken_at or 0.0)
        step = _step_of(state)
        if state is None or step <= floor:
            continue
        age = max(0.0, time.time() - taken_at)
        if ahead_of_donor:
            text = (f"stage {stage}: restored from a backup copy held by peer {copy.label[:16]}, at step {step}, "
                    f"taken {age:.0f} s ago: it is ahead of every donor and local file (step {floor})")
        else:
            text = (f"stage {stage} had no peer left: restored from a backup copy held by peer {copy.label[:16]}, "
                    f"at step {step}, taken {age:.0f} s ago (the stage's training since then is lost)")
        logger.warning("%s", text)
        metrics.warn(text)
        metrics.inc("backup_restores")
        return Restored(source=StateSource(kind="spare", step=step, label=copy.label), state=state)
    return None
