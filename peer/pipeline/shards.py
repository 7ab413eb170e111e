"""Which data shard a stage-0 peer reads (streamed datasets, ``trainer.stream``): one no other live stage-0 peer reads.

A peer announces its shard in its record (``data_shard``). On entering stage 0 it reads the swarm and takes, in this
order: the shard it read last (its checkpoint folder's data position, so a restart continues its own documents) when
no other live peer announces it; else the first shard free of announcements in its own probe order (starting at a
hash of its peer id, so peers joining together spread out); else, all shards taken, it shares its first choice and
says so (``data_shard_shared``). Two peers entering stage 0 within one announcement period can still pick the same
shard; the next read of the swarm sees it (``shard_conflict``), and the peer with the larger id moves to a free shard,
resuming it where this peer last left it (the documents read twice are those of that window).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from peer.lifecycle import PeerState
from peer.membership.records import PeerRecord
from trainer.stream import DataPosition, ShardStream, stream_key, val_set
from trainer.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    import torch

    from peer.host import StageContext
    from peer.pipeline.driver import Stage0Driver
    from trainer.config import DataConfig

logger = logging.getLogger(__name__)


def taken_shards(swarm: Mapping[str, PeerRecord], my_id: str) -> dict[str, int]:
    """Peer id -> shard of the other live stage-0 peers that announce one."""
    return {pid: r.data_shard for pid, r in swarm.items()
            if pid != my_id and r.data_shard is not None and r.stage == 0 and r.state != PeerState.STOPPED}


def probe_start(my_id: str, n_shards: int) -> int:
    return int.from_bytes(hashlib.sha256(f"asyncmesh-shard/{my_id}".encode()).digest()[:8], "little") % n_shards


def choose_shard(my_id: str, n_shards: int, taken: Mapping[str, int], previous: int | None) -> tuple[int, bool]:
    """(shard, shared): the shard to read and whether another live peer reads it too (every shard taken)."""
    used = set(taken.values())
    if previous is not None and 0 <= previous < n_shards and previous not in used:
        return previous, False
    start = probe_start(my_id, n_shards)
    for k in range(n_shards):
        shard = (start + k) % n_shards
        if shard not in used:
            return shard, False
    return (previous if previous is not None and 0 <= previous < n_shards else start), True


def shard_conflict(my_id: str, shard: int, taken: Mapping[str, int]) -> bool:
    """Whether a peer with a smaller id announces our shard: then we are the one that moves."""
    return any(s == shard and pid < my_id for pid, s in taken.items())


def _previous_shard(host: StageContext, data_cfg: DataConfig) -> int | None:
    """The shard this peer read last in this data, from its ledger (restored from the checkpoint folder)."""
    key = host.ledger.last_key
    last = host.ledger.position(key) if key is not None else None
    if last is None or not isinstance(last.get("shard"), int) or key != stream_key(data_cfg, last["shard"]):
        return None
    return int(last["shard"])


async def open_shard(host: StageContext, data_cfg: DataConfig,
                     ) -> tuple[ShardStream, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Stage 0 on a streamed dataset: a shard no other live stage-0 peer reads, resumed from the ledger's position for
    it, and the fixed held-out validation set (DataError or MissingExtra when the data cannot be used)."""
    run = host.run
    await host.net.refresh_swarm()
    shard, shared = choose_shard(host.net.my_id, data_cfg.shards, taken_shards(host.net.swarm, host.net.my_id),
                                 _previous_shard(host, data_cfg))
    if shared:
        host.metrics.inc("data_shard_shared")
        host.metrics.warn(f"each of the run's {data_cfg.shards} data shards is read by another stage-0 peer; "
                          f"sharing shard {shard} (a run for more stage-0 peers needs a larger data.shards)")
    loop = asyncio.get_running_loop()
    tok = await loop.run_in_executor(None, load_tokenizer, data_cfg)
    val = await loop.run_in_executor(None, val_set, data_cfg, tok, run.model.block_size, run.data.batch_size,
                                     host.cfg.eval_batches)
    stream = shard_stream(host, data_cfg, tok, shard)
    try:
        await loop.run_in_executor(None, stream.wait_ready)  # a source that yields nothing fails here, with a reason
    except BaseException:
        stream.close()
        raise
    return stream, val


def shard_stream(host: StageContext, data_cfg: DataConfig, tok: Tokenizer, shard: int) -> ShardStream:
    """The stream of ``shard`` from the position this peer's ledger holds for it (else its beginning)."""
    saved = host.ledger.position(stream_key(data_cfg, shard))
    start = DataPosition.from_dict(saved) if saved is not None else DataPosition(shard=shard)
    logger.info("stage 0 reads data shard %d of %d from document %d token %d (%d sequences of it read before)",
                shard, data_cfg.shards, start.doc, start.offset, start.sequences)
    return ShardStream(data_cfg, tok, host.run.model.block_size, host.run.data.batch_size, start)


def reading_shard(driver: Stage0Driver | None) -> int | None:
    """The shard a stage-0 driver reads, or None (not a streamed dataset)."""
    stream = driver.stream if driver is not None else None
    return stream.shard if isinstance(stream, ShardStream) else None


def move_if_shared(host: StageContext, driver: Stage0Driver) -> None:
    """A peer with a smaller id announces our shard (we chose within one announcement of each other): continue on a
    free shard; the ledger keeps the old shard's position."""
    stream = driver.stream
    if not isinstance(stream, ShardStream):
        return
    taken = taken_shards(host.net.swarm, host.net.my_id)
    if not shard_conflict(host.net.my_id, stream.shard, taken):
        return
    shard, shared = choose_shard(host.net.my_id, stream.cfg.shards, taken, None)
    if shared:
        return  # every shard is read: nowhere better to go
    host.ledger.detach(stream)
    stream.close()
    driver.stream = shard_stream(host, stream.cfg, stream.tok, shard)
    host.ledger.attach(driver.stream)
    host.metrics.inc("data_shard_moves")
    logger.warning("data shard %d is also read by a peer with a smaller id: moved to shard %d", stream.shard, shard)
