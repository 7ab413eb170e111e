"""This peer's side of access control: its own credential in a closed run, and the gate in front of every handler.

In an open run the gate admits everyone (strangers are contained by budgets, the pipeline guard and robust
averaging instead). In a closed run a request is served only when its libp2p-authenticated sender has a record in
our view of the swarm; every such record passed the run's DHT validator, which requires a credential signed by the
organiser for that very peer id (``admission.py``). A sender not in the view triggers one fresh DHT read (at most one
per ``REFRESH_MIN_S``, so strangers cannot make us hammer the DHT) before it is refused.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from peer.errors import DaemonError
from peer.membership.admission import AdmissionError, check, organiser_key

if TYPE_CHECKING:
    from peer.config import PeerConfig
    from trainer.config import RunConfig

logger = logging.getLogger(__name__)

REFRESH_MIN_S = 1.0
EXPIRY_WARNING_S = 24 * 3600.0


def read_credential(path: str | Path) -> bytes:
    """A credential file as `asyncmesh-peer admit` writes it (base64 text)."""
    with open(path, "rb") as f:
        return base64.b64decode(f.read().strip(), validate=True)


class AdmissionGate:
    """Access control of one peer: ``closed``, its own ``credential`` and the RPC gate."""

    def __init__(self, run: RunConfig, cfg: PeerConfig) -> None:
        self.run_id = run.run_id
        self.key = organiser_key(run)
        self.path: Path | None = getattr(cfg, "credential_path", None)
        self.credential: bytes | None = None

    @property
    def closed(self) -> bool:
        return self.key is not None

    def load_own(self, my_id: str) -> None:
        """Closed runs: read and check this peer's credential; raises DaemonError saying what to do."""
        key = self.key
        if key is None:  # an open run
            return
        if self.path is None:
            raise DaemonError(f"run {self.run_id} is closed: ask its organiser to admit peer id {my_id} "
                              "(asyncmesh-peer admit) and pass the credential with --credential FILE")
        try:
            credential = read_credential(self.path)
            c = check(credential, organiser_key=key, run_id=self.run_id, peer_id=my_id)
        except (OSError, ValueError) as e:  # AdmissionError is a ValueError
            raise DaemonError(f"--credential {self.path}: {e}; ask the organiser for a credential for peer id "
                              f"{my_id} and run {self.run_id}") from e
        left = c.expires_at - time.time()
        if left < EXPIRY_WARNING_S:
            logger.warning("this peer's credential expires in %.1f h; ask the organiser for a new one", left / 3600)
        self.credential = credential

    def rpc_gate(self, swarm: Callable[[], Mapping[str, object]],
                 refresh: Callable[[], Awaitable[object]]) -> Callable[[str], Awaitable[bool]] | None:
        """The RpcServer gate of a closed run (None for an open run): admitted peers are those in ``swarm()``."""
        if not self.closed:
            return None
        last = -REFRESH_MIN_S

        async def gate(peer_id: str) -> bool:
            nonlocal last
            if peer_id in swarm():
                return True
            now = time.monotonic()
            if now - last < REFRESH_MIN_S:
                return False
            last = now
            try:
                await refresh()
            except Exception as e:  # a failed read refuses this request; the sender retries
                logger.debug("refreshing the swarm for the admission gate failed: %r", e)
                return False
            return peer_id in swarm()

        return gate


__all__ = ["AdmissionGate", "AdmissionError", "read_credential"]
