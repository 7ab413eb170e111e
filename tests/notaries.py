"""Signing for in-process peers whose ids are names ("a0", "b1"), not hashes of keys: a shared book binds each name
to a fresh key (peer/pipeline/attest.py's ``Notary``; the daemon's ``KeyNotary`` binds ids to keys by hashing)."""

from __future__ import annotations

from peer.membership.signing import Signer, verify


class NamedNotary:
    """Signs as ``name``; checks a name's signature against the key ``book`` holds for it."""

    def __init__(self, name: str, book: dict[str, Signer]) -> None:
        self.name, self.book = name, book
        book.setdefault(name, Signer.generate())

    def sign(self, data: bytes) -> tuple[bytes, bytes]:
        signer = self.book[self.name]
        return signer.public_key, signer.sign(data)

    def check(self, peer_id: str, key: bytes, data: bytes, signature: bytes) -> bool:
        signer = self.book.get(peer_id)
        return signer is not None and signer.public_key == key and verify(key, data, signature)
