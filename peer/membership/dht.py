"""Joining and leaving the DHT: hivemind's DHT process started with this peer's identity, retried while the bootstrap
peer may still be starting, and stopped so that it never outlives the peer."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import hivemind
from hivemind.dht.validation import RecordValidatorBase

from peer.config import PeerConfig
from peer.errors import DaemonError
from peer.membership.identity import IdentityError, check_permissions, ensure_identity

logger = logging.getLogger(__name__)

DHT_START_ATTEMPTS = 5


async def start_dht(cfg: PeerConfig, validators: Sequence[RecordValidatorBase] = ()) -> hivemind.DHT:
    """Start this peer's DHT node (a child process running p2pd), joining ``cfg.initial_peers``.

    ``validators`` gate every record this node stores or reads (``records.record_validator``: owner-signed records).

    A joiner retries with backoff (1, 2, 4, 8 s) because the bootstrap peer may be busy starting up itself; a new swarm
    fails at once. Raises DaemonError saying what to check.
    """
    try:
        identity = ensure_identity(cfg.identity_path)
        check_permissions(identity)
    except IdentityError as e:
        raise DaemonError(str(e)) from e

    def make() -> hivemind.DHT:
        return hivemind.DHT(initial_peers=list(cfg.initial_peers), host_maddrs=list(cfg.host_maddrs),
                            announce_maddrs=list(cfg.announce_maddrs) or None, identity_path=str(identity),
                            use_ipfs=cfg.use_ipfs, start=True, client_mode=False,
                            record_validators=list(validators))

    loop = asyncio.get_running_loop()
    for attempt in range(DHT_START_ATTEMPTS):
        try:
            return await loop.run_in_executor(None, make)
        except Exception as e:  # the bootstrap peer may be busy starting up itself: retry before giving up
            if attempt + 1 < DHT_START_ATTEMPTS and cfg.initial_peers:
                logger.warning("joining the DHT failed (%s); retrying in %d s", str(e).splitlines()[0], 2 ** attempt)
                await asyncio.sleep(2 ** attempt)
                continue
            hint = ("check that --initial-peers are full multiaddrs of running peers (/ip4/HOST/tcp/PORT/p2p/PEER_ID) "
                    "and that this machine can reach them" if cfg.initial_peers
                    else "check --host-maddrs (the port may be taken)")
            raise DaemonError(f"could not start or join the DHT: {e}; {hint}") from e
    raise AssertionError("unreachable: the last attempt returns or raises")


def stop_dht(dht: hivemind.DHT) -> None:
    """hivemind's graceful shutdown, then SIGKILL if its process is still alive (it must not outlive us)."""
    dht.shutdown()
    if dht.is_alive():
        logger.warning("the DHT process did not stop; killing it")
        dht.kill()
        dht.join(timeout=5)
