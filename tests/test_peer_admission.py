"""Closed runs: organiser-signed, peer-bound, expiring credentials; checked by the DHT validator and the RPC gate."""

from __future__ import annotations

import asyncio
import base64
import subprocess
import sys
from pathlib import Path

import pytest
from hivemind.utils import get_dht_time

from peer.errors import DaemonError
from peer.membership.admission import AdmissionError, check, issue, organiser_key
from peer.membership.gate import AdmissionGate
from peer.membership.records import PeerRecord, record_validator, swarm_key
from peer.membership.signing import Signer, seal
from peer.ops.metrics import PeerMetrics
from tests.test_peer_signing import _dht_record
from trainer.config import AccessConfig, RunConfig

ORGANISER = Signer.generate()
CLOSED = RunConfig(name="closed", access=AccessConfig(mode="closed",
                                                      organiser_key=base64.b64encode(ORGANISER.public_key).decode()))
KEY = organiser_key(CLOSED)


def test_credentials_admit_one_peer_of_one_run_until_they_expire():
    peer, other = Signer.generate(), Signer.generate()
    cred = issue(ORGANISER, run_id=CLOSED.run_id, peer_id=peer.peer_id, valid_s=60, now=1000.0)
    assert check(cred, organiser_key=KEY, run_id=CLOSED.run_id, peer_id=peer.peer_id, now=1010.0).expires_at == 1060
    with pytest.raises(AdmissionError, match="another peer"):
        check(cred, organiser_key=KEY, run_id=CLOSED.run_id, peer_id=other.peer_id, now=1010.0)
    with pytest.raises(AdmissionError, match="expired"):
        check(cred, organiser_key=KEY, run_id=CLOSED.run_id, peer_id=peer.peer_id, now=1061.0)
    with pytest.raises(AdmissionError, match="another run"):
        check(cred, organiser_key=KEY, run_id="0" * 16, peer_id=peer.peer_id, now=1010.0)
    forged = issue(other, run_id=CLOSED.run_id, peer_id=peer.peer_id, valid_s=60, now=1000.0)
    with pytest.raises(AdmissionError, match="organiser"):
        check(forged, organiser_key=KEY, run_id=CLOSED.run_id, peer_id=peer.peer_id, now=1010.0)
    for junk in (None, b"", b"\x93\x01\x02\x03", "text"):
        with pytest.raises(AdmissionError):
            check(junk, organiser_key=KEY, run_id=CLOSED.run_id, peer_id=peer.peer_id)


def test_a_closed_runs_dht_refuses_records_without_the_owners_credential():
    peer, other = Signer.generate(), Signer.generate()
    key, v = swarm_key(CLOSED.run_id), record_validator(CLOSED.run_id, KEY)
    exp = get_dht_time() + 20

    def record(signer: Signer, credential: bytes | None):
        value = PeerRecord(peer_id=signer.peer_id, stage=0, throughput=1.0, queue=0, version=0, state="training")
        return _dht_record(signer.peer_id, seal(signer, key, value.to_value(), exp, credential), exp, key=key)

    own = issue(ORGANISER, run_id=CLOSED.run_id, peer_id=peer.peer_id, valid_s=3600)
    assert v.validate(record(peer, own))
    assert not v.validate(record(peer, None))  # no credential
    assert not v.validate(record(other, own))  # another peer's credential, replayed
    expired = issue(ORGANISER, run_id=CLOSED.run_id, peer_id=peer.peer_id, valid_s=1, now=0.0)
    assert not v.validate(record(peer, expired))
    short = issue(ORGANISER, run_id=CLOSED.run_id, peer_id=peer.peer_id, valid_s=5)
    assert not v.validate(record(peer, short))  # the record (20 s) would outlive its credential (5 s)
    assert record_validator(CLOSED.run_id).validate(record(peer, None))  # an open run needs none


