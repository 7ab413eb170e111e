"""Generation through a live swarm: its pipeline's stages used as one model, forward only, from outside the swarm.

``RemotePipeline.next_logits(ids)`` sends the context (cut to the run's ``block_size``) through stage 0, 1, ..., K-1
with the ``infer`` RPC (``peer.pipeline.infer``) and returns the last stage's logits of the last position. It holds
no weights and trains nothing: each stage's reply is checked (shape, codec, finite values) and handed on to a peer
of the next stage as it arrived. A peer of each stage is drawn among the stage's announced training peers by the
same weighted choice the pipeline uses (``peer.membership.routing.Router``): by the round trips measured so far,
announced throughput until then. A peer that fails, answers Busy or refuses is skipped for a while and another
replica of the stage is tried, until the per-token deadline. Problems a user can act on are ``UserError``s naming
the stage: no training peer of a stage (``SwarmUnavailable``, exit 3), a swarm of another run (``RunMismatch``), a
closed run that refuses clients (``NotAdmitted``).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from peer.errors import UserError
from peer.ids import short_id
from peer.lifecycle import PeerState
from peer.membership.records import PeerRecord
from peer.membership.routing import NoRouteError, Router
from peer.membership.stage_choice import stage_costs
from peer.pipeline.infer import INFER_RPC, MAX_ACT_ABS, infer_codecs
from protocol.codecs.registry import decode, encode, parse_codec
from protocol.envelope import TensorEnvelope
from protocol.errors import ErrorCode, ProtocolError, RemoteError
from protocol.messages import Busy, Infer, InferResult, Message
from protocol.validation import TensorSpec
from trainer.config import RunConfig, stage_layer_ranges

if TYPE_CHECKING:
    from hivemind.p2p import P2P

#: ``await call(peer_id, handler, msg, timeout)``: one RPC; raises ProtocolError (RemoteError for Error replies),
#: TimeoutError or OSError; returns Busy or the reply
Call = Callable[[str, str, Message, float], Awaitable[Message]]
ReadSwarm = Callable[[], Awaitable[dict[str, PeerRecord]]]

RETRY_WAIT_S = 0.2  # pause once every candidate of a stage failed, refused or was busy
REFRESH_S = 5.0  # the swarm's records are re-read this often while generating
REFRESH_MIN_S = 1.0  # ... and at most this often when a stage runs out of candidates
RATE_LIMITED_WAIT_S = 0.25  # a peer that says we ask too often is skipped this long


class SwarmUnavailable(UserError):
    """A stage has no training peer, or none of its peers answered in time: try again later."""

    exit_code = 3


class RunMismatch(UserError):
    """The peers at --initial-peers train another run than the run file given."""


class NotAdmitted(UserError):
    """A closed run's peers serve only admitted peers."""


@dataclass(frozen=True)
class Hop:
    """Who computed one stage of the last token: the peer, the local step of its weights, seconds it took."""

    peer_id: str
    version: int
    seconds: float


