"""DHT record validation: malformed values from the network are skipped and counted, never raised."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from peer.membership import records as dht_records
from peer.membership.records import PeerRecord, RecordError, parse_swarm


def good(pid: str = "QmA", **kw) -> dict:
    v = PeerRecord(peer_id=pid, stage=1, throughput=2.5, queue=3, version=7, state="training",
                   maddrs=["/ip4/127.0.0.1/tcp/1"], loss=3.2).to_value()
    v.update(kw)
    return v


def raw(entries: dict) -> SimpleNamespace:
    return SimpleNamespace(value={k: SimpleNamespace(value=v, expiration_time=0.0) for k, v in entries.items()})


def test_roundtrip():
    r = PeerRecord.from_value("QmA", good())
    assert r.stage == 1 and r.throughput == 2.5 and r.loss == 3.2 and r.maddrs == ["/ip4/127.0.0.1/tcp/1"]


@pytest.mark.parametrize("bad", [
    dict(stage=-1), dict(stage="1"), dict(stage=True), dict(throughput=math.nan), dict(throughput=-1.0),
    dict(queue=1.5), dict(version=-3), dict(state="hacking"), dict(maddrs="x"), dict(maddrs=["a"] * 100),
    dict(loss=math.inf), dict(loss="low"), dict(reachable=1), dict(peer_id="QmB"), dict(extra=1),
])
def test_invalid_fields_are_rejected(bad):
    with pytest.raises(RecordError):
        PeerRecord.from_value("QmA", good(**bad))


def test_parse_swarm_skips_and_counts_bad_records_and_stopped_peers():
    before = dict(dht_records.rejected)
    found = raw({"QmA": good("QmA"), "QmB": good("QmB", stage="x"), "QmC": [1, 2], "QmD": good("QmD", state="stopped"),
                 123: good("123")})
    out = parse_swarm(found)
    assert set(out) == {"QmA"}
    assert dht_records.rejected["invalid"] - before.get("invalid", 0) == 3
    assert set(parse_swarm(found, include_stopped=True)) == {"QmA", "QmD"}
    assert parse_swarm(None) == {}
    assert parse_swarm(SimpleNamespace(value=b"junk")) == {}
