"""Signed pipeline frames: what a witness testifies about a hop is provably what the hop sent and what it returned.

A middle stage's work is re-checked with the testimony of the peer it sent the micro-batch on to
(``peer.pipeline.testimony``). Unsigned, that testimony is the witness's word: one identity of stage k + 2 could
say an honest hop of stage k + 1 sent it rows it never sent, and the hop would fail its re-checks. So every frame a
testimony is made of is signed by the peer that sent it, with its identity key (``peer.membership.signing``):

* a training ``Forward`` sent by a stage from 1 on: by its sender (the hop); its receiver refuses it unsigned;
* a training ``Backward`` with a gradient, returned by a stage from 2 on: by its sender (the witness), over the
  gradient frame and the digest of the forward frame it answers; the middle stage it returns to refuses it unsigned
  or answering another forward than the one it sent, and relays the [digest, forward digest, signature] of each such
  gradient it trained on in the gradient it returns itself (``Backward.relayed``);
* a ``Testimony``: the two frames as they crossed the wire, and the signature over both of the peer that gives it:
  the witness, or the hop itself (its own record of what it sent and got back).

The relayed signature binds both frames: the witness states which forward it received and which gradient it
returned. The stage that re-checks then tells who lied (``judge``): a relayed signature that does not verify is the
hop's lie (checked before anyone is asked: it also proves the witness trained the micro-batch); frames other than
the ones the relayed signature names are the lie of whoever testified them, proven by its own signature over the
testimony. A witness's lie is sent to the hop it lied about (``Fraud``), which checks the proof with ``judge`` alone
and never sends work to that witness again; a hop that was told and still names the witness fails its re-check (a
colluding hop would have its liar testify for it forever otherwise).

A witness that stays silent, or says it holds no such micro-batch, no longer decides anything: the re-checking stage
then asks the hop for its own record, which the witness's relayed signature binds as tightly as the witness's
testimony. Only when the hop cannot answer either is the micro-batch left unjudged (the unheard rule,
``testimony.UNHEARD_STRIKE``, docs/security.md).

A frame's digest is the SHA-256 of the packed message with its own signature fields cleared and every tensor payload
replaced by its SHA-256, so it covers the run, the micro-batch id, the route, the tensors and the names, and packing
is deterministic (``protocol.messages.pack``).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from typing import Protocol, TypeVar

from msgpack import packb

from peer.membership.signing import Signer, peer_id_of, verify
from protocol.envelope import TensorEnvelope
from protocol.errors import ProtocolError
from protocol.messages import Backward, Forward, Message, Testimony, pack, unpack

__all__ = ["FRAUD_RPC", "KeyNotary", "Notary", "Verdict", "digest", "judge", "relay", "relayed_ok", "sign",
           "signed_by", "signed_frame", "testify"]
#: what a hop relays of each witness's signed gradient: [digest, the answered forward's digest, signature, key]
RELAYED_ITEMS = 4

FRAUD_RPC = "fraud"
"""The handler that takes a ``Fraud`` (a witness's proven lie about this hop)."""
DOMAIN = b"asyncmesh/frame/v1"


class Notary(Protocol):
    """Signs this peer's statements and checks a named peer's (the identity key; tests bind names to keys)."""

    def sign(self, data: bytes) -> tuple[bytes, bytes]:
        """(our public key, our signature over ``data``)."""
        ...

    def check(self, peer_id: str, key: bytes, data: bytes, signature: bytes) -> bool:
        """Whether ``key`` is ``peer_id``'s and ``signature`` over ``data`` verifies with it; never raises."""
        ...


class KeyNotary:
    """The peer's identity key: a peer id is the hash of its public key, so any key checks against any id alone."""

    def __init__(self, signer: Signer) -> None:
        self.signer = signer

    def sign(self, data: bytes) -> tuple[bytes, bytes]:
        return self.signer.public_key, self.signer.sign(data)

    def check(self, peer_id: str, key: bytes, data: bytes, signature: bytes) -> bool:
        try:
            if peer_id_of(key) != peer_id:
                return False
        except Exception:  # a key that cannot be hashed is not anybody's
            return False
        return verify(key, data, signature)


F = TypeVar("F", Forward, Backward)


def digest(msg: Message) -> bytes:
    """What a frame's sender signs: SHA-256 of ``msg`` packed with its ``signer`` and ``signature`` cleared and each
    tensor's payload replaced by the payload's own SHA-256 (a large payload is hashed once where it lies, not first
    copied into a packed message: half the cost for a 16 MiB frame)."""
    light: dict[str, TensorEnvelope] = {}
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        if isinstance(value, TensorEnvelope):
            light[f.name] = dataclasses.replace(value, data=hashlib.sha256(value.data).digest())
    return hashlib.sha256(pack(dataclasses.replace(msg, signer=None, signature=None, **light))).digest()


def _statement(kind: bytes, sender: str, about: str, *digests: bytes) -> bytes:
    return bytes(packb([DOMAIN, kind, sender, about, *digests], use_bin_type=True))


def _frame_statement(msg: Forward | Backward, sender: str, recipient: str, d: bytes, answers: bytes) -> bytes:
    # a forward's receiver is whoever takes it (a hop retries elsewhere with the same frame); a gradient's is named,
    # with the digest of the forward it answers
    if isinstance(msg, Forward):
        return _statement(b"forward", sender, "", d)
    return _statement(b"backward", sender, recipient, d, answers)


def sign(notary: Notary, msg: F, sender: str, recipient: str = "", answers: bytes = b"") -> F:
    """``msg`` signed by ``sender`` (a ``Backward``: to ``recipient``, the peer it returns to, answering the forward
    frame of digest ``answers``)."""
    return signed_frame(notary, msg, sender, recipient, answers)[0]


def signed_frame(notary: Notary, msg: F, sender: str, recipient: str = "", answers: bytes = b"") -> tuple[F, bytes]:
    """``sign``, and the frame's digest (hashed once)."""
    d = digest(msg)
    key, signature = notary.sign(_frame_statement(msg, sender, recipient, d, answers))
    return dataclasses.replace(msg, signer=key, signature=signature), d


def signed_by(notary: Notary, msg: Forward | Backward, sender: str, recipient: str = "",
              answers: bytes = b"") -> bytes | None:
    """The digest of ``msg`` when it carries ``sender``'s valid signature (a ``Backward``: to ``recipient``,
    answering the forward of digest ``answers``), else None."""
    if msg.signer is None or msg.signature is None:
        return None
    d = digest(msg)
    ok = notary.check(sender, msg.signer, _frame_statement(msg, sender, recipient, d, answers), msg.signature)
    return d if ok else None


def relay(msg: Backward, d: bytes, answers: bytes) -> list[bytes]:
    """What a hop relays of a signed gradient ``msg`` (digest ``d``, answering the forward of digest ``answers``):
    [digest, forward digest, signature, public key]."""
    assert msg.signature is not None and msg.signer is not None
    return [d, answers, msg.signature, msg.signer]


def relayed_ok(notary: Notary, witness: str, hop: str, relayed: list[bytes] | None) -> bool:
    """Whether a hop's relayed [digest, forward digest, signature, key] is ``witness``'s signature of a gradient it
    returned to ``hop`` for that forward: proof that the witness trained the micro-batch, of what it received, and of
    which gradient it returned."""
    if relayed is None or len(relayed) != RELAYED_ITEMS:
        return False
    d, answers, signature, key = relayed
    return notary.check(witness, key, _statement(b"backward", witness, hop, d, answers), signature)


def _testimony_statement(by: str, witness: str, hop: str, fwd: bytes, bwd: bytes) -> bytes:
    # the witness testifies (b"testimony"), or the hop gives its own record (b"record")
    kind = b"testimony" if by == witness else b"record"
    return _statement(kind, witness, hop, hashlib.sha256(fwd).digest(), hashlib.sha256(bwd).digest())


def testify(notary: Notary, witness: str, hop: str, forward: Forward, backward: Backward, *,
            by: str | None = None) -> Testimony:
    """The signed testimony of the forward ``hop`` sent ``witness`` and the gradient the witness returned, given by
    the witness (``by`` None or the witness) or by the hop from its own record (``by`` the hop)."""
    fwd, bwd = pack(forward), pack(backward)
    key, signature = notary.sign(_testimony_statement(by or witness, witness, hop, fwd, bwd))
    return Testimony(forward=fwd, backward=bwd, signer=key, signature=signature)


class Verdict(enum.Enum):
    """What a testimony shows (``judge``)."""

    OK = "ok"  # both frames are what their senders signed: the rows can judge the hop
    WITNESS_LIED = "witness_lied"  # the witness signed a testimony its own or the hop's signatures contradict
    HOP_LIED = "hop_lied"  # the hop relayed a signature its witness never made
    UNUSABLE = "unusable"  # not a signed testimony of this micro-batch at all: as if the witness were silent


@dataclasses.dataclass(frozen=True)
class Judged:
    """``judge``'s answer: the verdict, why, and on OK the two frames."""

    verdict: Verdict
    why: str = ""
    forward: Forward | None = None
    backward: Backward | None = None


def judge(notary: Notary, testimony: Testimony, *, run_id: str, hop: str, witness: str, mb_id: int,
          relayed: list[bytes] | None, by: str | None = None) -> Judged:
    """Who lied, if anyone, in the testimony about ``hop``'s micro-batch ``mb_id`` (the id the hop sent it on
    under) given by ``by`` (None or ``witness``: the witness; ``hop``: the hop's own record), given what the hop
    relayed of the witness's signed gradient. Frames other than those the relayed signature names are the lie of
    whoever signed the testimony: ``WITNESS_LIED``, or ``HOP_LIED`` for the hop's own record. Pure: the hop runs it on
    a ``Fraud`` with the same inputs as the stage that re-checked it."""
    teller = by or witness
    lied = Verdict.WITNESS_LIED if teller == witness else Verdict.HOP_LIED
    if relayed is None or not relayed_ok(notary, witness, hop, relayed):
        return Judged(Verdict.HOP_LIED, "the hop relayed no signature its witness made")
    if not notary.check(teller, testimony.signer, _testimony_statement(teller, witness, hop, testimony.forward,
                                                                        testimony.backward), testimony.signature):
        return Judged(Verdict.UNUSABLE, "the testimony is not signed by the peer that gave it")
    try:
        fwd, bwd = unpack(testimony.forward), unpack(testimony.backward)
    except ProtocolError as e:
        return Judged(lied, f"it signed frames that do not parse ({e})")
    if not isinstance(fwd, Forward) or not isinstance(bwd, Backward) or fwd.run_id != run_id \
            or bwd.run_id != run_id or fwd.mb_id != mb_id or bwd.mb_id != mb_id or fwd.is_eval or bwd.is_eval \
            or bwd.gradient is None or not fwd.route or fwd.route[-1] != hop:
        return Judged(lied, f"it signed frames other than a training micro-batch {mb_id} of the hop")
    d_fwd = signed_by(notary, fwd, hop)
    if d_fwd is None:
        return Judged(lied, "it testified activations the hop never signed")
    if d_fwd != relayed[1]:
        return Judged(lied, "it testified activations other than those the witness signed it received")
    d = signed_by(notary, bwd, witness, hop, d_fwd)
    if d is None:
        return Judged(lied, "it testified a gradient the witness did not sign")
    if d != relayed[0]:
        return Judged(lied, "it testified a gradient other than the one the witness signed and returned")
    return Judged(Verdict.OK, forward=fwd, backward=bwd)
