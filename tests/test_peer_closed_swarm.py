"""A closed run of real peer processes: admitted peers train together; a peer without a credential cannot start,
and a stranger's raw RPC call to an admitted peer is refused as UNAUTHORIZED."""

from __future__ import annotations

import asyncio
import base64
import signal
from pathlib import Path

import pytest
from hivemind.p2p import P2P
from swarm_utils import TINY_RUN, swarm  # noqa: F401  (fixture)

from peer.membership.admission import issue
from peer.membership.signing import Signer
from protocol.errors import RemoteError
from protocol.messages import Hello
from protocol.rpc import call
from trainer.config import AccessConfig, RunConfig

STEPS = 20


def _closed_run(tmp_path: Path, organiser: Signer) -> Path:
    base = RunConfig.from_toml(TINY_RUN)
    key = base64.b64encode(organiser.public_key).decode()
    path = tmp_path / "closed.toml"
    path.write_text(base.to_toml() + f'\n[access]\nmode = "closed"\norganiser_key = "{key}"\n')
    run = RunConfig.from_toml(path)
    assert run.access == AccessConfig(mode="closed", organiser_key=key)
    return path


def _admit(swarm_root: Path, name: str, organiser: Signer, run_id: str) -> list[str]:
    """Create peer ``name``'s identity where the swarm helper will use it and issue its credential."""
    folder = swarm_root / name
    folder.mkdir(parents=True, exist_ok=True)
    P2P.generate_identity(str(folder / "identity.key"))
    peer_id = Signer.from_identity_file(folder / "identity.key").peer_id
    cred = folder / "peer.credential"
    cred.write_text(base64.b64encode(issue(organiser, run_id=run_id, peer_id=peer_id, valid_s=3600)).decode())
    return ["--credential", str(cred)]


@pytest.mark.timeout(240)
def test_closed_run_trains_admitted_peers_and_refuses_strangers(swarm, tmp_path):  # noqa: F811
    organiser = Signer.generate()
    run_file = _closed_run(tmp_path, organiser)
    run_id = RunConfig.from_toml(run_file).run_id
    a = swarm.start("a", *_admit(swarm.root, "a", organiser, run_id), stage="0", run=run_file, max_steps=STEPS)
    first = a.wait_maddrs()[:1]
    b = swarm.start("b", *_admit(swarm.root, "b", organiser, run_id), stage="1", run=run_file, initial=first)
    stranger = swarm.start("c", stage="1", run=run_file, initial=first)  # no credential
    assert stranger.wait_exit(60) == 1 and "--credential" in stranger.log()
    b.wait_status(lambda s: s.get("state") == "training", 90, "training state")
    assert b.wait_status(lambda s: True, 5, "status")["access"] == "closed"

    async def knock() -> str:
        # connect to b directly: a lookup through a alone sometimes finds no route ("failed to find any peer")
        p2p = await P2P.create(initial_peers=[*first, *b.wait_maddrs()[:1]], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            hello = Hello(protocol_version=1, run_id=run_id, stage=1, peer_id="x", capabilities=[])
            with pytest.raises(RemoteError) as e:
                await call(p2p, b.wait_maddrs()[0].rsplit("/p2p/", 1)[1], "reach", hello, timeout=20)
            return e.value.code.name
        finally:
            await p2p.shutdown()

    assert asyncio.run(knock()) == "UNAUTHORIZED"
    assert a.wait_exit(180) == 0
    b.signal(signal.SIGTERM)
    assert b.wait_exit(30) == 0
    assert a.summary()["steps"] >= STEPS and b.summary()["steps"] >= STEPS // 2
