"""Joining and leaving the DHT: hivemind's DHT process started with this peer's identity, retried while the bootstrap
peer may still be starting, interrupted at once when the peer is asked to stop, and stopped so that it never outlives
the peer (``peer.membership.lifeline`` ties it and its p2pd to the peer's life, even through a kill -9)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

import hivemind
from hivemind.dht.validation import RecordValidatorBase

from peer.config import PeerConfig
from peer.errors import DaemonError
from peer.membership.identity import IdentityError, check_permissions, ensure_identity
from peer.membership.lifeline import LifelineDHT
from peer.membership.relay import RelayMode, p2p_relay_kwargs, relay_targets

logger = logging.getLogger(__name__)

DHT_START_ATTEMPTS = 5
READY_POLL_S = 0.25  # how often a DHT start-up in progress checks whether the peer was asked to stop


class JoinInterrupted(Exception):
    """The peer was asked to stop (SIGTERM, Ctrl-C) while it was still joining the DHT."""


async def start_dht(cfg: PeerConfig, stop: asyncio.Event | None = None,
                    validators: Sequence[RecordValidatorBase] = (), *, through_relay: bool | None = None,
                    rejoin: bool = False) -> hivemind.DHT:
    """Start this peer's DHT node (a child process running p2pd), joining ``cfg.initial_peers``.

    ``validators`` gate every record this node stores or reads (``records.record_validator``: owner-signed records).
    ``through_relay`` (default: ``cfg.relay == RelayMode.ON``) listens through the relays of ``peer.membership.relay``;
    ``rejoin`` skips hivemind's "is this identity already in use" probe (this peer's own previous DHT just left).

    A joiner retries with backoff (1, 2, 4, 8 s) because the bootstrap peer may be busy starting up itself; a new swarm
    fails at once. Raises DaemonError saying what to check, or JoinInterrupted as soon as ``stop`` is set (the
    half-started DHT process is killed first).
    """
    try:
        identity = ensure_identity(cfg.identity_path)
        check_permissions(identity)
    except IdentityError as e:
        raise DaemonError(str(e)) from e

    through_relay = cfg.relay == RelayMode.ON if through_relay is None else through_relay
    if through_relay and not relay_targets(cfg.relays, cfg.initial_peers):
        raise DaemonError("--relay on needs a relay to listen through: pass --relays or --initial-peers with full "
                          "multiaddrs (/ip4/HOST/tcp/PORT/p2p/PEER_ID)")
    stop = stop or asyncio.Event()
    for attempt in range(DHT_START_ATTEMPTS):
        try:
            return await _start_once(cfg, str(identity), stop, validators, through_relay=through_relay,
                                     rejoin=rejoin)
        except JoinInterrupted:
            raise
        except Exception as e:  # the bootstrap peer may be busy starting up itself: retry before giving up
            if attempt + 1 < DHT_START_ATTEMPTS and cfg.initial_peers:
                logger.warning("joining the DHT failed (%s); retrying in %d s", str(e).splitlines()[0], 2 ** attempt)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=2 ** attempt)
                if stop.is_set():
                    raise JoinInterrupted("stopped while waiting to retry the DHT join") from e
                continue
            hint = ("check that --initial-peers are full multiaddrs of running peers (/ip4/HOST/tcp/PORT/p2p/PEER_ID) "
                    "and that this machine can reach them" if cfg.initial_peers
                    else "check --host-maddrs (the port may be taken)")
            raise DaemonError(f"could not start or join the DHT: {e}; {hint}") from e
    raise AssertionError("unreachable: the last attempt returns or raises")


async def _start_once(cfg: PeerConfig, identity: str, stop: asyncio.Event, validators: Sequence[RecordValidatorBase],
                      *, through_relay: bool, rejoin: bool) -> hivemind.DHT:
    """One attempt. The DHT process is forked from this (the main) thread, which lives as long as the peer: its
    parent-death signal is bound to the forking thread. Readiness is awaited in an executor, checking ``stop``."""
    relay = p2p_relay_kwargs(through_relay=through_relay, relay_service=cfg.relay_service,
                             relays=relay_targets(cfg.relays, cfg.initial_peers))
    extra = {"check_if_identity_free": False} if rejoin else {}
    dht = LifelineDHT(initial_peers=list(cfg.initial_peers), host_maddrs=list(cfg.host_maddrs),
                      announce_maddrs=list(cfg.announce_maddrs) or None, identity_path=identity,
                      use_ipfs=cfg.use_ipfs, start=False, client_mode=False, record_validators=list(validators),
                      **relay, **extra)
    dht.start()
    loop = asyncio.get_running_loop()
    try:
        while True:  # short waits, so that no executor thread is left blocked on a future that will never resolve
            if stop.is_set():
                raise JoinInterrupted("stopped while joining the DHT")
            try:
                await loop.run_in_executor(None, dht.wait_until_ready, READY_POLL_S)
                return dht
            except TimeoutError:
                if not dht.is_alive():
                    raise DaemonError(f"the DHT process exited during start-up (exit code {dht.exitcode})") from None
    except BaseException:
        _kill(dht)
        raise


def _kill(dht: hivemind.DHT) -> None:
    """End a DHT process that never became ready (its p2pd follows it through the parent-death signal)."""
    if dht.is_alive():
        dht.kill()
        dht.join(timeout=5)


def stop_dht(dht: hivemind.DHT) -> None:
    """hivemind's graceful shutdown, then SIGKILL if its process is still alive (it must not outlive us)."""
    dht.shutdown()
    if dht.is_alive():
        logger.warning("the DHT process did not stop; killing it")
        dht.kill()
        dht.join(timeout=5)
