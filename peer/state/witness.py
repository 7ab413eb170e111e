"""Before any state from another peer is loaded, replicas of its stage witness all of it, tensor by tensor.

A donor's state, a neighbour's backup copy or a live export's stage is a claim: sources are chosen by the progress
their records announce, and a liar announces the most. So ``witnesses`` replicas of the stage (peers that did
validated work for us when any of them serves it, else announced replicas; never the donor) each send the digest of
their own state (``peer.state.digest``, seeded by us), and a strict majority of the donor and the witnesses must find
the delivered state within ``tensor_tolerance`` on every tensor: a silent, garbage or disagreeing witness counts
against it, a tie refuses. Of a witnessed state the weights are kept and ``local_step`` is capped at the witnesses'
(an announced step of 2^62 would pin the schedule at its end); the optimiser moments, the averaging EMA and pending
gradients are dropped (``sanitize``: no tolerance tells an honest one from a crafted one). A state nobody can witness
is loaded only as the stage's last resort (``allow_alone``). The rules, and what they cost an attacker:
docs/security.md, "Witnesses vote".
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from peer.state.digest import Digest, digest, read_digest, sketch, tensor_distances, witness_floors, witnessed_tensors
from peer.state.sync import STATE_RPC, StateSyncConfig, StateSyncError, Vet
from protocol.errors import PeerUnreachable, ProtocolError, RemoteError
from protocol.messages import StateChunk, StateDigestRequest
from trainer.subspace import fixed_tables

if TYPE_CHECKING:
    from peer.ops.metrics import PeerMetrics
    from protocol.rpc import Caller, Transport
    from trainer.config import RunConfig

logger = logging.getLogger(__name__)

DIMS = 64


@dataclass(frozen=True)
class Verdict:
    """What the witnesses said of a delivered state: ``loadable``, the tally and each dissent (``reason``), each
    witness's largest per-tensor distance from it, the step cap (the highest step an agreeing witness reported; None
    without one), and whether no witness could be asked at all."""

    loadable: bool
    reason: str
    distances: dict[str, float] = field(default_factory=dict)
    step_cap: int | None = None
    unwitnessed: bool = False
    dissent: int = 0
    """Witnesses asked that did not vouch for the state (silent, garbage or disagreeing)."""


#: a witness that could not be reached is asked again this many times, this long apart (a dial can fail while a
#: peer is still starting: a WAN churn run's joiner started over from the seeded init for one such failure)
UNREACHABLE_RETRIES, UNREACHABLE_PAUSE_S = 1, 2.0

#: a donor's step this far above its witnesses' is logged as the drift of honest replicas, not as a warning
STEP_DRIFT_MIN, STEP_DRIFT_SHARE = 100, 0.1


def draw_witnesses(*, trusted: list[str], announced: list[str], donor: str, n: int,
                   rng: random.Random) -> list[str]:
    """Up to ``n`` witnesses, never ``donor``: from ``trusted`` (validated work) when any of them is an announced
    replica; none when the donor itself is trusted and no other replica is (a peer we never had validated work from
    may not veto one we had); else drawn at random from ``announced``."""
    announced = [p for p in dict.fromkeys(announced) if p != donor]
    known = [p for p in announced if p in set(trusted)]
    if not known and donor in set(trusted):
        return []
    pool = known or announced
    return rng.sample(pool, min(n, len(pool)))


async def _ask(transport: Caller, witness: str, run: RunConfig, stage: int, seed: int, n_tensors: int | None,
               timeout: float) -> Digest:
    request = StateDigestRequest(run_id=run.run_id, stage=stage, seed=seed, dims=DIMS)
    try:
        reply = await transport.call(witness, STATE_RPC, request, timeout=timeout)
    except (TimeoutError, RemoteError, PeerUnreachable, ProtocolError, ConnectionError, OSError) as e:
        raise StateSyncError(f"{type(e).__name__}: {e}") from e
    if not isinstance(reply, StateChunk) or reply.run_id != run.run_id or reply.stage != stage:
        raise StateSyncError("it answered with something else than a digest")
    try:
        return read_digest(reply, dims=DIMS, n_tensors=n_tensors, peer=witness)
    except ValueError as e:
        raise StateSyncError(str(e)) from e


async def witness_state(*, transport: Transport, state: dict[str, Any], witnesses: list[str], run: RunConfig,
                        stage: int, config: StateSyncConfig, local: dict[str, dict[str, Any]] | None = None,
                        allow_alone: bool = False, rng: random.Random | None = None) -> Verdict:
    """Ask every peer in ``witnesses`` (and digest every state in ``local``, e.g. this peer's own copy of the stage)
    about ``state``; see the module docstring for the verdict. allow_alone: loadable when there is no witness."""
    rng = rng or random.Random()
    seed = rng.getrandbits(62)
    loop = asyncio.get_running_loop()
    tensors = witnessed_tensors(state)
    ours = await loop.run_in_executor(None, lambda: digest(tensors, seed=seed, dims=DIMS,
                                                           local_step=int(state.get("local_step", 0))))
    if not witnesses and not local:
        return Verdict(loadable=allow_alone, unwitnessed=True,
                       reason="no replica of the stage besides the source can witness it")

    async def one(w: str) -> Digest | str:
        deadline, attempt = loop.time() + config.witness_timeout_s, 0
        while True:
            left = deadline - loop.time()
            try:
                return await asyncio.wait_for(_ask(transport, w, run, stage, seed, len(tensors), left), left)
            except (StateSyncError, TimeoutError) as e:
                # a witness we could not reach (a dial that failed: a peer still starting, a connection reset) is
                # asked once more while time is left; one that answered wrong, or took its time, is not
                cause = e.__cause__
                unreachable = isinstance(cause, PeerUnreachable | OSError) and not isinstance(cause, TimeoutError)
                attempt += 1
                if (not unreachable or attempt > UNREACHABLE_RETRIES
                        or deadline - loop.time() <= UNREACHABLE_PAUSE_S + 1.0):
                    return str(e) or type(e).__name__
            await asyncio.sleep(UNREACHABLE_PAUSE_S)

    answers: dict[str, Digest | str] = dict(zip(witnesses, await asyncio.gather(*(one(w) for w in witnesses)),
                                                strict=True))
    def digest_of(h: dict[str, Any]) -> Digest:
        return digest(witnessed_tensors(h), seed=seed, dims=DIMS, local_step=int(h.get("local_step", 0)))

    for label, held in (local or {}).items():
        answers[label] = await loop.run_in_executor(None, digest_of, held)
    names = list(state["model"])
    floors = witness_floors(names, run.optim.lr)
    fixed = await loop.run_in_executor(None, lambda: fixed_sketches(run, stage, names, seed=seed))
    distances: dict[str, float] = {}
    problems: list[str] = []
    for w, answer in answers.items():
        if isinstance(answer, str):
            problems.append(f"witness {w[:16]} did not answer ({answer})")
            continue
        if not bool((answer.numel == ours.numel).all()):
            problems.append(f"witness {w[:16]} holds tensors of other sizes")
            continue
        d = tensor_distances(ours, answer, floors, fixed)
        distances[w] = float(d.max()) if d.numel() else 0.0
        if distances[w] > config.tensor_tolerance:
            worst = int(d.argmax())
            problems.append(f"witness {w[:16]} is {distances[w]:.3f} from it on tensor {worst} "
                            f"(tolerance {config.tensor_tolerance})")
    agree = len(answers) - len(problems)
    steps = [a.local_step for w, a in answers.items() if isinstance(a, Digest) and distances.get(w, 1e9)
             <= config.tensor_tolerance]
    loadable = agree + 1 > len(problems)  # the donor's own word and the agreeing witnesses against the rest
    tally = f"{agree + 1} of {len(answers) + 1} (the donor and {agree} of {len(answers)} witnesses) vouch for it"
    return Verdict(loadable=loadable, reason="; ".join([tally, *problems]), distances=distances,
                   step_cap=max(steps) if steps else None, dissent=len(problems))


def fixed_sketches(run: RunConfig, stage: int, names: list[str], *, seed: int) -> torch.Tensor | None:
    """The sketches (``DIMS`` under ``seed``, in the order of ``names``, the state's model keys) of the part of each
    tensor that no replica trains (``trainer.subspace.fixed_tables``; zeros for the others), for
    ``tensor_distances``; None in a run without one (blocking)."""
    tables = fixed_tables(run, stage)
    if not tables:
        return None
    out = torch.zeros(len(names), DIMS)
    for i, name in enumerate(names):
        if name in tables:
            out[i] = sketch(tables[name], seed=seed, index=i, dims=DIMS)
    return out


def sanitize(state: dict[str, Any], step_cap: int | None) -> dict[str, Any]:
    """What is kept of a witnessed state from another peer (see the module docstring): the optimiser moments, the
    averaging EMA and pending gradients dropped (``averaging`` None: the worker keeps its own), ``local_step``
    capped at ``step_cap``."""
    out = dict(state)
    optimizer = state.get("optimizer")
    out["optimizer"] = {**optimizer, "state": {}} if isinstance(optimizer, dict) else optimizer
    out["grads"], out["accumulated"], out["averaging"] = None, 0, None
    if step_cap is not None and isinstance(out.get("local_step"), int):
        out["local_step"] = min(out["local_step"], step_cap)
    return out


def witness_vetter(*, run: RunConfig, stage: int, config: StateSyncConfig, metrics: PeerMetrics,
                   announced: list[str], trusted: list[str] | None = None,
                   local: dict[str, dict[str, Any]] | None = None, allow_alone: bool = True,
                   what: str = "the state", rng: random.Random | None = None) -> Vet:
    """The ``vet`` hook of ``load_state_from_peers``: witnesses drawn with ``draw_witnesses`` (``config.witnesses``
    of them; 0 turns witnessing off) judge each delivered state; on a "do not load" the verdict is counted
    (``state_sync_outvoted``), logged and shown on the dashboard. A loadable state is sanitised in place (moments and
    pending gradients dropped, ``local_step`` capped; ``state_step_capped`` when the cap lowered it)."""
    rng = rng or random.Random()

    async def vet(transport: Transport, donor: str, state: dict[str, Any], limit: int) -> bool:
        if config.witnesses == 0:
            return True
        asked = draw_witnesses(trusted=trusted or [], announced=announced, donor=donor, n=config.witnesses, rng=rng)
        verdict = await witness_state(transport=transport, state=state, witnesses=asked, run=run, stage=stage,
                                      config=config, local=local, allow_alone=allow_alone, rng=rng)
        figures = ", ".join(f"{w[:16]} {d:.3f}" for w, d in sorted(verdict.distances.items())) or "-"
        if not verdict.loadable:
            metrics.inc("state_sync_outvoted")
            text = (f"stage {stage}: {what} delivered by {donor[:16]} is not loaded: {verdict.reason} "
                    f"(largest per-tensor distances {figures})")
            logger.warning("%s", text)
            metrics.warn(text)
            return False
        if verdict.unwitnessed:
            metrics.inc("state_sync_unwitnessed")
            logger.warning("stage %d: loading %s from %s unwitnessed: it is the stage's only replica", stage, what,
                           donor[:16])
        elif verdict.dissent:
            metrics.inc("state_witness_dissent", verdict.dissent)
            logger.warning("stage %d: loading %s from %s: %s", stage, what, donor[:16], verdict.reason)
        else:
            logger.info("stage %d: %s from %s agrees with its witnesses (largest per-tensor distance %s)", stage,
                        what, donor[:16], figures)
        before = state.get("local_step")
        clean = sanitize(state, verdict.step_cap)
        if clean.get("local_step") != before:
            metrics.inc("state_step_capped")
            cap = verdict.step_cap or 0
            # honest replicas run at different speeds, so a donor a few per cent ahead of its witnesses is normal
            honest_drift = isinstance(before, int) and before - cap <= max(STEP_DRIFT_MIN, cap * STEP_DRIFT_SHARE)
            (logger.info if honest_drift else logger.warning)(
                "stage %d: %s from %s announced local step %s, above every witness's (%s): capped", stage, what,
                donor[:16], before, verdict.step_cap)
        state.clear()
        state.update(clean)
        return True

    return vet


async def agreeing_replicas(*, transport: Caller, run: RunConfig, stage: int, peers: list[str],
                            config: StateSyncConfig, rng: random.Random | None = None) -> list[str]:
    """The replicas among ``peers`` (at most ``config.witnesses`` asked) whose state a strict majority of those that
    answered agree with (within ``tensor_tolerance`` on every tensor, each counting itself): what a client that
    trusts nobody (``generate`` through a live swarm) may use. One that answers alone is kept; none that answers
    garbage or disagrees with the majority is."""
    rng = rng or random.Random()
    seed = rng.getrandbits(62)
    asked = rng.sample(peers, min(len(peers), config.witnesses or len(peers)))

    async def one(p: str) -> Digest | None:
        try:
            return await asyncio.wait_for(_ask(transport, p, run, stage, seed, None, config.witness_timeout_s),
                                          config.witness_timeout_s)
        except (StateSyncError, TimeoutError):
            return None

    got = {p: d for p, d in zip(asked, await asyncio.gather(*(one(p) for p in asked)), strict=True) if d is not None}

    def close(a: Digest, b: Digest) -> bool:
        if a.numel.shape != b.numel.shape or not bool((a.numel == b.numel).all()):
            return False
        d = tensor_distances(a, b)  # no names here: the fixed floor
        return d.numel() == 0 or float(d.max()) <= config.tensor_tolerance

    return [p for p, d in got.items() if 2 * sum(1 for q in got.values() if close(d, q)) > len(got)]
