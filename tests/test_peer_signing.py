"""Owned DHT records: only the peer whose id is the subkey can store its record, with a bounded expiration.

The unit tests drive ``SignedRecordValidator`` directly; the loopback test runs three real hivemind DHT nodes: an
honest one, an honest reader and an attacker whose node installs no validator (as a stranger's would not) and stores
forged, far-future, malformed and replayed records. The honest nodes must refuse to store them and the reader must
never see them.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from peer.membership import records as dht_records
from peer.membership.records import PeerRecord, announce, fetch_swarm, parse_swarm, record_validator, swarm_key
from peer.membership.signing import Signer, open_envelope, peer_id_of, seal
from tests.dht_utils import signed_dht

pytestmark = pytest.mark.timeout(120)

RUN = "signing-test-run"
KEY = swarm_key(RUN)
TEN_YEARS = 10 * 365 * 86400.0


def _rec(peer_id: str, state: str = "training", throughput: float = 1.0) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, stage=0, throughput=throughput, queue=0, version=1, state=state)


def _dht_record(subkey: str, value: object, expiration: float, key: str = KEY) -> DHTRecord:
    return DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(subkey),
                     MSGPackSerializer.dumps(value), expiration)


def test_validator_accepts_an_honest_record_and_refuses_forgeries():
    honest, attacker = Signer.generate(), Signer.generate()
    v = record_validator(RUN)
    exp = get_dht_time() + 20
    good = seal(honest, KEY, _rec(honest.peer_id).to_value(), exp)
    assert v.validate(_dht_record(honest.peer_id, good, exp))
    # the attacker signs a record claiming the honest peer's id
    forged = seal(attacker, KEY, _rec(honest.peer_id, state="stopped").to_value(), exp)
    assert not v.validate(_dht_record(honest.peer_id, forged, exp))
    # the honest envelope moved to another subkey, a stretched expiration, another run's key
    assert not v.validate(_dht_record(attacker.peer_id, good, exp))
    assert not v.validate(_dht_record(honest.peer_id, good, exp + 5))
    assert not record_validator("other-run").validate(_dht_record(honest.peer_id, good, exp,
                                                                  key=swarm_key("other-run")))
    # a correctly signed record that expires in ten years
    far = get_dht_time() + TEN_YEARS
    assert not v.validate(_dht_record(honest.peer_id, seal(honest, KEY, _rec(honest.peer_id).to_value(), far), far))
    # signed but malformed body; unsigned plain record; junk
    bad_body = seal(honest, KEY, {"peer_id": honest.peer_id, "stage": "zero"}, exp)
    assert not v.validate(_dht_record(honest.peer_id, bad_body, exp))
    assert not v.validate(_dht_record(honest.peer_id, _rec(honest.peer_id).to_value(), exp))
    assert not v.validate(DHTRecord(DHTID.generate(source=KEY).to_bytes(), b"\xc1", b"\xc1\xff", exp))
    # nothing is stored under any other key: a peer's DHT is no free storage for strangers
    assert not v.validate(_dht_record("x", b"anything", exp, key="some-other-key"))
    assert not v.validate(_dht_record(honest.peer_id, seal(honest, "other", _rec(honest.peer_id).to_value(), exp),
                                      exp, key="other"))


def _rsa_signer(e: int) -> Signer:
    """An RSA-2048 identity with public exponent ``e`` (libp2p's keys use 65537; a stranger may pick any)."""
    from cryptography.hazmat.primitives.asymmetric import rsa

    base = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_numbers()
    p, q = base.p, base.q
    phi = (p - 1) * (q - 1)
    d = pow(e, -1, phi)
    numbers = rsa.RSAPrivateNumbers(p, q, d, d % (p - 1), d % (q - 1), pow(q, -1, p),
                                    rsa.RSAPublicNumbers(e, p * q))
    return Signer(numbers.private_key())


def test_costly_rsa_keys_are_refused_and_verified_records_are_remembered():
    import math
    import random

    from peer.membership import signing

    rng = random.Random(0)
    cheap = _rsa_signer(65537)
    while True:  # an exponent of ~2040 bits, coprime with phi (what the costly_keys attack uses)
        e = rng.getrandbits(2040) | 1
        try:
            costly = _rsa_signer(e)
            break
        except ValueError:
            continue
    assert math.gcd(e, 65537) >= 1
    exp = get_dht_time() + 30
    v = record_validator(RUN)
    for signer, ok in ((cheap, True), (costly, False)):
        value = seal(signer, KEY, _rec(signer.peer_id).to_value(), exp)
        assert v.validate(_dht_record(signer.peer_id, value, exp)) is ok
    # a verified record is verified once: the second read of the same envelope costs a hash, not an RSA verification
    value = seal(cheap, KEY, _rec(cheap.peer_id, throughput=2.0).to_value(), exp)
    calls = []
    real = signing._verify
    signing._verify = lambda *a: calls.append(1) or real(*a)
    try:
        for _ in range(3):
            assert open_envelope(KEY, cheap.peer_id, value, exp)
    finally:
        signing._verify = real
    assert len(calls) == 1


def test_unexpired_records_under_the_run_key_are_bounded():
    v = record_validator(RUN)
    v.max_live = 3
    exp = get_dht_time() + 30
    signers = [Signer.generate() for _ in range(4)]
    values = [seal(s, KEY, _rec(s.peer_id).to_value(), exp) for s in signers]
    assert all(v.validate(_dht_record(s.peer_id, val, exp)) for s, val in zip(signers[:3], values, strict=False))
    assert not v.validate(_dht_record(signers[3].peer_id, values[3], exp))  # a fourth owner: no room
    assert v.validate(_dht_record(signers[0].peer_id, values[0], exp))  # a known owner's newer record still fits
    v._live = {k: 0.0 for k in v._live}  # the first three expired
    assert v.validate(_dht_record(signers[3].peer_id, values[3], exp))


def test_the_credential_is_inside_the_signature():
    signer = Signer.generate()
    exp = get_dht_time() + 30
    value = seal(signer, KEY, _rec(signer.peer_id).to_value(), exp, b"credential-a")
    assert open_envelope(KEY, signer.peer_id, value, exp)
    swapped = {**value, "c": b"credential-b"}
    with pytest.raises(Exception, match="signature"):
        open_envelope(KEY, signer.peer_id, swapped, exp)
    with pytest.raises(Exception, match="signature"):
        open_envelope(KEY, signer.peer_id, {k: v for k, v in value.items() if k != "c"}, exp)


def test_rsa_identities_sign_and_verify(tmp_path: Path):
    from hivemind.p2p import P2P, PeerID

    P2P.generate_identity(str(tmp_path / "rsa.key"))
    signer = Signer.from_identity_file(tmp_path / "rsa.key")
    assert signer.peer_id == PeerID.from_identity((tmp_path / "rsa.key").read_bytes()).to_base58()
    assert peer_id_of(signer.public_key) == signer.peer_id
    exp = get_dht_time() + 20
    body = open_envelope(KEY, signer.peer_id, seal(signer, KEY, {"a": 1}, exp), exp)
    assert body == {"a": 1}


def test_parse_swarm_drops_and_counts_unsigned_records():
    honest = Signer.generate()
    exp = get_dht_time() + 20
    from types import SimpleNamespace

    def item(v: object) -> SimpleNamespace:
        return SimpleNamespace(value=v, expiration_time=exp)

    found = SimpleNamespace(value={honest.peer_id: item(seal(honest, KEY, _rec(honest.peer_id).to_value(), exp)),
                                   "QmX": item(_rec("QmX").to_value())})
    before = dht_records.rejected["bad_signature"]
    assert set(parse_swarm(found, RUN)) == {honest.peer_id}
    assert dht_records.rejected["bad_signature"] - before == 1


async def _local_subkeys(_dht, node) -> dict:
    """Run inside a DHT process: what that node itself stores under the run's key (subkey -> expiration)."""
    item = node.protocol.storage.get(DHTID.generate(source=KEY))
    if item is None:
        return {}
    return {sk: exp for sk, (_, exp) in item.value.items()}


def test_forged_far_future_malformed_and_replayed_records_are_refused_by_a_live_dht(tmp_path: Path):
    honest_dht, honest = signed_dht(tmp_path, "honest", RUN)
    maddrs = [str(m) for m in honest_dht.get_visible_maddrs()]
    reader_dht, _ = signed_dht(tmp_path, "reader", RUN, maddrs)
    attacker_dht, attacker = signed_dht(tmp_path, "attacker", RUN, maddrs, validate=False)
    dhts = [honest_dht, reader_dht, attacker_dht]

    async def store(value: object, subkey: str, expiration: float) -> None:
        await asyncio.wait_for(attacker_dht.store(KEY, value, expiration, subkey=subkey, return_future=True), 10)

    async def main() -> None:
        first = get_dht_time() + 8
        old = seal(honest, KEY, _rec(honest.peer_id).to_value(), first)  # what an eavesdropper keeps to replay
        assert await announce(honest_dht, RUN, _rec(honest.peer_id), 8, signer=honest)
        assert await announce(honest_dht, RUN, _rec(honest.peer_id, state="stopped"), 20, signer=honest)
        now = get_dht_time()
        # 1. a record for the honest peer's id, signed by the attacker, expiring later than the honest one
        await store(seal(attacker, KEY, _rec(honest.peer_id, throughput=1e9).to_value(), now + 50),
                    honest.peer_id, now + 50)
        # 2. the attacker's own record, correctly signed, for ten years
        await store(seal(attacker, KEY, _rec(attacker.peer_id).to_value(), now + TEN_YEARS), attacker.peer_id,
                    now + TEN_YEARS)
        # 3. malformed: an unsigned record and a signed envelope around a bad body, under other ids
        third, fourth = Signer.generate(), Signer.generate()
        await store(_rec(third.peer_id).to_value(), third.peer_id, now + 10)
        await store(seal(fourth, KEY, {"stage": -1}, now + 10), fourth.peer_id, now + 10)
        # 4. the honest peer's own earlier record, replayed: valid signature, older expiration
        await store(old, honest.peer_id, first)

        for dht in (honest_dht, reader_dht):
            local = await asyncio.wait_for(dht.run_coroutine(_local_subkeys, return_future=True), 10)
            assert set(local) == {honest.peer_id}, local  # nothing of the attacker's was stored
            assert local[honest.peer_id] < now + 21  # and the honest record kept its own expiration
        deadline = time.monotonic() + 10
        while True:
            seen = await fetch_swarm(reader_dht, RUN, timeout=5, include_stopped=True)
            if honest.peer_id in seen or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        assert set(seen) == {honest.peer_id}
        assert seen[honest.peer_id].state == "stopped" and seen[honest.peer_id].throughput == 1.0  # not the forged 1e9

    try:
        asyncio.run(main())
    finally:
        for d in dhts:
            d.shutdown()
