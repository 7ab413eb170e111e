"""Protocol messages: frozen dataclasses, packed as msgpack with strict types and a version.

Why msgpack rather than protobuf: our messages are a handful of small, flat records plus large opaque tensor
payloads. msgpack carries `bytes` as-is (no base64, no varint re-encoding of the payload), needs no generated code or
schema compiler in the build, and its unpacker takes hard limits on string/bin/array/map sizes, which we set from the
frame that was admitted. Type strictness, which protobuf would give, comes from the checkers in protocol.schema that
every message runs in __post_init__, both when we build a message and when we unpack one.

Wire form of every message: msgpack array `[protocol_version, kind, [field, ...]]`, fields in declaration order,
tensors as `[codec_id, dtype, shape, data]`. A message of another version is refused with VersionMismatch, which says
which versions each side speaks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar, cast, dataclass_transform

import msgpack

from protocol import schema as s
from protocol.envelope import TensorEnvelope
from protocol.errors import ErrorCode, MalformedMessage, VersionMismatch

__all__ = [
    "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
    "Message",
    "Hello",
    "Forward",
    "Backward",
    "Ack",
    "Busy",
    "Error",
    "AveragingPart",
    "StateRequest",
    "StateChunk",
    "RecordsRequest",
    "Records",
    "TestimonyRequest",
    "Testimony",
    "Fraud",
    "MAX_DOWNSTREAM",
    "MAX_KEY_BYTES",
    "MAX_SIGNATURE_BYTES",
    "MAX_GOSSIP_RECORDS",
    "StateDigestRequest",
    "Infer",
    "InferResult",
    "pack",
    "unpack",
    "payload_bytes",
    "MESSAGE_KINDS",
]

PROTOCOL_VERSION = 13  # 2: Forward carries `flush` (the synchronous mode's step number); 3: Backward `refused`;
# 4: StateRequest names the snapshot `version` it continues; 5: Infer and InferResult (forward-only generation);
# 6: StateDigestRequest (witnesses of a state send per-tensor digests); averaging partitions are drawn over blocks
# of coordinates (trainer/averaging.py), so a peer of version 5 would average other coordinates under one round number;
# 7: RecordsRequest and Records (membership gossip, peer/membership/gossip.py);
# 8: a sync barrier's AveragingPart ends with the sender's weight digest (peer/averaging/fork.py), one tensor more;
# 9: a subspace run's Forward.tokens is the [batch, block + 1] token window and `targets` is None (the last stage
# cuts the targets from the window); codec int3 (id 7); 10: a middle stage's Backward names its downstream peer, which
# the previous stage's re-checks require (a version-9 middle stage would fail every one), with TestimonyRequest and
# Testimony (peer/pipeline/testimony.py); 11: signed frames (peer/pipeline/attest.py): a later stage's training Forward
# and the gradient a stage from 2 on returns carry their sender's signature, a middle stage relays its witnesses'
# signatures in `Backward.relayed`, a Testimony is the witness's signed copy of both frames, and `Fraud` carries a
# witness's self-contradiction to the hop it lied about; 12: a signed gradient also signs the digest of the forward it
# answers, so `Backward.relayed` and `Fraud.relayed` carry 4 items, and `TestimonyRequest.outgoing` asks a hop for
# its own record of what it sent a witness (a version-11 witness's signature would not verify); 13: a frame's KEEP
# flag (protocol/framing.py): a large request asks to keep its stream for the next, and a known peer's server says so
# on its reply (a version-12 reader refuses the flag as malformed); ErrorCode.OUT_OF_BOUNDS
SUPPORTED_VERSIONS: tuple[int, ...] = (13,)

_stage = s.integer(0, 1023)
_count = s.integer(0, 2**63 - 1)
_route = s.sequence(s.text(), 64)
_tensors = s.sequence(s.envelope, 4096)
#: a libp2p-serialised public key and a signature (RSA-2048 or Ed25519: peer/membership/signing.py)
MAX_KEY_BYTES = MAX_SIGNATURE_BYTES = 1024
_key = s.optional(s.blob(MAX_KEY_BYTES))
_signature = s.optional(s.blob(MAX_SIGNATURE_BYTES))
#: a gradient's signature as relayed: [digest, signature, public key]
_relayed = s.sequence(s.blob(max(MAX_KEY_BYTES, MAX_SIGNATURE_BYTES)), 4)


class Message:
    """Base of all messages. Subclasses are frozen dataclasses with a KIND id and a per-field SCHEMA."""

    KIND: ClassVar[int]
    SCHEMA: ClassVar[dict[str, s.Check]]
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]  # what _message's dataclass gives each subclass
    #: trailing fields (all defaulting to None) that ``pack`` leaves out when None, so that peers that predate them
    #: read the message as before
    OPTIONAL_TAIL: ClassVar[int] = 0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = self.SCHEMA[f.name](getattr(self, f.name), f"{type(self).__name__}.{f.name}")
            object.__setattr__(self, f.name, value)


_M = TypeVar("_M", bound=type)


@dataclass_transform(frozen_default=True)
def _message(kind: int, **schema: s.Check) -> Callable[[_M], _M]:
    """A frozen dataclass message with wire id ``kind`` and one field checker per field, in field order."""

    def wrap(cls: _M) -> _M:
        out: Any = dataclasses.dataclass(frozen=True, kw_only=False)(cls)
        out.KIND, out.SCHEMA = kind, schema
        assert [f.name for f in dataclasses.fields(out)] == list(schema), out
        return cast(_M, out)

    return wrap


@_message(1, protocol_version=s.integer(0, 2**31), run_id=s.text(), stage=_stage, peer_id=s.text(),
          capabilities=s.sequence(s.text(64), 32))  # fmt: skip
class Hello(Message):
    """Peer introduction: which protocol version, run, stage it serves, and optional capabilities."""

    protocol_version: int
    run_id: str
    stage: int
    peer_id: str
    capabilities: list[str]


@_message(2, run_id=s.text(), mb_id=_count, route=_route, activations=s.envelope, targets=s.optional(s.envelope),
          is_eval=s.boolean, sent_at=s.real(0, 1e12), flush=s.optional(_count),
          tokens=s.optional(s.envelope), signer=_key, signature=_signature)  # fmt: skip
class Forward(Message):
    """Activations of micro-batch `mb_id` for the next stage; `route` lists the peer ids it went through so far.

    `flush` is set by stage 0 in the synchronous mode only: the number of the GPipe flush (optimiser step) the
    micro-batch belongs to, so that later stages know when a flush is over without counting micro-batches.
    `tokens`: in runs whose activations are subspace coefficients, the micro-batch's token window [batch, block + 1]:
    its first `block` ids are the inputs (each stage rebuilds the fixed embedding part of the residual stream from
    them), its last `block` the targets, so `targets` is None there; absent otherwise.
    `signer`, `signature`: a training forward of a stage from 1 on is signed by its sender (public key, signature
    over every other field: ``peer.pipeline.attest``), so that what its receiver later testifies of it is provably
    what the sender sent.
    """

    OPTIONAL_TAIL = 3

    run_id: str
    mb_id: int
    route: list[str]
    activations: TensorEnvelope
    targets: TensorEnvelope | None
    is_eval: bool
    sent_at: float
    flush: int | None = None
    tokens: TensorEnvelope | None = None
    signer: bytes | None = None
    signature: bytes | None = None


#: next-stage peers one `Backward` names as the source of its gradient (a spot check's two replicas)
MAX_DOWNSTREAM = 2


@_message(3, run_id=s.text(), mb_id=_count, route=_route, gradient=s.optional(s.envelope),
          loss=s.optional(s.real(-1e30, 1e30)), is_eval=s.boolean, refused=s.boolean,
          downstream=s.optional(s.sequence(s.text(), MAX_DOWNSTREAM)), downstream_id=s.optional(_count),
          signer=_key, signature=_signature,
          relayed=s.optional(s.sequence(_relayed, MAX_DOWNSTREAM)))  # fmt: skip
class Backward(Message):
    """Gradient w.r.t. the activations of `mb_id` (None on evaluation), and the loss the last stage computed.

    `refused`: the last stage would not train on this micro-batch (its loss was far above recent ones): no gradient,
    every stage on the route drops it and holds it against the peer that sent it the micro-batch.
    `downstream`, `downstream_id`: a middle stage's training gradient names the next-stage peers whose gradients it
    was computed from (one, or the two replicas of a spot check, whose mean it trained on) and the id it sent the
    micro-batch to them under, so that the previous stage can ask them what they received and returned
    (`TestimonyRequest`); absent from the last stage.
    `signer`, `signature`: a training gradient returned by a stage from 2 on is signed by its sender (as `Forward`'s).
    `relayed`: with `downstream`, per named peer the [digest, digest of the forward it answers, signature, public
    key] of the signed gradient it returned (so a witness, or the hop, that later testifies other frames contradicts
    the witness's signature).
    """

    OPTIONAL_TAIL = 5

    run_id: str
    mb_id: int
    route: list[str]
    gradient: TensorEnvelope | None
    loss: float | None
    is_eval: bool
    refused: bool = False
    downstream: list[str] | None = None
    downstream_id: int | None = None
    signer: bytes | None = None
    signature: bytes | None = None
    relayed: list[list[bytes]] | None = None


@_message(4)
class Ack(Message):
    """Request accepted; nothing else to say."""


@_message(5, retry_after_s=s.real(0, 3600))
class Busy(Message):
    """The receiver is saturated; retry another peer, or this one after `retry_after_s` seconds."""

    retry_after_s: float


def _error_code(v: Any, where: str) -> ErrorCode:
    if isinstance(v, ErrorCode):
        return v
    try:
        return ErrorCode(s.integer(0, 255)(v, where))
    except ValueError:
        raise s.SchemaError(f"{where} must be one of {[int(c) for c in ErrorCode]}, got {v!r}") from None


@_message(6, code=_error_code, message=s.text(s.MAX_TEXT))
class Error(Message):
    """The request failed: a code the caller can act on and a sentence for the logs."""

    code: ErrorCode
    message: str


@_message(7, run_id=s.text(), stage=_stage, round_no=_count, sender=s.text(), tensors=_tensors,
          weight=s.real(0, 1e6, lo_open=True))  # fmt: skip
class AveragingPart(Message):
    """One replica's values of the round's partition, one flat tensor per parameter, with its averaging weight.

    The schema only bounds `weight` to (0, 1e6]; receivers must still apply their own policy (e.g. clamp to 1).
    """

    run_id: str
    stage: int
    round_no: int
    sender: str
    tensors: list[TensorEnvelope]
    weight: float


@_message(8, run_id=s.text(), stage=_stage, chunk=s.integer(0, 2**20), version=_count)
class StateRequest(Message):
    """Ask a peer for chunk `chunk` of a stage's state. Chunk 0 starts a transfer of the server's current snapshot
    (`version` 0); the other chunks name the snapshot `version` that chunk 0 carried, so a transfer keeps reading one
    snapshot while the server takes newer ones for later requests."""

    run_id: str
    stage: int
    chunk: int
    version: int = 0


@_message(9, run_id=s.text(), stage=_stage, version=_count, chunk=s.integer(0, 2**20), n_chunks=s.integer(1, 2**20),
          meta=s.mapping(s.scalar, 256), tensors=s.mapping(s.envelope, 4096))  # fmt: skip
class StateChunk(Message):
    """Chunk `chunk` of `n_chunks` of a stage's state at `version` (local_step): named tensors and scalar meta."""

    run_id: str
    stage: int
    version: int
    chunk: int
    n_chunks: int
    meta: dict[str, int | float | str | bool]
    tensors: dict[str, TensorEnvelope]

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk >= self.n_chunks:
            raise s.SchemaError(f"StateChunk.chunk {self.chunk} must be below n_chunks {self.n_chunks}")


@_message(12, run_id=s.text(), stage=_stage, seed=_count, dims=s.integer(1, 256))
class StateDigestRequest(Message):
    """Ask a replica of `stage` for the digest of its current state (``peer.state.digest``): per tensor its norm and
    a `dims`-coordinate sketch drawn from `seed`. The reply is a one-chunk `StateChunk`."""

    run_id: str
    stage: int
    seed: int
    dims: int


@_message(10, run_id=s.text(), stage=_stage, inputs=s.envelope, codec=s.text(32))
class Infer(Message):
    """Forward only, for generation: run `inputs` through the receiver's stage at its latest weights, train nothing.

    Stage 0 takes token ids [1, T], a later stage the activations [1, T, n_embd] the previous stage returned. The
    reply is an `InferResult` whose outputs are encoded with `codec` (a name, e.g. "int8", "fp16", "none").
    """

    run_id: str
    stage: int
    inputs: TensorEnvelope
    codec: str


@_message(11, stage=_stage, version=_count, outputs=s.envelope)
class InferResult(Message):
    """The reply to `Infer`: the stage's activations [1, T, n_embd], or on the last stage the logits of the last
    position only [1, vocab]; `version` is the local step of the weights that computed them."""

    stage: int
    version: int
    outputs: TensorEnvelope


@_message(13, run_id=s.text())
class RecordsRequest(Message):
    """Ask a peer for the signed swarm records of run `run_id` it holds (membership gossip: a DHT that withholds
    records cannot hide the swarm from a peer that reaches any honest member). The reply is `Records`."""

    run_id: str


#: records one `Records` reply carries at most, and the largest signed envelope field (as the DHT's own bound)
MAX_GOSSIP_RECORDS = 256
MAX_RECORD_FIELD = 8 * 1024


def _signed_record(v: Any, where: str) -> dict[str, Any]:
    """One record as the DHT stores it: the owner's peer id `p`, its expiration `e` and the signed envelope (`b`
    body, `k` public key, `s` signature, optional `c` credential); the signature is the receiver's to check."""
    if type(v) is not dict or not {"p", "e", "b", "k", "s"} <= set(v) <= {"p", "e", "b", "k", "s", "c"}:
        raise s.SchemaError(f"{where} must be a signed record {{p, e, b, k, s[, c]}}")
    out: dict[str, Any] = {"p": s.text()(v["p"], f"{where}.p"), "e": s.real(0, 1e12)(v["e"], f"{where}.e")}
    for k in ("b", "k", "s", "c"):
        if k in v:
            out[k] = s.blob(MAX_RECORD_FIELD)(v[k], f"{where}.{k}")
    return out


@_message(14, run_id=s.text(), records=s.sequence(_signed_record, MAX_GOSSIP_RECORDS))
class Records(Message):
    """The reply to `RecordsRequest`: signed records, newest first; each is checked like a DHT read's."""

    run_id: str
    records: list[dict[str, Any]]


#: peers one `Vouches` reply names at most
MAX_VOUCHES = 256


@_message(15, run_id=s.text())
class VouchesRequest(Message):
    """Ask a peer which peers did validated work for it (a trained gradient, a passed check, an accepted averaging
    part): a joiner with no history of its own draws the witnesses of a state from the peers its initial peers vouch
    for. The reply is `Vouches`."""

    run_id: str


@_message(16, run_id=s.text(), peers=s.sequence(s.text(), MAX_VOUCHES))
class Vouches(Message):
    """The reply to `VouchesRequest`: the peer ids the answering peer knows by validated work, the most recent last."""

    run_id: str
    peers: list[str]


@_message(17, run_id=s.text(), sender=s.text(), mb_id=_count, outgoing=s.boolean)
class TestimonyRequest(Message):
    """Ask a peer what it received from `sender` as micro-batch `mb_id`, and what it returned. The peer that asks
    serves the stage two before the answering one (it holds a copy of `sender`'s stage and re-computes both from what
    it sent `sender` itself: ``peer.pipeline.testimony``); anyone may ask, within a rate limit. The reply is
    `Testimony`, or `Error` NOT_FOUND when no such micro-batch was trained here.

    `outgoing`: ask a hop instead for its own record of micro-batch `mb_id` it sent to `sender` (its witness) and
    the gradient `sender` returned (when the witness is silent)."""

    OPTIONAL_TAIL = 1

    run_id: str
    sender: str
    mb_id: int
    outgoing: bool = False


@_message(18, forward=s.blob(2**31), backward=s.blob(2**31), signer=s.blob(MAX_KEY_BYTES),
          signature=s.blob(MAX_SIGNATURE_BYTES))  # fmt: skip
class Testimony(Message):
    """The reply to `TestimonyRequest`: the packed `Forward` received (signed by its sender) and the packed
    `Backward` returned for it (signed by the witness), both as they crossed the wire, and the answering peer's
    signature over the two (the witness's, or the hop's for its own record: ``peer.pipeline.attest``). Frames are
    bounded by the handler limits of their own kinds."""

    forward: bytes
    backward: bytes
    signer: bytes
    signature: bytes


@_message(19, run_id=s.text(), witness=s.text(), mb_id=_count, testimony=s.blob(2**31),
          relayed=_relayed)  # fmt: skip
class Fraud(Message):
    """A witness's self-contradiction, told to the hop it testified about (``peer.pipeline.attest``): the packed
    `Testimony` the `witness` gave about the hop's micro-batch `mb_id`, and the [digest, forward digest, signature,
    public key] of the gradient it returned for it, as the hop relayed them. The hop checks it alone (nothing in it
    needs trust in the teller)."""

    run_id: str
    witness: str
    mb_id: int
    testimony: bytes
    relayed: list[bytes]


MESSAGE_KINDS: dict[int, type[Message]] = {
    cls.KIND: cls for cls in (Hello, Forward, Backward, Ack, Busy, Error, AveragingPart, StateRequest, StateChunk,
                              Infer, InferResult, StateDigestRequest, RecordsRequest, Records,
                              VouchesRequest, Vouches, TestimonyRequest, Testimony, Fraud)
}


def payload_bytes(msg: Message) -> int:
    """Total tensor payload bytes a message carries (to decide whether (un)packing it belongs off the event loop)."""
    total = 0
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else (value,)
        total += sum(len(v.data) for v in items if isinstance(v, TensorEnvelope))
    return total


def pack(msg: Message) -> bytes:
    """Serialise a message (its fields were checked when it was built)."""
    if not isinstance(msg, Message):
        raise TypeError(f"pack expects a protocol message, got {type(msg).__name__}")
    fields = [s.to_wire(getattr(msg, f.name)) for f in dataclasses.fields(msg)]
    for _ in range(msg.OPTIONAL_TAIL):
        if fields[-1] is not None:
            break
        fields.pop()
    return bytes(msgpack.packb([PROTOCOL_VERSION, msg.KIND, fields], use_bin_type=True))


def _no_ext(code: int, data: bytes) -> Any:
    raise MalformedMessage(f"msgpack extension type {code} is not part of the protocol")


def unpack(data: bytes | bytearray) -> Message:
    """Parse and check a message; raises MalformedMessage or VersionMismatch, never anything else."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise MalformedMessage(f"expected bytes, got {type(data).__name__}")
    n = len(data)
    try:
        obj = msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True, ext_hook=_no_ext, timestamp=0,
            max_str_len=n, max_bin_len=n, max_array_len=n, max_map_len=n, max_ext_len=0,
        )  # fmt: skip
    except MalformedMessage:
        raise
    except Exception as e:  # msgpack raises a zoo of types (ExtraData, FormatError, StackError, ValueError...)
        raise MalformedMessage(f"not a msgpack message: {type(e).__name__}: {e}") from None
    if type(obj) is not list or len(obj) != 3 or type(obj[0]) is not int:
        raise MalformedMessage("a message must be the array [protocol_version, kind, fields]")
    version, kind, fields = obj
    if version not in SUPPORTED_VERSIONS:
        raise VersionMismatch(version, SUPPORTED_VERSIONS)
    cls = MESSAGE_KINDS.get(kind) if type(kind) is int else None
    if cls is None:
        raise MalformedMessage(f"unknown message kind {kind!r}; known kinds: {sorted(MESSAGE_KINDS)}")
    if type(fields) is not list or not len(cls.SCHEMA) - cls.OPTIONAL_TAIL <= len(fields) <= len(cls.SCHEMA):
        raise MalformedMessage(f"{cls.__name__} needs {len(cls.SCHEMA)} fields: {', '.join(cls.SCHEMA)}")
    try:
        return cls(*fields)
    except s.SchemaError as e:
        raise MalformedMessage(str(e)) from None