class RemotePipeline:
    """The swarm's stages as one model for sampling (one sequence at a time).

    Args:
        run: the run the swarm trains (shapes, stages, codecs).
        call: one RPC to a peer (``rpc_call`` in production).
        read_swarm: reads the swarm's validated records (``fetch_swarm`` as a DHT client).
        codec: the codec stages reply in: the run's activation codec (default), ``fp16`` or ``none``.
        timeout_s: seconds one token may take through every stage, retries included.
        rpc_timeout_s: seconds one call may take.
        where: how errors name the swarm (the initial peers' address).
    """

    def __init__(self, *, run: RunConfig, call: Call, read_swarm: ReadSwarm, codec: str | None = None,
                 timeout_s: float = 30.0, rpc_timeout_s: float = 10.0, rng: random.Random | None = None,
                 where: str = "--initial-peers") -> None:
        self.run, self.call, self.read_swarm, self.where = run, call, read_swarm, where
        self.codec = codec or infer_codecs(run)[0]
        if self.codec not in infer_codecs(run):
            raise UserError(f"--codec {self.codec}: the peers reply in one of {', '.join(infer_codecs(run))}")
        self.codec_id = parse_codec(self.codec).id
        self.timeout_s, self.rpc_timeout_s = timeout_s, rpc_timeout_s
        blocks = [e - s for s, e in stage_layer_ranges(run)]
        self.router = Router(stage_costs(blocks, n_embd=run.model.n_embd, vocab_size=run.model.vocab_size),
                             ban_base_s=1.0, ban_max_s=30.0, rng=rng)
        self.records: dict[str, PeerRecord] = {}
        self.read_at = -REFRESH_S
        self.hops: list[Hop] = []  # the last token's, one per stage
        self.excluded: set[str] = set()  # replicas whose state the others of their stage do not vouch for

    # ----- the swarm -------------------------------------------------------------------------------------------------
    async def refresh(self) -> dict[str, PeerRecord]:
        """Re-read the swarm's records (an empty read keeps the last view)."""
        records = await self.read_swarm()
        self.read_at = time.monotonic()
        if records:
            self.records = records
            self.router.forget(records)
        return self.records

    async def witness_stages(self, vouched: list[str] | None = None) -> dict[int, list[str]]:
        """Keep, per stage, only the replicas whose state a majority of the stage's replicas vouch for (digests,
        ``peer.state.witness.agreeing_replicas``): a liar announcing the most progress serves no token. With
        ``vouched`` (the initial peers and the peers they know by validated work, ``peer.membership.vouches``), a
        stage where any of them is a replica is judged among those only, so announced identities that did no work
        cannot outvote it. Returns the replicas excluded per stage; ``SwarmUnavailable`` when no replica of a stage
        is vouched for."""
        from peer.state.sync import StateSyncConfig
        from peer.state.witness import agreeing_replicas

        call = self.call

        class _Transport:
            async def call(self, peer_id: str, name: str, msg: Message, *, timeout: float) -> Message:
                return await call(peer_id, name, msg, timeout)

        out: dict[int, list[str]] = {}
        known = set(vouched or ())
        for stage in range(self.run.n_stages):
            announced = [r.peer_id for r in self.records.values()
                         if r.stage == stage and r.state == PeerState.TRAINING]
            if not announced:  # wait_for_stages says so
                continue
            peers = [p for p in announced if p in known] or announced
            if len(peers) < 2:
                kept = peers
            else:
                kept = await agreeing_replicas(transport=_Transport(), run=self.run, stage=stage, peers=peers,
                                               config=StateSyncConfig(witness_timeout_s=min(10.0, self.timeout_s)))
            if not kept:
                raise SwarmUnavailable(f"no replica of stage {stage} is vouched for by the others ({len(peers)} "
                                       "announced): they disagree, or none answered; try again later")
            if set(kept) != set(announced):
                out[stage] = sorted(set(announced) - set(kept))
                self.excluded.update(out[stage])
        return out

    def missing(self) -> list[int]:
        """Stages with no announced training peer in the current view."""
        have = {r.stage for r in self.records.values() if r.state == PeerState.TRAINING}
        return [s for s in range(self.run.n_stages) if s not in have]

    async def wait_for_stages(self, wait_s: float) -> None:
        """Read the swarm until every stage has a training peer; ``SwarmUnavailable`` after ``wait_s`` seconds."""
        deadline = time.monotonic() + wait_s
        while True:
            await self.refresh()
            if not self.missing():
                return
            if time.monotonic() >= deadline:
                raise self._unavailable(self.missing())
            await asyncio.sleep(0.5)

    def _unavailable(self, stages: list[int]) -> SwarmUnavailable:
        run, where = self.run, self.where
        seen = ("no peer of this run at all: check --run, the peers' run file" if not self.records
                else f"{len(self.records)} peer(s) of this run")
        return SwarmUnavailable(
            f"no training peer of stage(s) {stages} of run {run.run_id} ({run.name!r}) in the swarm at {where} "
            f"({seen}); try again when one trains, or start one: asyncmesh-peer join --stage {stages[0]} --run "
            f"<the run file> --initial-peers {where}")

    async def probe_run(self, peer_ids: list[str]) -> None:
        """Ask ``peer_ids`` (the initial peers) whether they train this run; ``RunMismatch`` when one says not."""
        msg = Infer(run_id=self.run.run_id, stage=0, inputs=encode(torch.zeros(1, 1, dtype=torch.int64), "none"),
                    codec=self.codec)
        for pid in peer_ids:
            try:
                await self.call(pid, INFER_RPC, msg, self.rpc_timeout_s)
            except RemoteError as e:
                if e.code == ErrorCode.WRONG_RUN:
                    raise self._mismatch(e) from None
            except (ProtocolError, TimeoutError, OSError):
                continue  # not serving yet, or gone: nothing learnt

    def _mismatch(self, e: RemoteError) -> RunMismatch:
        theirs = e.message.rsplit(" ", 1)[-1] if "trains run" in e.message else "another run"
        return RunMismatch(f"the swarm at --initial-peers trains run {theirs}, not run {self.run.run_id} "
                           f"({self.run.name!r}); pass the peers' run file with --run")

    # ----- one token -------------------------------------------------------------------------------------------------
    async def next_logits(self, ids: list[int]) -> torch.Tensor:
        """Logits [1, vocab] of the token after ``ids`` (the last ``block_size`` of them are the context)."""
        ids = ids[-self.run.model.block_size:]
        if not ids:
            raise ValueError("the context must hold at least one token")
        deadline = time.monotonic() + self.timeout_s
        if time.monotonic() - self.read_at >= REFRESH_S:
            await self.refresh()
        env = encode(torch.tensor([ids], dtype=torch.int64), "none")
        hops: list[Hop] = []
        out = None
        for stage in range(self.run.n_stages):
            env, out, hop = await self._hop(stage, env, len(ids), deadline)
            hops.append(hop)
        self.hops = hops
        assert out is not None
        return out

    def _spec(self, stage: int, positions: int) -> TensorSpec:
        if stage == self.run.n_stages - 1:
            return TensorSpec((1, self.run.model.vocab_size), torch.float32)
        return TensorSpec((1, positions, self.run.model.n_embd), torch.float32, max_abs=MAX_ACT_ABS)

    async def _hop(self, stage: int, env: TensorEnvelope, positions: int,
                   deadline: float) -> tuple[TensorEnvelope, torch.Tensor, Hop]:
        """One stage: the reply's envelope (handed to the next stage as it is), its decoded tensor, who served it."""
        msg = Infer(run_id=self.run.run_id, stage=stage, inputs=env, codec=self.codec)
        tried: set[str] = set()
        refused: set[str] = set()  # peers that would not serve us (a closed run)
        why = "no answer"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SwarmUnavailable(f"no peer of stage {stage} answered within --timeout {self.timeout_s:g} s "
                                       f"(last: {why}); the swarm may be busy or unreachable, try again later")
            try:
                record = self.router.choose(self.records.values(), stage, exclude=tried | self.excluded)
            except NoRouteError:
                if time.monotonic() - self.read_at >= REFRESH_MIN_S:
                    await self.refresh()
                stage_peers = {r.peer_id for r in self.records.values()
                               if r.stage == stage and r.state == PeerState.TRAINING}
                if not stage_peers:
                    raise self._unavailable([stage]) from None
                if stage_peers <= refused:
                    raise NotAdmitted(f"the peers of stage {stage} refuse this client ({why}): a closed run serves "
                                      "only admitted peers; generate from an exported model (--model) instead") \
                        from None
                await asyncio.sleep(min(RETRY_WAIT_S, max(left, 0.0)))
                tried.clear()
                continue
            pid = record.peer_id
            tried.add(pid)
            t0 = time.monotonic()
            try:
                reply = await self.call(pid, INFER_RPC, msg, min(self.rpc_timeout_s, max(left, 0.1)))
            except RemoteError as e:
                code = e.code.name if isinstance(e.code, ErrorCode) else f"code {e.code}"  # a code newer than ours
                why = f"{short_id(pid)}: {code} {e.message[:160]}"
                if e.code == ErrorCode.WRONG_RUN:
                    raise self._mismatch(e) from None
                if e.code == ErrorCode.UNAUTHORIZED:
                    refused.add(pid)
                if e.code == ErrorCode.RATE_LIMITED:
                    self.router.busy(pid, RATE_LIMITED_WAIT_S)
                else:
                    self.router.failure(pid)
                continue
            except (ProtocolError, TimeoutError, OSError) as e:
                why = f"{short_id(pid)}: {type(e).__name__} {str(e)[:160]}"
                self.router.failure(pid)
                continue
            if isinstance(reply, Busy):
                why = f"{short_id(pid)}: busy"
                self.router.busy(pid, reply.retry_after_s)
                continue
            try:
                if not isinstance(reply, InferResult) or reply.stage != stage:
                    raise ValueError(f"answered {type(reply).__name__}, not stage {stage}'s InferResult")
                if reply.outputs.codec != self.codec_id:
                    raise ValueError(f"replied in codec id {reply.outputs.codec}, not {self.codec}")
                out = decode(reply.outputs, self._spec(stage, positions), peer=pid, field="outputs")  # one sequence
            except (ValueError, ProtocolError) as e:  # a peer that answers garbage is not asked again for a while
                why = f"{short_id(pid)}: {str(e)[:160]}"
                self.router.failure(pid)
                continue
            seconds = time.monotonic() - t0
            self.router.success(pid, seconds)
            return reply.outputs, out, Hop(pid, reply.version, seconds)


def rpc_call(p2p: P2P, max_message_bytes: int) -> Call:
    """``Call`` over ``protocol.rpc.call`` on ``p2p``, reading replies of at most ``max_message_bytes`` (an ``infer``
    reply is small: ``sizes.infer_message_bytes``)."""
    from protocol.limits import RpcLimits
    from protocol.rpc import call

    m = max_message_bytes
    limits = RpcLimits(max_message_bytes=m, max_frame_bytes=m, send_frame_bytes=min(m, 1 << 20))

    async def one(peer_id: str, name: str, msg: Message, timeout: float) -> Message:
        return await call(p2p, peer_id, name, msg, timeout=timeout, limits=limits)

    return one
