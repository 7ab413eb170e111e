"""Which data shard a stage-0 peer reads: its own previous one, else a free one in its probe order, announced in its
record; a tie between two peers choosing at once is settled by peer id."""

from __future__ import annotations

from peer.membership.records import PeerRecord
from peer.pipeline.shards import choose_shard, probe_start, shard_conflict, taken_shards


def _rec(pid: str, shard: int | None, stage: int = 0, state: str = "training") -> PeerRecord:
    return PeerRecord(peer_id=pid, stage=stage, throughput=1.0, queue=0, version=0, state=state, data_shard=shard)


def test_a_peer_takes_its_previous_shard_else_a_free_one():
    assert choose_shard("me", 8, {}, previous=5) == (5, False)
    assert choose_shard("me", 8, {"a": 5}, previous=5)[0] != 5
    start = probe_start("me", 8)
    assert choose_shard("me", 8, {}, previous=None) == (start, False)
    taken = {f"p{k}": (start + k) % 8 for k in range(3)}
    assert choose_shard("me", 8, taken, previous=None) == ((start + 3) % 8, False)
    full = {f"p{k}": k for k in range(8)}
    assert choose_shard("me", 8, full, previous=2) == (2, True)  # every shard read: shared, and said so


def test_only_live_stage_0_peers_that_announce_a_shard_count():
    swarm = {"me": _rec("me", 1), "a": _rec("a", 1), "b": _rec("b", None), "c": _rec("c", 2, stage=1),
             "d": _rec("d", 3, state="stopped")}
    assert taken_shards(swarm, "me") == {"a": 1}
    assert shard_conflict("me", 1, {"a": 1}) and not shard_conflict("a", 1, {"me": 1})


def test_the_record_carries_the_shard_only_when_set():
    assert "data_shard" not in _rec("x", None).to_value()
    value = _rec("x", 4).to_value()
    assert PeerRecord.from_value("x", value).data_shard == 4