def test_gate_loads_the_own_credential_and_admits_only_peers_in_the_view(tmp_path: Path):
    me = Signer.generate()
    path = tmp_path / "me.credential"
    path.write_text(base64.b64encode(issue(ORGANISER, run_id=CLOSED.run_id, peer_id=me.peer_id, valid_s=3600))
                    .decode())

    class Cfg:
        credential_path = path

    gate = AdmissionGate(CLOSED, Cfg())
    gate.load_own(me.peer_id)
    assert gate.credential is not None
    with pytest.raises(DaemonError, match="another peer"):
        gate.load_own(Signer.generate().peer_id)
    with pytest.raises(DaemonError, match="--credential"):
        AdmissionGate(CLOSED, object()).load_own(me.peer_id)
    assert AdmissionGate(RunConfig(), object()).rpc_gate(dict, None) is None  # open: no gate

    view: dict[str, object] = {"known": object()}
    refreshed = []

    async def refresh() -> None:
        refreshed.append(1)
        view["late"] = object()

    async def go() -> list[bool]:
        check_ = gate.rpc_gate(lambda: view, refresh)
        return [await check_("known"), await check_("late"), await check_("stranger"), await check_("stranger")]

    assert asyncio.run(go()) == [True, True, False, False]
    assert len(refreshed) == 1  # strangers cannot make us read the DHT more than once per REFRESH_MIN_S


def test_rpc_gate_refuses_unadmitted_senders_with_unauthorized():
    from hivemind.p2p import P2P

    from protocol.errors import RemoteError
    from protocol.messages import Ack, Hello
    from protocol.rpc import RpcServer, call

    async def main() -> None:
        server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        client = await P2P.create(initial_peers=await server.get_visible_maddrs(),
                                  host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            rpc = RpcServer(server)
            served = []

            async def echo(msg, peer):
                served.append(peer)
                return Ack()

            await rpc.add_handler("echo", echo)
            admitted: set[str] = set()

            async def gate(peer: str) -> bool:
                return peer in admitted

            rpc.gate = gate
            hello = Hello(protocol_version=1, run_id="r", stage=0, peer_id="x", capabilities=[])
            with pytest.raises(RemoteError) as e:
                await call(client, server.peer_id, "echo", hello, timeout=10)
            assert e.value.code.name == "UNAUTHORIZED" and not served
            admitted.add(client.peer_id.to_base58())
            assert isinstance(await call(client, server.peer_id, "echo", hello, timeout=10), Ack)
        finally:
            await asyncio.gather(client.shutdown(), server.shutdown(), return_exceptions=True)

    asyncio.run(main())


def test_access_section_status_field_and_the_admit_command(tmp_path: Path):
    assert "access" not in RunConfig().to_dict()  # open runs keep their run ids
    assert CLOSED.to_dict()["access"]["mode"] == "closed" and CLOSED.run_id != RunConfig(name="closed").run_id
    with pytest.raises(ValueError):
        AccessConfig(mode="closed")
    with pytest.raises(ValueError):
        AccessConfig(mode="members-only")
    m = PeerMetrics("p", 0)
    assert m.snapshot()["access"] == "open"

    cli = [sys.executable, "-m", "peer.cli", "admit"]
    out = subprocess.run([*cli, "--new-key", str(tmp_path / "org.key")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    run_file = tmp_path / "run.toml"
    run_file.write_text(RunConfig(name="closed-test").to_toml() + "\n" + "\n".join(out.stdout.splitlines()[1:]) + "\n")
    run = RunConfig.from_toml(run_file)
    assert run.access.mode == "closed"
    peer = Signer.generate()
    out = subprocess.run([*cli, "--key", str(tmp_path / "org.key"), "--run", str(run_file), "--peer-id",
                          peer.peer_id, "--days", "1", "--out", str(tmp_path / "p.cred")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    cred = base64.b64decode((tmp_path / "p.cred").read_text())
    assert check(cred, organiser_key=organiser_key(run), run_id=run.run_id, peer_id=peer.peer_id)
    again = subprocess.run([*cli, "--new-key", str(tmp_path / "org.key")], capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "exists" in again.stderr
