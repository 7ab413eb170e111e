"""DHT record validation: malformed values from the network are skipped and counted, never raised."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from hivemind.utils import get_dht_time

from peer.membership import records as dht_records
from peer.membership.records import PeerRecord, RecordError, parse_swarm, swarm_key
from peer.membership.signing import Signer, seal


def good(pid: str = "QmA", **kw) -> dict:
    v = PeerRecord(peer_id=pid, stage=1, throughput=2.5, queue=3, version=7, state="training",
                   maddrs=["/ip4/127.0.0.1/tcp/1"], loss=3.2).to_value()
    v.update(kw)
    return v


RUN = "records-test-run"
SIGNERS: dict[str, Signer] = {}


def raw(entries: dict) -> SimpleNamespace:
    """A DHT answer whose values are signed by the key that owns each subkey (records are keyed by real peer ids)."""
    exp = get_dht_time() + 20
    return SimpleNamespace(value={k: SimpleNamespace(value=seal(SIGNERS[k], swarm_key(RUN), v, exp)
                                                     if k in SIGNERS else v, expiration_time=exp)
                                  for k, v in entries.items()})


def pid() -> str:
    """A real peer id (its signer is kept so ``raw`` can sign its record)."""
    signer = Signer.generate()
    SIGNERS[signer.peer_id] = signer
    return signer.peer_id


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
    a, b, c, d = pid(), pid(), pid(), pid()
    found = raw({a: good(a), b: good(b, stage="x"), c: [1, 2], d: good(d, state="stopped"), 123: good("123")})
    out = parse_swarm(found, RUN)
    assert set(out) == {a}
    assert dht_records.rejected["invalid"] - before.get("invalid", 0) == 3
    assert set(parse_swarm(found, RUN, include_stopped=True)) == {a, d}
    assert parse_swarm(None, RUN) == {}
    assert parse_swarm(SimpleNamespace(value=b"junk"), RUN) == {}
