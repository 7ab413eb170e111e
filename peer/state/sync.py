"""State sync: a joiner loads its stage's parameters, optimiser and averaging state from same-stage peers.

``StateServer`` serves snapshots of ``worker.state_dict()`` in fixed-size chunks, sharing one snapshot between the
transfers that start within an age and step bound (memory: two snapshots plus the chunks in flight; a transfer never
mixes two). ``load_state_from_peers`` fetches from one donor at a time, highest version first, validates every piece
against the local reference state, and returns the state or None (the caller then tries its checkpoint, else the
seeded init). docs/design.md ("State transfer") gives the rules and their reasons.

Interface for the daemon::

    server = StateServer(p2p=p2p, rpc_server=rpc_server, run=run, stage=stage, worker_call=worker_call,
                         metrics=metrics, config=StateSyncConfig())
    await server.start(); server.ready = True        # answer NOT_READY until this peer holds real state
    state = await load_state_from_peers(p2p=p2p, dht=dht, run=run, stage=stage, metrics=metrics,
                                        reference=fresh_worker.state_dict())   # -> dict | None
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from peer.lifecycle import PeerState
from peer.membership.records import fetch_swarm
from peer.seams import WorkerCall
from peer.state.codec import (
    MAX_SKELETON_CHARS,
    Plan,
    StateAssembler,
    StateFormatError,
    check_against_reference,
    flatten_state,
    plan_pieces,
)
from peer.state.digest import digest_chunk
from protocol.codecs.registry import decode, encode
from protocol.errors import ErrorCode, PeerUnreachable, ProtocolError, RemoteError
from protocol.limits import PeerBudgets
from protocol.messages import Busy, Error, Message, StateChunk, StateDigestRequest, StateRequest
from protocol.rpc import HandlerTable, RpcTransport, Transport
from protocol.validation import TensorSpec
from trainer.config import RunConfig

if TYPE_CHECKING:
    from hivemind import DHT
    from hivemind.p2p import P2P

    from peer.membership.records import PeerRecord
    from peer.ops.metrics import PeerMetrics
    from peer.state.spare import SpareStore
    from protocol.envelope import TensorEnvelope

logger = logging.getLogger(__name__)

STATE_RPC = "state"
SKELETON_KEY = "skeleton"


@dataclass(frozen=True, kw_only=True)
class StateSyncConfig:
    """Limits of state transfers (both sides)."""

    chunk_bytes: int = 4 * 2**20
    """Payload bytes per chunk; a few MiB keeps one chunk per round trip well under the RPC message limit."""
    chunk_timeout_s: float = 30.0
    """Timeout of one chunk request; a slower donor is dropped for the next one."""
    chunk_retries: int = 1
    """Retries of a timed-out chunk at the same donor before moving on."""
    max_donors: int = 4
    """Donors tried, best first, before giving up (the caller then falls back to a checkpoint or the init)."""
    swarm_timeout_s: float = 5.0
    """Timeout of reading the stage's peers from the DHT."""
    max_state_bytes: int = 64 * 2**30
    """Client: refuse a state larger than this (also bounded by 4x the reference's size plus 64 MiB)."""
    snapshot_max_age_s: float = 60.0
    """Server: a snapshot younger than this is reused for new transfers; an older one is replaced for them."""
    snapshot_max_lag_steps: int = 200
    """Server: ... and only while the stage has made at most this many local steps since it was taken (a fast stage
    makes thousands of steps in 60 s: a joiner would start that far behind what the donor announced)."""
    snapshot_idle_s: float = 60.0
    """Server: a snapshot no transfer touched for this long is dropped (memory)."""
    max_concurrent: int = 2
    """Server: chunks encoded at once (bounds the memory of replies in flight)."""
    window: int = 2
    """Client: chunk requests in flight at once (hides the round trip; memory is window x chunk_bytes)."""
    worker_timeout_s: float = 120.0
    """Server: timeout of taking a snapshot on the compute thread."""
    peer_starts_per_s: float = 0.2
    """Server: chunk-0 and digest requests (each may take a new snapshot) one peer may make per second ..."""
    peer_start_burst: int = 6
    """Server: ... in a burst of at most this many (a joiner needs one per donor tried and witness asked)."""
    peer_chunks_per_s: float = 16.0
    """Server: chunks one peer may fetch per second (64 MiB/s at 4 MiB chunks) ..."""
    peer_chunk_burst: int = 64
    """Server: ... in a burst of at most this many; beyond either budget the request is answered Busy."""
    witnesses: int = 8
    """Client: replicas of the stage asked for the digest of their state before a delivered state is loaded
    (``peer.state.witness``; every one asked must agree; 0: none). Digests are small, so many are asked: a liar
    must then control every replica asked, not three drawn at random, to have its state loaded."""
    witness_timeout_s: float = 20.0
    """Client: how long one witness may take to answer (a silent witness means "do not load")."""
    tensor_tolerance: float = 0.5
    """Client: the largest relative distance, on any one tensor, between a delivered state and a witness's own
    (zeros are at 1 from anything, a sign flip at 2; honest replicas of the tiny run measured in docs/security.md)."""

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1024 or self.max_state_bytes < self.chunk_bytes:
            raise ValueError("chunk_bytes must be >= 1024 and max_state_bytes >= chunk_bytes")
        for name in ("chunk_timeout_s", "swarm_timeout_s", "snapshot_max_age_s", "snapshot_idle_s",
                     "worker_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"state_sync.{name} must be positive, got {getattr(self, name)}")
        if self.snapshot_max_lag_steps < 0:
            raise ValueError(f"state_sync.snapshot_max_lag_steps must be >= 0, got {self.snapshot_max_lag_steps}")
        if self.chunk_retries < 0 or self.max_donors < 1 or self.max_concurrent < 1 or self.window < 1:
            raise ValueError("chunk_retries must be >= 0; max_donors, max_concurrent and window >= 1")
        if self.witnesses < 0 or not self.witness_timeout_s > 0 or not self.tensor_tolerance > 0:
            raise ValueError("witnesses must be >= 0, witness_timeout_s and tensor_tolerance positive")


Vet = Callable[[Transport, str, dict[str, Any], int], Awaitable[bool]]
"""``vet(transport, donor, state, limit)``: whether a delivered state may be loaded."""


class StateSyncError(Exception):
    """One donor's transfer failed (the loader moves on to the next donor)."""


class SnapshotBehind(StateSyncError):
    """The donor's snapshot is of an earlier local step than the caller asked for (``min_step``)."""


@dataclass
class _Snapshot:
    stage: int
    version: int
    taken_at: float
    touched_at: float
    skeleton: str
    tensors: list[torch.Tensor]
    plan: Plan
    local_step: int


class StateServer:
    """Serves this peer's state to joiners in chunks; see the module docstring. ``ready`` gates serving.

    spare: the neighbour copy this peer keeps (``peer.state.spare``); a request for that copy's stage is served from
    it, with the same chunking and limits, in a snapshot of its own (counted as ``backup_bytes_out``)."""

    def __init__(self, *, p2p: P2P | None, rpc_server: HandlerTable | None, run: RunConfig, stage: int,
                 worker_call: WorkerCall, metrics: PeerMetrics,
                 config: StateSyncConfig | None = None, transport: Transport | None = None,
                 clock: Callable[[], float] = time.monotonic, spare: SpareStore | None = None) -> None:
        self.run, self.stage, self.worker_call, self.metrics = run, stage, worker_call, metrics
        self.spare = spare
        self.config = config or StateSyncConfig()
        self.transport = transport or RpcTransport(p2p, rpc_server)
        self.clock = clock
        self.ready = False
        self._snapshots: dict[int, list[_Snapshot]] = {}  # by stage (ours, the neighbour copy's): newest first, <= 2
        self._versions = 0
        self._lock = asyncio.Lock()
        self._encoding = asyncio.Semaphore(self.config.max_concurrent)
        self._starts = PeerBudgets(self.config.peer_starts_per_s, self.config.peer_start_burst, clock=clock)
        self._chunks = PeerBudgets(self.config.peer_chunks_per_s, self.config.peer_chunk_burst, clock=clock)

    async def start(self) -> None:
        await self.transport.add_handler(STATE_RPC, self._handle)

    def _refuse(self, code: ErrorCode, reason: str, message: str) -> Error:
        self.metrics.inc(f"rejected:state_{reason}")
        return Error(code=code, message=message)

    async def _handle(self, msg: Message, peer: str) -> Message:
        if not isinstance(msg, StateRequest | StateDigestRequest):
            return self._refuse(ErrorCode.BAD_REQUEST, "not_a_request", "state: expected a StateRequest")
        if msg.run_id != self.run.run_id:
            return self._refuse(ErrorCode.WRONG_RUN, "wrong_run", f"state: this peer trains run {self.run.run_id}")
        spare = self.spare.info if self.spare is not None else None
        is_spare = msg.stage != self.stage and spare is not None and spare.stage == msg.stage
        if msg.stage != self.stage and not is_spare:
            return self._refuse(ErrorCode.WRONG_STAGE, "wrong_stage", f"state: this peer serves stage {self.stage}")
        if not self.ready:
            return Error(code=ErrorCode.NOT_READY, message="state: this peer is still loading its own state")
        starts = isinstance(msg, StateDigestRequest) or msg.chunk == 0
        budget = self._starts if starts else self._chunks
        if budget.empty(peer):  # per-peer: snapshots and chunks cost this server copies, encoding and bandwidth
            self.metrics.inc("rejected:state_rate_limited")
            rate = self.config.peer_starts_per_s if starts else self.config.peer_chunks_per_s
            return Busy(retry_after_s=1.0 / rate)
        budget.spend(peer)
        if isinstance(msg, StateDigestRequest):
            return await self._digest(msg)
        if msg.chunk > 0 and msg.version == 0:
            return self._refuse(ErrorCode.BAD_REQUEST, "no_version",
                                "state: a chunk after the first must name the snapshot version chunk 0 carried")
        snap = await self._snapshot_for(msg.stage, msg.version)
        if snap is None:
            return Error(code=ErrorCode.NOT_READY,
                         message=f"state: snapshot {msg.version} is gone (replaced and idle); request chunk 0 again")
        if not 0 <= msg.chunk < snap.plan.n_chunks:
            return self._refuse(ErrorCode.BAD_REQUEST, "bad_chunk",
                                f"state: chunk {msg.chunk} out of range [0, {snap.plan.n_chunks})")
        async with self._encoding:
            chunk = await asyncio.get_running_loop().run_in_executor(None, self._build, snap, msg.chunk)
        self.metrics.inc("state_chunks_served")
        if is_spare:
            self.metrics.inc("backup_bytes_out", _chunk_bytes(snap, msg.chunk))
            if msg.chunk == 0:
                self.metrics.inc("backups_served")
        return chunk

    async def _digest(self, msg: StateDigestRequest) -> Message:
        """The digest of the current snapshot of ``msg.stage`` (``peer.state.digest``), for a witness's verdict."""
        snap = await self._snapshot_for(msg.stage, 0)
        if snap is None:
            return Error(code=ErrorCode.NOT_READY, message="state: no snapshot of that stage to digest")
        async with self._encoding:
            reply = await asyncio.get_running_loop().run_in_executor(None, lambda: digest_chunk(
                run_id=self.run.run_id, stage=snap.stage, version=snap.version, skeleton=snap.skeleton,
                tensors=snap.tensors, local_step=snap.local_step, seed=msg.seed, dims=msg.dims))
        self.metrics.inc("state_digests_served")
        return reply

    async def _snapshot_for(self, stage: int, version: int) -> _Snapshot | None:
        """The snapshot of ``stage`` with ``version``, or for 0 the current one (a new one when it is older than
        ``snapshot_max_age_s``); None when that version is gone or the stage's state cannot be read."""
        async with self._lock:
            now = self.clock()
            kept = [s for s in self._snapshots.get(stage, []) if now - s.touched_at <= self.config.snapshot_idle_s]
            if version:
                snap = next((s for s in kept if s.version == version), None)
            else:
                snap = kept[0] if kept and self._fresh(kept[0], now) else None
                if snap is None:
                    snap = await self._take(stage)
                    if snap is not None:
                        kept = [snap, *kept][:2]  # the one replaced stays for the transfers reading it
            if kept:
                self._snapshots[stage] = kept
            else:
                self._snapshots.pop(stage, None)
            if snap is not None:
                snap.touched_at = self.clock()
            return snap

    def _fresh(self, snap: _Snapshot, now: float) -> bool:
        """Whether a new transfer may still start on ``snap``: young enough, and (our own stage) not too many steps
        behind the worker (the neighbour copy changes only when it is replaced)."""
        if now - snap.taken_at > self.config.snapshot_max_age_s:
            return False
        lag = self.metrics.local_step - snap.local_step
        return snap.stage != self.stage or lag <= self.config.snapshot_max_lag_steps

    async def _take(self, stage: int | None = None) -> _Snapshot | None:
        if stage is None or stage == self.stage:
            state: dict[str, Any] | None = await asyncio.wait_for(self.worker_call(lambda w: w.state_dict()),
                                                                  self.config.worker_timeout_s)
        else:  # the neighbour copy (None when it was replaced by a copy of another stage meanwhile)
            assert self.spare is not None
            state = await asyncio.get_running_loop().run_in_executor(None, self.spare.read, stage)
            if state is None:
                return None
        skeleton, tensors = await asyncio.get_running_loop().run_in_executor(None, flatten_state, state)
        self._versions += 1
        now = self.clock()
        step = state.get("local_step", 0) if isinstance(state, dict) else 0
        snap = _Snapshot(stage=self.stage if stage is None else stage, version=self._versions, taken_at=now,
                         touched_at=now, skeleton=skeleton, tensors=tensors,
                         plan=plan_pieces(tensors, self.config.chunk_bytes), local_step=int(step))
        logger.info("state snapshot %d taken for joiners: %d tensors, %d chunks", snap.version, len(tensors),
                    snap.plan.n_chunks)
        return snap

    def _build(self, snap: _Snapshot, chunk: int) -> StateChunk:
        tensors = {}
        for idx, offset, length in snap.plan.chunks[chunk]:
            piece = snap.tensors[idx].reshape(-1)[offset:offset + length].contiguous()
            tensors[f"{idx}:{offset}"] = encode(piece, "none")
        meta: dict[str, int | float | str | bool] = {}
        if chunk == 0:  # the skeleton travels as bytes: message meta strings are short by design
            raw = torch.frombuffer(bytearray(snap.skeleton.encode()), dtype=torch.uint8)
            tensors[SKELETON_KEY] = encode(raw, "none")
            meta = {"piece_bytes": snap.plan.piece_bytes, "local_step": snap.local_step}
        return StateChunk(run_id=self.run.run_id, stage=snap.stage, version=snap.version, chunk=chunk,
                          n_chunks=snap.plan.n_chunks, meta=meta, tensors=tensors)


def _chunk_bytes(snap: _Snapshot, chunk: int) -> int:
    """Payload bytes of one chunk (the skeleton's included in chunk 0): the traffic a backup costs its server."""
    n = sum(length * snap.tensors[idx].element_size() for idx, _, length in snap.plan.chunks[chunk])
    return n + (len(snap.skeleton.encode()) if chunk == 0 else 0)


def choose_donors(records: dict[str, PeerRecord], stage: int, me: str) -> list[str]:
    """Training peers of ``stage`` other than ``me``: highest state version first, then highest throughput."""
    donors = [r for r in records.values() if r.stage == stage and r.state == PeerState.TRAINING and r.peer_id != me]
    donors.sort(key=lambda r: (-r.version, -r.throughput, r.peer_id))
    return [r.peer_id for r in donors]


_T = TypeVar("_T")


def vouched_first(donors: list[_T], trusted: list[str] | None,
                  key: Callable[[_T], str] = str) -> list[_T]:
    """``donors`` in their order, those whose peer id (``key``) is in ``trusted`` (validated work: ours, or our
    initial peers') first: a few identities announcing the highest versions would otherwise take every one of the
    ``max_donors`` attempts, and the joiner would start from the init with honest donors never asked."""
    known = set(trusted or ())
    return [d for d in donors if key(d) in known] + [d for d in donors if key(d) not in known]


def state_nbytes(state: object) -> int:
    """Bytes of all tensors in a nested state (used to bound what a donor may send)."""
    _, tensors = flatten_state(state)
    return sum(t.numel() * t.element_size() for t in tensors)


async def load_state_from_peers(*, p2p: P2P | None, run: RunConfig, stage: int, metrics: PeerMetrics,
                                dht: DHT | None = None,
                                reference: dict[str, Any] | None = None, donors: list[str] | None = None,
                                config: StateSyncConfig | None = None,
                                transport: Transport | None = None, vet: Vet | None = None,
                                min_step: int = 0) -> dict[str, Any] | None:
    """Fetch ``stage``'s state from same-stage peers; None when no donor delivered a valid one (see module doc).

    donors: peer ids to try in order; default: read from the DHT with ``choose_donors``. reference: a state dict of
    the same stage (e.g. a freshly built worker's) that the result must match in parameter names, shapes and dtypes.
    vet: ``await vet(transport, donor, state, limit)`` is False when a delivered state must not be loaded (the
    witnesses of ``peer.state.witness`` outvoted it); the next donor is tried. min_step: a donor whose snapshot
    is of an earlier local step is skipped after its first chunk (a sync replica waiting for its donor's step).
    """
    config = config or StateSyncConfig()
    me = p2p.peer_id.to_base58() if p2p is not None else ""
    transport = transport or RpcTransport(p2p, None)
    if donors is None:
        records = await fetch_swarm(dht, run.run_id, timeout=config.swarm_timeout_s)
        donors = choose_donors(records, stage, me)
    limit = config.max_state_bytes
    if reference is not None:
        limit = min(limit, 4 * state_nbytes(reference) + 64 * 2**20)
    for donor in donors[:config.max_donors]:
        try:
            state = await _transfer(transport, donor, run, stage, config, limit, min_step)
            if reference is not None:
                check_against_reference(state, reference)
        except SnapshotBehind as e:
            logger.debug("state from %s skipped: %s", donor[:16], e)
            continue
        except (StateSyncError, StateFormatError) as e:
            metrics.inc("state_sync_donor_failed")
            logger.warning("state from %s failed: %s; trying the next donor", donor[:16], e)
            continue
        if vet is not None and not await vet(transport, donor, state, limit):
            continue
        metrics.inc("state_sync_ok")
        logger.info("loaded stage %d state from %s", stage, donor[:16])
        return state
    if donors:
        logger.warning("no donor delivered stage %d's state (%d tried)", stage, min(len(donors), config.max_donors))
    return None


async def request_chunk(transport: Transport, donor: str, run: RunConfig, stage: int, chunk: int,
                        config: StateSyncConfig, version: int = 0) -> StateChunk:
    """Chunk ``chunk`` of ``donor``'s snapshot ``version`` (0: its current one), with the config's timeout and
    retries; StateSyncError when it cannot be had."""
    request = StateRequest(run_id=run.run_id, stage=stage, chunk=chunk, version=version)
    for attempt in range(config.chunk_retries + 1):
        try:
            reply = await transport.call(donor, STATE_RPC, request, timeout=config.chunk_timeout_s)
        except TimeoutError as e:
            if attempt == config.chunk_retries:
                raise StateSyncError(f"chunk {chunk} timed out {attempt + 1} times") from e
            continue
        except RemoteError as e:
            raise StateSyncError(f"donor refused chunk {chunk}: {e}") from e
        except (PeerUnreachable, ConnectionError, OSError) as e:  # a stream reset may be transient: retry once
            if attempt == config.chunk_retries:
                raise StateSyncError(f"chunk {chunk}: {type(e).__name__}: {e}") from e
            continue
        except ProtocolError as e:
            raise StateSyncError(f"chunk {chunk}: {type(e).__name__}: {e}") from e
        except Exception as e:  # any other transport failure costs this donor, not the joiner
            raise StateSyncError(f"chunk {chunk}: unexpected {type(e).__name__}: {e}") from e
        if isinstance(reply, Busy):
            if attempt == config.chunk_retries:
                raise StateSyncError(f"donor stayed busy for chunk {chunk}")
            await asyncio.sleep(min(reply.retry_after_s, config.chunk_timeout_s))
            continue
        if isinstance(reply, Error):
            raise StateSyncError(f"donor refused chunk {chunk}: {reply.message}")
        if not isinstance(reply, StateChunk) or reply.run_id != run.run_id or reply.stage != stage \
                or reply.chunk != chunk:
            raise StateSyncError(f"donor answered chunk {chunk} with something else")
        return reply
    raise AssertionError("unreachable")


async def open_snapshot(transport: Transport, donor: str, run: RunConfig, stage: int, config: StateSyncConfig,
                        limit: int) -> tuple[StateChunk, StateAssembler]:
    """``donor``'s chunk 0 and the builder (``StateAssembler``) of the skeleton it carries, validated;
    StateSyncError or StateFormatError when it is not a usable start of a snapshot."""
    first = await request_chunk(transport, donor, run, stage, 0, config)
    if first.version == 0:
        raise StateSyncError("chunk 0 carries no snapshot version")
    piece_bytes, env = first.meta.get("piece_bytes"), first.tensors.get(SKELETON_KEY)
    if type(piece_bytes) is not int or env is None:
        raise StateSyncError("chunk 0 lacks the skeleton or the piece size")
    try:
        raw = decode(env, TensorSpec(shape=(-1,), dtype=torch.uint8), peer=donor, field="skeleton",
                     max_elements=MAX_SKELETON_CHARS)
        skeleton = raw.numpy().tobytes().decode()
    except (ProtocolError, UnicodeDecodeError) as e:
        raise StateSyncError(f"chunk 0 carries an invalid skeleton: {e}") from e
    builder = await asyncio.get_running_loop().run_in_executor(None, StateAssembler, skeleton, piece_bytes, limit)
    return first, builder


def decode_piece(builder: StateAssembler, key: str, env: TensorEnvelope, donor: str) -> tuple[int, int, torch.Tensor]:
    """(tensor index, offset, piece) of one piece of a chunk, checked against ``builder``'s skeleton."""
    idx, offset = builder.parse_key(key)
    dtype, length = builder.expect(idx, offset)
    try:
        return idx, offset, decode(env, TensorSpec(shape=(length,), dtype=dtype), peer=donor)
    except ProtocolError as e:
        raise StateSyncError(f"piece {key}: {e}") from e


async def _transfer(transport: Transport, donor: str, run: RunConfig, stage: int, config: StateSyncConfig,
                    limit: int, min_step: int = 0) -> dict[str, Any]:
    first, builder = await open_snapshot(transport, donor, run, stage, config, limit)
    step = first.meta.get("local_step")
    if min_step and (type(step) is not int or step < min_step):
        raise SnapshotBehind(f"the donor's snapshot is of local step {step}, {min_step} was asked for")
    loop = asyncio.get_running_loop()
    # up to `window` requests in flight hide the round trip on long links; chunks are applied in order
    pending = {c: asyncio.ensure_future(request_chunk(transport, donor, run, stage, c, config, first.version))
               for c in range(1, min(first.n_chunks, 1 + config.window))}
    try:
        for chunk in range(first.n_chunks):
            reply = first if chunk == 0 else await pending.pop(chunk)
            following = chunk + config.window
            if chunk > 0 and following < first.n_chunks:  # chunks 1..window were requested up front
                pending[following] = asyncio.ensure_future(
                    request_chunk(transport, donor, run, stage, following, config, first.version))
            if reply.version != first.version or reply.n_chunks != first.n_chunks:
                raise StateSyncError("the donor replaced its snapshot mid-transfer")
            await loop.run_in_executor(None, _add_pieces, builder, reply, donor)
    finally:
        for task in pending.values():
            task.cancel()
        await asyncio.gather(*pending.values(), return_exceptions=True)
    state = await loop.run_in_executor(None, builder.finish)
    if not isinstance(state, dict):
        raise StateFormatError(f"the donor's state is a {type(state).__name__}, not a stage's state dict")
    return state


def _add_pieces(builder: StateAssembler, reply: StateChunk, donor: str) -> None:
    for key, env in reply.tensors.items():
        if key == SKELETON_KEY and reply.chunk == 0:
            continue
        idx, offset, piece = decode_piece(builder, key, env, donor)
        builder.put(idx, offset, piece)
        if piece.is_floating_point() and not bool(torch.isfinite(piece).all()):
            raise StateSyncError(f"piece {key} holds NaN or Inf")
