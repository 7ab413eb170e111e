"""The peer's persistent identity: a private key file that fixes its libp2p peer id across restarts.

A stable id lets the swarm recognise a restarted peer (its bans, its place in routing) and keeps a checkpoint tied to
the peer that wrote it. The key is created on first start with permissions 0400 in a 0700 folder; hivemind's DHT reads
it through ``identity_path``. A file that exists but is not a key is an error that says what to do, never silently
replaced (replacing it would change the peer's id).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from hivemind.p2p import P2P
from hivemind.proto import crypto_pb2

logger = logging.getLogger(__name__)


class IdentityError(ValueError):
    """The identity file cannot be created or read."""


def ensure_identity(path: Path) -> Path:
    """Create the key at ``path`` if missing; validate it if present. Returns the absolute path."""
    path = Path(path).expanduser().absolute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise IdentityError(f"cannot create the folder {path.parent} for the identity key ({e.strerror}); "
                            "pass a writable path to --identity") from e
    if not path.exists():
        try:
            P2P.generate_identity(str(path))
        except OSError as e:
            raise IdentityError(f"cannot write the identity key {path} ({e}); pass a writable --identity") from e
        logger.info("created a new peer identity in %s (keep it to keep your peer id)", path)
        return path
    try:
        data = path.read_bytes()
        key = crypto_pb2.PrivateKey()
        key.ParseFromString(data)
        if not key.data:
            raise ValueError("empty key")
    except Exception as e:  # any parse failure means the file is not ours to use
        raise IdentityError(f"{path} exists but is not a libp2p private key ({e}); move it away to create a new "
                            "identity, or pass another file to --identity") from e
    return path


def check_permissions(path: Path) -> None:
    """Warn when others can read the key (a copied key lets someone impersonate this peer)."""
    mode = os.stat(path).st_mode & 0o077
    if mode:
        logger.warning("identity key %s is readable by other users; run: chmod 400 %s", path, path)
