"""Volunteers behind NAT serve through a circuit relay (network namespaces, iptables MASQUERADE; ``-m wan``).

The lab (tools/natlab.py): peer A on the public side (stage 0, ``--relay-service on``), B behind one NAT (stage 1), C
behind another (stage 0) and, in the relay test, D behind a third (stage 1, B's replica); no port forwarding: nobody
can dial B, C or D, and they cannot dial each other. A reaches B over the connection B opened itself, but C's
micro-batches can reach B, B's gradients C, and B and D each other's averaging parts, only through A's relay. With
``--relay auto`` (the default) the NATed peers find themselves unreachable and join again through A's relay; C trains
(its local step advances only when stage 1's backward answers come back) and B and D average. With ``--relay off``
C never trains.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from swarm_utils import FAST, REPO, TINY_RUN

from peer.ops.procs import PeerProcess, fetch_status_http, join_command
from tools.natlab import NatLab, check_available

pytestmark = [pytest.mark.wan, pytest.mark.skipif(check_available() is not None,
                                                  reason=f"NAT lab unavailable: {check_available()}")]

P2P_PORT, STATUS_PORT = 31337, 9100  # each peer has a namespace of its own: fixed ports never collide
STEPS = 4


def _start(lab: NatLab, ns: str, root: Path, name: str, *, stage: int, host: str, initial: list[str],
           extra: tuple[str, ...] = ()) -> PeerProcess:
    cmd = join_command(root / name, port=STATUS_PORT, run=TINY_RUN, stage=stage, settings=FAST, checkpoints=False,
                       host_maddrs=(f"/ip4/{host}/tcp/{P2P_PORT}",), extra=extra, initial=initial)
    return PeerProcess.spawn(name, cmd, root / name, STATUS_PORT, cwd=REPO,
                             popen=lambda c, **kw: lab.popen(ns, c, **kw),
                             fetch=lambda p: lab.call_in(ns, lambda: fetch_status_http(p), timeout=10.0))


def _swarm(lab: NatLab, root: Path, relay: str) -> list[PeerProcess]:
    """A on the public side, then one peer in each home: stages 1, 0, 1 (B, C, D)."""
    a = _start(lab, lab.pub, root, "a", stage=0, host=lab.pub_ip, initial=[], extra=("--relay-service", "on"))
    first = [m for m in a.wait_maddrs(60) if f"/{lab.pub_ip}/" in m][:1]
    peers = [a]
    for k, (name, stage) in enumerate([("b", 1), ("c", 0), ("d", 1)][:lab.homes]):
        peers.append(_start(lab, lab.home[k], root, name, stage=stage, host=lab.home_ip(k), initial=first,
                            extra=("--relay", relay)))
    return peers


@pytest.mark.timeout(180)
def test_peers_behind_nat_serve_through_the_relay(tmp_path: Path) -> None:
    with NatLab(homes=3) as lab:
        a, b, c, d = _swarm(lab, tmp_path, "auto")
        c.wait_status(lambda s: s["local_step"] >= STEPS, 120, f"{STEPS} steps of C (behind NAT, through the relay)")
        a.wait_status(lambda s: s["local_step"] >= STEPS, 30, f"{STEPS} steps of A (public)")
        d.wait_status(lambda s: s["counters"].get("averaging_rounds_ok", 0) >= 1 and (s["avg_group_size"] or 0) >= 2,
                      60, "an averaging round of D with B (both behind NAT, through the relay)")
        for peer in (b, c, d):
            log = peer.log()
            assert "joining again through a relay" in log, f"{peer.name} did not switch to the relay:\n{log[-3000:]}"
            relayed = [m for m in peer.maddrs if "/p2p-circuit" in m]
            assert relayed and relayed[0].startswith(f"/ip4/{lab.pub_ip}/"), peer.maddrs
        # what the relay costs: the same stage, trained directly (A) and through the relay (C), over one window
        before = {p.name: p.status()["tokens_total"] for p in (a, c)}
        bytes_before, t0 = lab.link_bytes(), time.monotonic()
        time.sleep(15.0)
        after = {p.name: p.status()["tokens_total"] for p in (a, c)}
        bytes_after, dt = lab.link_bytes(), time.monotonic() - t0
        figures = {
            "tokens_per_s": {n: round((after[n] - before[n]) / dt, 1) for n in after},
            "link_bytes_per_s": {ns.rsplit("-", 1)[1]: round((bytes_after[ns] - bytes_before[ns]) / dt)
                                   for ns in bytes_after},
            "window_s": round(dt, 1), "nproc": os.cpu_count(), "loadavg": os.getloadavg(),
        }
        print("NAT relay figures:", json.dumps(figures))
        assert after["c"] > before["c"], "C stopped training through the relay"


@pytest.mark.timeout(150)
def test_without_the_relay_a_peer_behind_nat_cannot_be_reached(tmp_path: Path) -> None:
    with NatLab(homes=2) as lab:
        a, b, c = _swarm(lab, tmp_path, "off")
        # A trains with B over the connection B opened itself; C, which B never dialled, cannot reach B at all
        a.wait_status(lambda s: s["local_step"] >= STEPS, 120, f"{STEPS} steps of A (public)")
        c.wait_status(lambda s: s.get("state") == "training", 60, "C's training state")
        time.sleep(10.0)
        assert c.status()["local_step"] == 0, "C reached B without a relay: the lab does not isolate the homes"
        assert "other peers cannot connect to this peer" in b.log(), b.log()[-3000:]
        assert not [m for m in b.maddrs if "/p2p-circuit" in m]
