"""Owned DHT records: each record is signed by its peer's libp2p identity key and every node refuses the rest.

A record is stored under the run's key with the peer id as subkey, as an envelope ``{"b": body, "k": public key,
"s": signature}`` (+ ``"c"``: a closed run's credential); the signature covers a domain, the run key, the peer id, the
expiration, the body and the credential, and the peer id is derived from ``k``, so checking needs no lookup and
neither the expiration nor the credential can be swapped. ``SignedRecordValidator`` runs in every node's DHT (and
refuses every other key); readers check again with ``open_envelope``. Keys are Ed25519 or RSA-2048 with e = 65537
only (one cost per signature), and verified signatures are remembered. docs/security.md gives the threat model.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, padding, rsa
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time

from peer.config import MAX_RECORD_TTL_S

logger = logging.getLogger(__name__)

DOMAIN = "asyncmesh/record/v2"
CLOCK_SLACK_S = 30.0
"""Tolerated clock difference between the signer and a validating node, on top of MAX_RECORD_TTL_S."""
MAX_ENVELOPE_BYTES = 8 * 1024
MAX_PUBLIC_KEY_BYTES = 1024
RSA_BITS, RSA_EXPONENT = 2048, 65537
"""The only RSA keys accepted: libp2p's and hivemind's identities (a fixed verification cost)."""
MAX_LIVE_RECORDS = 8192
"""Unexpired records one node's validator lets its DHT hold under the run's key (x MAX_ENVELOPE_BYTES: 64 MiB)."""
VERIFIED_CACHE = 8192
"""Signatures remembered as verified (each entry is a hash: ~100 bytes)."""
_ID_INLINE_MAX = 42  # libp2p: public keys up to 42 bytes are inlined in the peer id (identity multihash)


class SignatureError(ValueError):
    """An envelope whose signature, key or expiration is not acceptable."""


def peer_id_of(public_key: bytes) -> str:
    """The base58 libp2p peer id of a serialised libp2p public key (protobuf)."""
    if len(public_key) <= _ID_INLINE_MAX:  # multihash: code 0x00 (identity), length, the key itself
        multihash = bytes([0x00, len(public_key)]) + public_key
    else:
        multihash = bytes([0x12, 0x20]) + hashlib.sha256(public_key).digest()  # 0x12: sha2-256
    peer_id: str = PeerID(multihash).to_base58()
    return peer_id


class Signer:
    """A peer's private identity key, used to sign its own records (and, by an organiser, admissions)."""

    def __init__(self, private_key: rsa.RSAPrivateKey | ed25519.Ed25519PrivateKey) -> None:
        self._key = private_key
        public = private_key.public_key()
        if isinstance(private_key, rsa.RSAPrivateKey):
            data = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
            key_type = crypto_pb2.RSA
        else:
            data = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
            key_type = crypto_pb2.Ed25519
        self.public_key: bytes = crypto_pb2.PublicKey(key_type=key_type, data=data).SerializeToString()
        """The libp2p-serialised public key (what ``peer_id_of`` hashes)."""
        self.peer_id: str = peer_id_of(self.public_key)

    @classmethod
    def from_identity_file(cls, path: Path) -> Signer:
        """Load a libp2p private key file (the one ``--identity`` points at; RSA or Ed25519)."""
        key = crypto_pb2.PrivateKey.FromString(Path(path).expanduser().read_bytes())
        return cls.from_protobuf(key)

    @classmethod
    def from_protobuf(cls, key: crypto_pb2.PrivateKey) -> Signer:
        private: rsa.RSAPrivateKey | ed25519.Ed25519PrivateKey
        if key.key_type == crypto_pb2.RSA:
            loaded = serialization.load_der_private_key(key.data, password=None)
            if not isinstance(loaded, rsa.RSAPrivateKey):
                raise ValueError(f"the identity key says RSA but holds a {type(loaded).__name__}; use an RSA or "
                                 "Ed25519 key")
            private = loaded
        elif key.key_type == crypto_pb2.Ed25519:
            private = ed25519.Ed25519PrivateKey.from_private_bytes(key.data[:32])
        else:
            raise ValueError(f"unsupported identity key type {key.key_type}; use an RSA or Ed25519 key")
        return cls(private)

    @classmethod
    def generate(cls) -> Signer:
        """A fresh Ed25519 identity (tests, tools, organiser keys)."""
        return cls(ed25519.Ed25519PrivateKey.generate())

    def private_protobuf(self) -> bytes:
        """The key as a libp2p private key file (Ed25519: 32-byte seed + 32-byte public key)."""
        if isinstance(self._key, rsa.RSAPrivateKey):
            data = self._key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL,
                                           serialization.NoEncryption())
            rsa_file: bytes = crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=data).SerializeToString()
            return rsa_file
        seed = self._key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                       serialization.NoEncryption())
        raw_public = self._key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        key = crypto_pb2.PrivateKey(key_type=crypto_pb2.Ed25519, data=seed + raw_public)
        key_file: bytes = key.SerializeToString()
        return key_file

    def sign(self, data: bytes) -> bytes:
        if isinstance(self._key, rsa.RSAPrivateKey):
            return self._key.sign(data, padding.PKCS1v15(), hashes.SHA256())
        return self._key.sign(data)


