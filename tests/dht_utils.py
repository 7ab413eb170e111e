"""DHT helpers for tests: loopback hivemind DHT nodes with a known identity key, so tests can sign their records."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hivemind import DHT
from hivemind.p2p import P2P

from peer.membership.records import record_validator
from peer.membership.signing import Signer


def write_identity(path: Path) -> Signer:
    """A fresh RSA identity file at ``path`` and its signer (hivemind checks a joiner's key file as RSA)."""
    P2P.generate_identity(str(path))
    return Signer.from_identity_file(path)


def signed_dht(tmp_path: Path, name: str, run_id: str, initial_peers: Sequence[str] = (), *,
               validate: bool = True, client_mode: bool = False) -> tuple[DHT, Signer]:
    """A loopback DHT node whose peer id is a key the test holds, with the run's record validator installed."""
    signer = write_identity(tmp_path / f"{name}.key")
    dht = DHT(start=True, initial_peers=list(initial_peers), host_maddrs=["/ip4/127.0.0.1/tcp/0"],
              identity_path=str(tmp_path / f"{name}.key"), client_mode=client_mode,
              record_validators=[record_validator(run_id)] if validate else [])
    assert dht.peer_id.to_base58() == signer.peer_id
    return dht, signer
