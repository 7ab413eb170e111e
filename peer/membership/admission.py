"""Closed runs: expiring, peer-bound credentials signed by the run organiser's key.

A credential says "peer P may take part in run R until time T", signed by the organiser (whose public key is in the
run file, ``[access] organiser_key``). It is bound to one peer id, so another peer cannot present it (RPC senders and
DHT record owners are authenticated by libp2p and by record signatures), and it expires, so a leaked or revoked
peer drops out at T. A peer presents its credential inside its signed DHT record; every node's record validator
refuses records of the run without a valid one, and every RPC handler serves only peers whose record (with its
credential) it has seen.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass

from hivemind.utils import MSGPackSerializer

from peer.membership.signing import Signer, verify

DOMAIN = "asyncmesh/admit/v1"
MAX_CREDENTIAL_BYTES = 2048


class AdmissionError(ValueError):
    """A credential that is malformed, forged, for another peer or run, or expired."""


@dataclass(frozen=True, kw_only=True)
class Credential:
    """What an organiser admits: one peer, one run, until ``expires_at`` (unix seconds)."""

    run_id: str
    """The run admitted to."""
    peer_id: str
    """The only peer that may present it."""
    expires_at: float
    """Unix time after which it is refused."""


def _payload(c: Credential) -> bytes:
    payload: bytes = MSGPackSerializer.dumps([DOMAIN, c.run_id, c.peer_id, float(c.expires_at)])
    return payload


def issue(organiser: Signer, *, run_id: str, peer_id: str, valid_s: float, now: float | None = None) -> bytes:
    """A credential for ``peer_id`` in ``run_id``, valid ``valid_s`` seconds from ``now``, signed by ``organiser``."""
    if valid_s <= 0:
        raise ValueError(f"valid_s must be positive, got {valid_s}")
    c = Credential(run_id=run_id, peer_id=peer_id, expires_at=(time.time() if now is None else now) + valid_s)
    credential: bytes = MSGPackSerializer.dumps([c.run_id, c.peer_id, c.expires_at, organiser.sign(_payload(c))])
    return credential


def check(credential: object, *, organiser_key: bytes, run_id: str, peer_id: str,
          now: float | None = None) -> Credential:
    """The credential if it admits ``peer_id`` to ``run_id`` now; raises AdmissionError saying why not."""
    if not isinstance(credential, bytes) or len(credential) > MAX_CREDENTIAL_BYTES:
        raise AdmissionError("no credential (a closed run admits only peers with one)")
    try:
        rid, pid, expires_at, signature = MSGPackSerializer.loads(credential)
        c = Credential(run_id=rid, peer_id=pid, expires_at=float(expires_at))
    except Exception as e:  # any malformed credential is the presenter's fault
        raise AdmissionError(f"malformed credential: {e!r}") from e
    if not isinstance(signature, bytes) or not verify(organiser_key, _payload(c), signature):
        raise AdmissionError("credential not signed by this run's organiser")
    if c.run_id != run_id:
        raise AdmissionError("credential is for another run")
    if c.peer_id != peer_id:
        raise AdmissionError("credential belongs to another peer")
    if c.expires_at <= (time.time() if now is None else now):
        raise AdmissionError("credential expired")
    return c


def organiser_key(run: object) -> bytes | None:
    """The organiser's public key of a closed run (``RunConfig``), None for an open run."""
    access = getattr(run, "access", None)
    if access is None or access.mode != "closed":
        return None
    return base64.b64decode(access.organiser_key)