def verify(public_key: bytes, data: bytes, signature: bytes) -> bool:
    """True when ``signature`` over ``data`` verifies with the libp2p-serialised ``public_key``; never raises.
    Only Ed25519 keys and RSA keys of ``RSA_BITS`` bits with exponent ``RSA_EXPONENT`` are accepted."""
    if len(public_key) > MAX_PUBLIC_KEY_BYTES or len(signature) > 1024:
        return False
    digest = hashlib.sha256(b"%d:%d:" % (len(public_key), len(data)) + public_key + data + signature).digest()
    if digest in _verified:
        _verified.move_to_end(digest)
        return True
    if not _verify(public_key, data, signature):
        return False
    _verified[digest] = None
    while len(_verified) > VERIFIED_CACHE:
        _verified.popitem(last=False)
    return True


_verified: OrderedDict[bytes, None] = OrderedDict()  # sha256 of (key, data, signature) that verified, oldest first


def _verify(public_key: bytes, data: bytes, signature: bytes) -> bool:
    try:
        key = crypto_pb2.PublicKey.FromString(public_key)
        if key.key_type == crypto_pb2.Ed25519:
            ed25519.Ed25519PublicKey.from_public_bytes(key.data).verify(signature, data)
            return True
        if key.key_type == crypto_pb2.RSA:
            rsa_key = serialization.load_der_public_key(key.data)
            if not isinstance(rsa_key, rsa.RSAPublicKey) or rsa_key.key_size != RSA_BITS:
                return False
            if rsa_key.public_numbers().e != RSA_EXPONENT:  # checked before any arithmetic with it
                return False
            rsa_key.verify(signature, data, padding.PKCS1v15(), hashes.SHA256())
            return True
    except (InvalidSignature, Exception):  # any parse failure of a stranger's key is a bad signature
        return False
    return False


def _payload(key: str, peer_id: str, expiration: float, body: bytes, credential: bytes | None) -> bytes:
    payload: bytes = MSGPackSerializer.dumps([DOMAIN, key, peer_id, float(expiration), body, credential])
    return payload


def seal(signer: Signer, key: str, value: dict[str, Any], expiration: float,
         credential: bytes | None = None) -> dict[str, bytes]:
    """The signed envelope of ``value`` (a msgpack-able record) stored under ``key`` until ``expiration``; a closed
    run's admission ``credential`` rides along, inside the signature (and carries the organiser's own)."""
    body: bytes = MSGPackSerializer.dumps(value)
    signature = signer.sign(_payload(key, signer.peer_id, expiration, body, credential))
    out = {"b": body, "k": signer.public_key, "s": signature}
    if credential is not None:
        out["c"] = credential
    return out


