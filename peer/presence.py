"""This peer on the network: its DHT node and libp2p daemon, its RPC server, its signed records, and what it reads
of the swarm.

``Presence`` is one object per process, owned by ``peer.daemon.Daemon``: it joins the DHT (``start``), registers
its RPC server and the one handler table everything registers through (``handlers``: ``reach`` for the life of the
server, ``forward`` and ``backward`` reserved until a stage binds them), checks that others can dial it, joins
again through a relay when they cannot (``--relay auto``), reads the run's records (``refresh_swarm``: the DHT's and
those peers gossip, ``peer.membership.gossip``), asks the initial peers whom they vouch for
(``ask_anchors``, ``peer.membership.vouches``), writes this
peer's own (``announce``, ``withdraw``) and sends RPCs to others (``send``). The records' content (step,
throughput, spare copy) is the daemon's to say.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import TYPE_CHECKING

from peer.config import PeerConfig
from peer.handlers.sizes import restrict_handlers
from peer.handlers.table import Handlers
from peer.membership.admission import organiser_key
from peer.membership.dht import start_dht, stop_dht
from peer.membership.gate import AdmissionGate
from peer.membership.gossip import RECORDS_RPC, RecordBook, ask_records, serve_records
from peer.membership.reachability import REACH_RPC, ReachabilityHelper, check_reachable, observed_hosts, swarm_is_local
from peer.membership.records import (
    PeerRecord,
    admission_check,
    announce,
    fetch_swarm,
    record_validator,
    withdraw,
)
from peer.membership.relay import RelayMode, wait_relayed
from peer.membership.routing import Router
from peer.membership.run_guard import RunGuard
from peer.membership.signing import Signer
from peer.membership.vouches import VOUCHES_RPC, ask_vouches, peer_ids_of, serve_vouches
from peer.ops.metrics import PeerMetrics
from peer.ops.progress import SwarmProgress, from_records
from peer.pipeline.hops import BACKWARD_RPC, FORWARD_RPC
from protocol.messages import Message
from protocol.rpc import RpcLimits, RpcServer, call
from trainer.config import RunConfig

if TYPE_CHECKING:
    from hivemind import DHT
    from hivemind.p2p import P2P

logger = logging.getLogger(__name__)

__all__ = ["Presence"]


class Presence:
    """``await Presence(...).start()``; then ``send``, ``refresh_swarm``, ``announce``; ``await close()`` at exit."""

    def __init__(self, run: RunConfig, cfg: PeerConfig, metrics: PeerMetrics, *, gate: AdmissionGate,
                 stop: asyncio.Event, router: Router) -> None:
        self.run, self.cfg, self.metrics = run, cfg, metrics
        self.gate, self.stop, self.router = gate, stop, router
        self.dht: DHT | None = None
        self.p2p: P2P | None = None
        self.rpc: RpcServer | None = None
        self.handlers: Handlers | None = None  # the handler table of ``rpc`` (a new one with a new server)
        self.signer: Signer | None = None
        self.limits = RpcLimits(keep_min_bytes=cfg.keep_stream_min_bytes)
        self.my_id = ""
        self.maddrs: list[str] = []
        self.swarm: dict[str, PeerRecord] = {}
        self.reachable = True
        self.through_relay = cfg.relay == RelayMode.ON  # p2pd listens through a relay (peer.membership.relay)
        self.run_guard = RunGuard(run.run_id, run.name)
        self.progress = SwarmProgress(run_name=run.name, total_steps=run.optim.total_steps)
        # every signed record accepted, from DHT reads and from gossip (the swarm as we know it)
        self.book = RecordBook(run.run_id, admission_check(run.run_id, organiser_key(run)))
        self._gossiped_at = -float("inf")
        self._gossip: asyncio.Task[int] | None = None
        self.anchor_vouches: list[str] = []  # the initial peers that answered and the peers they vouch for

    # ----- start-up --------------------------------------------------------------------------------------------------
    async def start(self, *, rejoin: bool = False) -> None:
        """Join the DHT (its p2pd included) and serve the handlers every peer serves."""
        self.dht = dht = await start_dht(self.cfg, self.stop, validators=[record_validator(self.run.run_id,
                                                                                           organiser_key(self.run))],
                                         through_relay=self.through_relay, rejoin=rejoin)
        self.p2p = await dht.replicate_p2p()
        self.my_id = dht.peer_id.to_base58()
        self.signer = Signer.from_identity_file(self.cfg.identity_path)  # signs our DHT records (same key as p2pd)
        self.gate.load_own(self.my_id)  # closed runs: our credential must admit this peer id, else a clear error
        self.metrics.peer_id = self.my_id
        visible = (await wait_relayed(dht, self.cfg.reachability_timeout_s) if self.through_relay
                   else await asyncio.get_running_loop().run_in_executor(None, dht.get_visible_maddrs))
        self.maddrs = [str(m) for m in visible][:8]
        self.metrics.maddrs = list(self.cfg.announce_maddrs) or list(self.maddrs)
        if self.cfg.maddrs_file is not None:
            tmp = self.cfg.maddrs_file.with_suffix(".tmp")
            tmp.write_text("".join(f"{m}\n" for m in self.maddrs))
            tmp.replace(self.cfg.maddrs_file)
        await self._start_rpc()

    async def _start_rpc(self) -> None:
        assert self.p2p is not None
        self.rpc = RpcServer(self.p2p, self.limits, count=self.metrics.inc)
        restrict_handlers(self.rpc, self.run)  # message kinds, and request sizes from the run's shapes
        self.rpc.gate = self.gate.rpc_gate(lambda: self.swarm, self.refresh_swarm)
        self.handlers = Handlers(self.rpc, count=self.metrics.inc)
        await self.handlers.reserve(FORWARD_RPC, BACKWARD_RPC)  # NOT_READY until a stage binds them
        p2p = self.p2p
        helper = ReachabilityHelper(  # dials back only the requester's own observed address (local swarms: any)
            run_id=self.run.run_id, timeout_s=self.cfg.reachability_timeout_s,
            observed=lambda pid: observed_hosts(p2p, pid),
            local_swarm=lambda: swarm_is_local([m for r in self.swarm.values() for m in r.maddrs] + self.maddrs))
        await self.handlers.serve(REACH_RPC, helper.handle)
        await self.handlers.serve(RECORDS_RPC, serve_records(self.book, self.run.run_id, self.metrics.inc))
        await self.handlers.serve(VOUCHES_RPC, serve_vouches(self.trusted_peers_own, self.run.run_id,
                                                             self.metrics.inc))

    @property
    def initial_ids(self) -> list[str]:
        """The peer ids of ``--initial-peers`` (those that name one), this peer's own left out."""
        return peer_ids_of(list(self.cfg.initial_peers), self.my_id)

    async def check_reachability(self) -> None:
        """Ask the initial peers to dial us back; unreachable is a warning (and, with --relay auto, a relay).
        Meeting a swarm of another run is an error."""
        try:
            ok, message = await self._reach(self.initial_ids)
        except Exception as e:  # the check is advice; it must never stop the peer
            ok, message = None, f"reachability could not be checked: {e!r}"
        if (wrong := self.run_guard.error()) is not None:  # ...but a swarm of another run must
            raise wrong
        if ok is False:
            self.reachable = False
            self.metrics.warn(message)
            logger.warning("%s", message)
        else:
            logger.info("reachability: %s", message)

    async def _reach(self, helpers: list[str]) -> tuple[bool | None, str]:
        call = self.run_guard.wrap(lambda pid, name, msg, timeout: self.send(pid, name, msg, timeout=timeout))
        return await check_reachable(
            call=call, helpers=helpers,
            run_id=self.run.run_id, stage=self.cfg.stage or 0, my_id=self.my_id,
            maddrs=list(self.cfg.announce_maddrs) or self.maddrs, timeout_s=self.cfg.reachability_timeout_s)

    async def rejoin_through_relay(self) -> None:
        """--relay auto found us unreachable: start the DHT again listening through a relay, before any stage or
        record exists (the peer id stays; the handlers are registered on the new p2pd)."""
        logger.warning("other peers cannot connect to this peer: joining again through a relay (--relay auto)")
        await self.close()
        self.through_relay = True
        await self.start(rejoin=True)
        relayed = [m for m in self.maddrs if "/p2p-circuit" in m]
        self.metrics.warn(f"reachable only through a relay: {relayed[0]}" if relayed else
                          "listening through a relay, but no relay slot was reserved yet")

    def print_join_hint(self) -> None:
        addrs = [m for m in self.maddrs if "/p2p/" in m] or self.maddrs
        if not self.cfg.initial_peers:
            run_flag = "" if self.run.run_id == RunConfig.default().run_id else "--run <the same run file> "
            logger.info("started a new swarm for run %s (%s). Others join it with:\n  asyncmesh-peer join "
                        "--stage auto %s--initial-peers %s", self.run.name, self.run.run_id, run_flag,
                        " ".join(addrs[:2]))
        else:
            logger.info("joined the swarm of run %s (%s) as %s", self.run.name, self.run.run_id, self.my_id)

    # ----- while serving ---------------------------------------------------------------------------------------------
    async def send(self, peer_id: str, name: str, msg: Message, *, timeout: float | None = None) -> Message:
        assert self.p2p is not None
        # answering is not vouching: a peer is known once the pipeline or averaging validated its work (``vouch``)
        return await call(self.p2p, peer_id, name, msg, timeout=timeout or self.cfg.rpc_timeout_s,
                          limits=self.limits, count=self.metrics.inc)

    def vouch(self, peer_id: str) -> None:
        """``peer_id`` did validated work for us: the full budgets of a known peer, and a preferred state witness."""
        if self.rpc is not None:
            self.rpc.vouch(peer_id)

    def revoke(self, peer_id: str) -> None:
        """``peer_id`` was caught doing bad work: a stranger again, and no longer a preferred state witness (whoever
        vouched for it)."""
        self.anchor_vouches = [p for p in self.anchor_vouches if p != peer_id]
        if self.rpc is not None:
            self.rpc.revoke(peer_id)

    def trusted_peers_own(self) -> list[str]:
        """Peers that did validated work for us (the RPC server's known peers), the most recent last."""
        return self.rpc.known_peers() if self.rpc is not None else []

    def trusted_peers(self) -> list[str]:
        """The preferred witnesses of a state: the peers that did validated work for us, then the initial peers and
        the peers they vouch for (as of the last ``ask_anchors``)."""
        return list(dict.fromkeys([*self.trusted_peers_own(), *self.anchor_vouches]))

    async def ask_anchors(self) -> list[str]:
        """Ask the initial peers whom they know by validated work (``peer.membership.vouches``) and keep the answer
        for ``trusted_peers`` (added to what they said before: an anchor that does not answer now, or is asked
        again within its rate limit, takes back nothing): a joiner has no history of its own to draw a state's
        witnesses from. Returns the vouches held."""
        fresh = await ask_vouches(
            self.initial_ids, self.run.run_id,
            lambda pid, name, msg: self.send(pid, name, msg, timeout=self.cfg.dht_timeout_s), self.metrics.inc)
        self.anchor_vouches = list(dict.fromkeys([*fresh, *self.anchor_vouches]))
        return self.anchor_vouches

    async def refresh_swarm(self) -> dict[str, PeerRecord]:
        """Read the run's records from the DHT, with those gossip brought (the last good view is kept when both come
        back empty)."""
        assert self.dht is not None
        await fetch_swarm(self.dht, self.run.run_id, timeout=self.cfg.dht_timeout_s, keep=self.book.take)
        records = self.book.records()
        self._maybe_gossip(records)
        if records or not self.swarm:
            self.swarm = records
        per_stage: dict[int, int] = {s: 0 for s in range(self.run.n_stages)}
        for r in self.swarm.values():
            per_stage[r.stage] = per_stage.get(r.stage, 0) + 1
        self.metrics.set_swarm(per_stage)
        self.metrics.swarm_progress = self.progress.update(from_records(self.swarm.values()))
        self.router.forget(self.swarm)
        self.router.observe(self.swarm.values())  # restarted peers are judged afresh
        return self.swarm

    def _maybe_gossip(self, records: dict[str, PeerRecord]) -> None:
        """Every ``gossip_every_s``, ask one peer of our view (before we have one, an initial peer) for its records,
        in the background; what it brings shows in the next refresh."""
        now = time.monotonic()
        if (self.cfg.gossip_every_s <= 0 or now - self._gossiped_at < self.cfg.gossip_every_s
                or (self._gossip is not None and not self._gossip.done())):
            return
        others = [p for p in records if p != self.my_id] or self.initial_ids
        if not others:
            return
        self._gossiped_at = now
        peer = random.choice(others)
        self._gossip = asyncio.create_task(ask_records(
            self.book, self.run.run_id, peer,
            lambda pid, name, msg: self.send(pid, name, msg, timeout=self.cfg.dht_timeout_s), self.metrics.inc))

    async def announce(self, record: PeerRecord) -> None:
        assert self.dht is not None and self.signer is not None
        await announce(self.dht, self.run.run_id, record, self.cfg.record_ttl_s, signer=self.signer,
                       credential=self.gate.credential, keep=self.book.take)

    async def withdraw(self, record: PeerRecord) -> None:
        assert self.dht is not None and self.signer is not None
        await withdraw(self.dht, self.run.run_id, record, self.cfg.record_ttl_s, signer=self.signer,
                       credential=self.gate.credential, keep=self.book.take)

    # ----- exit ------------------------------------------------------------------------------------------------------
    async def close(self) -> None:
        """Stop taking streams, then stop the DHT and its p2pd."""
        if self._gossip is not None:
            self._gossip.cancel()
        rpc, dht = self.rpc, self.dht
        self.rpc = self.dht = self.p2p = self.handlers = None
        if rpc is not None:  # before the P2P daemon goes away under the streams
            try:
                await rpc.shutdown()
            except Exception as e:
                logger.debug("RPC server shutdown: %r", e)
        if dht is not None:
            await asyncio.get_running_loop().run_in_executor(None, stop_dht, dht)
