"""Membership: each peer's expiring DHT record, re-announced on a timer, and a validated snapshot of the swarm.

All records of one run live under one DHT key, ``"{run_id}:peers"``, one subkey per peer id, so a single read
returns the whole swarm. Records expire ``expiration_s`` after their announcement: a dead peer disappears from
routing and stage choice without anyone having to notice it. A stopping peer re-announces itself with state
``"stopped"`` (a DHT entry cannot be shortened, only superseded), which readers treat as absent.

Every record is signed by its owner's identity key (``signing.py``): each node's DHT refuses to store a record that is
not signed by the peer id it is stored under, and readers check the signature again. Reads are the network boundary:
every value is validated field by field (a malformed record is skipped and counted,
never raised), and every read runs under a hard timeout because hivemind's ``get`` can hang on malformed data.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from hivemind.utils import get_dht_time

from peer.lifecycle import PeerState
from peer.membership.admission import check as check_credential
from peer.membership.signing import SignatureError, SignedRecordValidator, Signer, open_envelope, seal

if TYPE_CHECKING:
    from hivemind import DHT

logger = logging.getLogger(__name__)

MAX_MADDRS = 8
MAX_STR = 256
BACKUP_FIELDS = ("backup_stage", "backup_step", "backup_taken_at")


class RecordError(ValueError):
    """A DHT value that is not a valid PeerRecord."""


@dataclass(frozen=True, kw_only=True)
class PeerRecord:
    """What one peer tells the swarm about itself."""

    peer_id: str
    """libp2p peer id (base58), also the DHT subkey."""
    stage: int
    """Pipeline stage served."""
    throughput: float
    """Work units per second: micro-batches/s it sustains at its stage times that stage's relative cost."""
    queue: int
    """Work items waiting for its compute thread (routing prefers short queues)."""
    version: int
    """State version (local optimiser steps applied); donors with the highest version serve state."""
    state: PeerState
    """What it is doing (a string naming a ``PeerState`` is taken too); only TRAINING peers receive micro-batches."""
    maddrs: list[str] = field(default_factory=list)
    """Multiaddrs it can be dialled at."""
    reachable: bool = True
    """Result of its reachability self-check."""
    tokens_per_s: float = 0.0
    """Tokens it processed per second recently (dashboards)."""
    loss: float | None = None
    """Its latest training loss, when it knows one (dashboards)."""
    tokens: int = 0
    """Training tokens it has processed since it started (swarm progress; optional, 0 when absent)."""
    val_loss: float | None = None
    """Its latest validation loss, when it knows one (swarm progress; optional)."""
    backup_stage: int | None = None
    """The stage of the neighbour copy it keeps (``peer.state.spare``); None: none (the three backup fields are
    optional, left out of the value when None so that older peers' validators still accept the record)."""
    backup_step: int | None = None
    """That copy's training step (local_step)."""
    backup_taken_at: float | None = None
    """When that copy was taken (Unix time), so a peer restoring from it can say how old it is."""
    data_shard: int | None = None
    """Stage 0 on a streamed dataset: the data shard it reads (``peer.pipeline.shards``); None: none (optional, left
    out of the value when None)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", PeerState(self.state))
        present = [f is not None for f in (self.backup_stage, self.backup_step, self.backup_taken_at)]
        if any(present) and not all(present):
            raise ValueError("backup_stage, backup_step and backup_taken_at are set together or not at all")

    def to_value(self) -> dict[str, Any]:
        value = asdict(self)
        value["state"] = self.state.value  # a plain string on the wire
        if self.backup_stage is None:
            for name in BACKUP_FIELDS:
                del value[name]
        if self.data_shard is None:
            del value["data_shard"]
        return value

    @classmethod
    def from_value(cls, peer_id: str, value: object) -> PeerRecord:
        """Validate a value read from the DHT; raises RecordError naming the bad field."""
        if not isinstance(value, dict):
            raise RecordError(f"record is a {type(value).__name__}, not a dict")
        if value.get("peer_id") != peer_id:
            raise RecordError("peer_id does not match the subkey it is stored under")
        _check(value, "stage", int, lambda v: 0 <= v < 1_000_000)
        _check(value, "throughput", (int, float), lambda v: math.isfinite(v) and 0 <= v < 1e12)
        _check(value, "queue", int, lambda v: 0 <= v < 1_000_000_000)
        _check(value, "version", int, lambda v: 0 <= v < 2**62)
        _check(value, "state", str, lambda v: PeerState.parse(v) is not None)
        _check(value, "maddrs", list, lambda v: len(v) <= MAX_MADDRS
               and all(isinstance(a, str) and len(a) <= MAX_STR for a in v))
        _check(value, "reachable", bool, lambda v: True)
        _check(value, "tokens_per_s", (int, float), lambda v: math.isfinite(v) and 0 <= v < 1e15)
        loss = value.get("loss")
        bad_loss = not isinstance(loss, (int, float)) or isinstance(loss, bool) or not math.isfinite(loss)
        if loss is not None and bad_loss:
            raise RecordError("field 'loss' must be a finite number or None")
        optional = {"tokens": value.get("tokens", 0), "val_loss": value.get("val_loss")}  # absent in older records
        if "tokens" in value:
            _check(value, "tokens", int, lambda v: 0 <= v < 2**62)
        val = optional["val_loss"]
        if val is not None and (not isinstance(val, (int, float)) or isinstance(val, bool) or not math.isfinite(val)):
            raise RecordError("field 'val_loss' must be a finite number or None")
        extra = set(value) - {f for f in cls.__dataclass_fields__}
        if extra:
            raise RecordError(f"unknown fields {sorted(extra)}")
        backup = _backup(value)
        if value.get("data_shard") is not None:
            _check(value, "data_shard", int, lambda v: 0 <= v < 1_000_000)
            backup["data_shard"] = value["data_shard"]
        return cls(peer_id=peer_id, stage=value["stage"], throughput=float(value["throughput"]), queue=value["queue"],
                   version=value["version"], state=value["state"], maddrs=list(value["maddrs"]),
                   reachable=value["reachable"], tokens_per_s=float(value["tokens_per_s"]),
                   loss=None if loss is None else float(loss), tokens=optional["tokens"],
                   val_loss=None if val is None else float(val), **backup)


def _backup(value: dict[str, Any]) -> dict[str, Any]:
    """The backup fields of a record value: all three or none (None values count as absent)."""
    present = [value.get(name) is not None for name in BACKUP_FIELDS]
    if not any(present):
        return {}
    if not all(present):
        raise RecordError(f"fields {list(BACKUP_FIELDS)} must be given together")
    _check(value, "backup_stage", int, lambda v: 0 <= v < 1_000_000)
    _check(value, "backup_step", int, lambda v: 0 <= v < 2**62)
    _check(value, "backup_taken_at", (int, float), lambda v: math.isfinite(v) and 0 < v < 1e11)
    return {"backup_stage": value["backup_stage"], "backup_step": value["backup_step"],
            "backup_taken_at": float(value["backup_taken_at"])}


def _check(value: dict[str, Any], name: str, types: type | tuple[type, ...], ok: Callable[[Any], bool]) -> None:
    if name not in value:
        raise RecordError(f"field {name!r} is missing")
    v = value[name]
    if isinstance(v, bool) and types is not bool:
        raise RecordError(f"field {name!r} must not be a bool")
    if not isinstance(v, types) or not ok(v):
        raise RecordError(f"field {name!r} has an invalid value {str(v)[:64]!r}")


def swarm_key(run_id: str) -> str:
    """The DHT key all records of one run are stored under."""
    return f"{run_id}:peers"


#: why records were rejected on read, by reason (tests and the status endpoint read it)
rejected: Counter[str] = Counter()


def record_validator(run_id: str, organiser_key: bytes | None = None) -> SignedRecordValidator:
    """The validator every node of the run installs in its DHT: owner-signed, schema-valid, bounded expiration; in a
    closed run (``organiser_key``) also carrying a credential that admits its owner."""
    return SignedRecordValidator(swarm_key(run_id), PeerRecord.from_value, admission_check(run_id, organiser_key))


def admission_check(run_id: str, organiser_key: bytes | None) -> Callable[[str, bytes | None, float], None] | None:
    """A closed run's check that a record's credential admits its owner until the record expires (None: open run)."""
    return None if organiser_key is None else functools.partial(_admitted, organiser_key, run_id)


def _admitted(organiser_key: bytes, run_id: str, peer_id: str, credential: bytes | None, expiration: float) -> None:
    """Raises unless ``credential`` admits ``peer_id`` now and at least until the record's ``expiration``: a record
    cannot outlive its credential."""
    c = check_credential(credential, organiser_key=organiser_key, run_id=run_id, peer_id=peer_id)
    if c.expires_at < expiration:
        raise ValueError("the record would outlive its credential; renew the credential")


Keep = Callable[[str, object, float, PeerRecord], None]
"""keep(peer_id, stored envelope, expiration, record): told of every valid record read or announced (gossip's book)."""


async def announce(dht: DHT, run_id: str, record: PeerRecord, expiration_s: float, *, signer: Signer,
                   credential: bytes | None = None, keep: Keep | None = None) -> bool:
    """Store (or refresh) this peer's signed record, expiring ``expiration_s`` from now. False if no node took it.
    ``credential``: this peer's admission to a closed run (carried in the record)."""
    if record.peer_id != signer.peer_id:
        raise ValueError("a peer can only announce its own record (the signer's peer id)")
    expiration = get_dht_time() + expiration_s
    value = seal(signer, swarm_key(run_id), record.to_value(), expiration, credential)
    if keep is not None:
        keep(record.peer_id, value, expiration, record)
    future = dht.store(swarm_key(run_id), value, expiration, subkey=record.peer_id, return_future=True)
    try:
        return bool(await asyncio.wait_for(future, timeout=expiration_s))
    except TimeoutError:
        future.cancel()
        logger.warning("announcing our DHT record timed out after %.0f s; will retry on the next announcement",
                       expiration_s)
        return False


async def withdraw(dht: DHT, run_id: str, record: PeerRecord, expiration_s: float, *, signer: Signer,
                   credential: bytes | None = None, keep: Keep | None = None) -> bool:
    """Supersede this peer's record with a 'stopped' one so readers drop it before its old record expires."""
    return await announce(dht, run_id, replace(record, state=PeerState.STOPPED, queue=0, throughput=0.0), expiration_s,
                          signer=signer, credential=credential, keep=keep)


async def fetch_swarm(dht: DHT, run_id: str, *, timeout: float, include_stopped: bool = False,
                      keep: Keep | None = None) -> dict[str, PeerRecord]:
    """All valid, unexpired records of the run, keyed by peer id. Never raises on bad data; {} on timeout."""
    future = dht.get(swarm_key(run_id), latest=True, return_future=True)
    try:
        found = await asyncio.wait_for(future, timeout=timeout)
    except TimeoutError:
        future.cancel()
        rejected["timeout"] += 1
        logger.debug("reading the swarm's records timed out after %.1f s", timeout)
        return {}
    except Exception as e:  # a DHT failure must not take the peer down; the next read retries
        rejected["dht_error"] += 1
        logger.debug("reading the swarm's records failed: %r", e)
        return {}
    return parse_swarm(found, run_id, include_stopped=include_stopped, keep=keep)


def parse_swarm(found: object, run_id: str, *, include_stopped: bool = False,
                keep: Keep | None = None) -> dict[str, PeerRecord]:
    """Turn a raw ``DHT.get`` result into signature-checked, validated records (pure; unit-tested)."""
    records: dict[str, PeerRecord] = {}
    if found is None:
        return records
    entries = getattr(found, "value", None)
    if not isinstance(entries, dict):
        rejected["not_a_dict"] += 1
        return records
    for subkey, item in entries.items():
        value = getattr(item, "value", item)
        try:
            if not isinstance(subkey, str) or len(subkey) > MAX_STR:
                raise RecordError("subkey is not a peer id string")
            body = open_envelope(swarm_key(run_id), subkey, value, getattr(item, "expiration_time", None))
            record = PeerRecord.from_value(subkey, body)
        except SignatureError as e:
            rejected["bad_signature"] += 1
            logger.debug("ignoring an unsigned or forged DHT record under %r: %s", str(subkey)[:64], e)
            continue
        except RecordError as e:
            rejected["invalid"] += 1
            logger.debug("ignoring an invalid DHT record under %r: %s", str(subkey)[:64], e)
            continue
        if keep is not None:
            keep(record.peer_id, value, float(getattr(item, "expiration_time", 0.0) or 0.0), record)
        if record.state is not PeerState.STOPPED or include_stopped:
            records[record.peer_id] = record
    return records