def open_envelope(key: str, peer_id: str, stored: object, expiration: object, *, now: float | None = None) -> object:
    """Check an envelope read from or offered to the DHT and return the record it carries (decoded msgpack, for the
    caller's schema to check); raises SignatureError. ``stored`` and ``expiration`` are a stranger's: checked here."""
    if not isinstance(stored, dict) or set(stored) - {"c"} != {"b", "k", "s"}:
        raise SignatureError("not a signed envelope")
    body, public_key, signature, credential = stored["b"], stored["k"], stored["s"], stored.get("c")
    if not all(isinstance(x, bytes) for x in (body, public_key, signature)):
        raise SignatureError("envelope fields must be bytes")
    if credential is not None and not isinstance(credential, bytes):
        raise SignatureError("a credential must be bytes")
    if len(body) + len(public_key) + len(signature) + len(stored.get("c") or b"") > MAX_ENVELOPE_BYTES:
        raise SignatureError("envelope too large")
    latest = (now or get_dht_time()) + MAX_RECORD_TTL_S + CLOCK_SLACK_S
    if not isinstance(expiration, float | int) or expiration > latest:
        raise SignatureError(f"expiration too far ahead (at most {MAX_RECORD_TTL_S:.0f} s)")
    try:
        owner = peer_id_of(public_key)
    except Exception as e:  # a public key that cannot be hashed is the stranger's fault
        raise SignatureError(f"bad public key: {e!r}") from e
    if owner != peer_id:
        raise SignatureError("public key does not belong to the peer id it is stored under")
    if not verify(public_key, _payload(key, peer_id, expiration, body, credential), signature):
        raise SignatureError("signature does not verify")
    try:
        return MSGPackSerializer.loads(body)
    except Exception as e:  # signed garbage is still garbage
        raise SignatureError(f"body is not msgpack: {e!r}") from e


class SignedRecordValidator(RecordValidatorBase):
    """Every node's gate: only the run's record key, signed by the subkey's owner, valid schema, bounded expiration;
    in a closed run a credential that admits the owner at least until the record expires.

    Values under any other key are refused: a peer's DHT is no free storage for strangers.
    """

    def __init__(self, key: str, schema: Callable[[str, object], object],
                 admit: Callable[[str, bytes | None, float], None] | None = None) -> None:
        self.key = key
        self.key_id = DHTID.generate(source=key).to_bytes()
        self.schema = schema
        # closed runs: admit(peer_id, credential, expiration) raises unless the organiser admitted the peer until then
        self.admit = admit
        self.max_live = MAX_LIVE_RECORDS
        self._live: dict[bytes, float] = {}  # subkey -> expiration of the records let through (in the DHT process)

    def validate(self, record: DHTRecord) -> bool:
        if record.key != self.key_id:
            logger.debug("refusing a DHT value under a key that is not the run's")
            return False
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
            if not isinstance(subkey, str) or len(record.value) > MAX_ENVELOPE_BYTES:
                return False
            stored = MSGPackSerializer.loads(record.value)
            body = open_envelope(self.key, subkey, stored, record.expiration_time)
            self.schema(subkey, body)
            if self.admit is not None:
                self.admit(subkey, stored.get("c"), record.expiration_time)
            return self._room_for(record.subkey, record.expiration_time)
        except Exception as e:  # a forged or malformed record: refuse it, quietly (strangers send them at will)
            logger.debug("refusing a DHT record under the run's key: %r", e)
            return False

    def _room_for(self, subkey: bytes, expiration: float) -> bool:
        """Whether one more record (or a newer one of a known owner) fits under ``max_live`` unexpired records."""
        if subkey not in self._live and len(self._live) >= self.max_live:
            now = get_dht_time()
            self._live = {k: e for k, e in self._live.items() if e > now}
            if len(self._live) >= self.max_live:
                logger.debug("refusing a new DHT record: %d unexpired records of the run are held", len(self._live))
                return False
        self._live[subkey] = max(expiration, self._live.get(subkey, expiration))
        return True

    @property
    def priority(self) -> int:
        return 10

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, SignedRecordValidator) and other.key == self.key
