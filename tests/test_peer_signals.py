"""SIGTERM is honoured in every start-up phase of ``join``: while the DHT join is retried and while the stage's state
is being loaded from a donor that does not answer. The peer exits within 5 s either way (multi-process)."""

from __future__ import annotations

import signal
import time

import pytest
from swarm_utils import swarm  # noqa: F401  (fixture)

from peer.ops.procs import free_port

# a well-formed peer id nobody runs, on a port nobody listens on: the join fails and is retried with backoff
NOBODY = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def _stops_within(peer, seconds: float) -> float:
    t0 = time.monotonic()
    peer.signal(signal.SIGTERM)
    peer.wait_exit(seconds + 10)
    took = time.monotonic() - t0
    assert took < seconds, f"{peer.name} took {took:.1f} s to stop:\n{peer.log()[-2000:]}"
    return took


@pytest.mark.timeout(120)
def test_sigterm_during_dht_join_retries_stops_at_once(swarm):  # noqa: F811
    p = swarm.start("p", stage="0", initial=[NOBODY])
    p.wait_for(lambda: "joining the DHT failed" in p.log(), 60, "a failed DHT join")
    time.sleep(0.5)  # inside the backoff (or the next attempt)
    _stops_within(p, 5.0)
    assert p.proc.returncode == 0
    assert "Traceback" not in p.log()


@pytest.mark.timeout(240)
def test_sigterm_while_loading_state_from_a_silent_donor_stops_at_once(swarm):  # noqa: F811
    a = swarm.start("a", stage="0")
    first = a.wait_maddrs()[:1]
    b = swarm.start("b", stage="1", initial=first, extra=("record_ttl_s=60",))
    a.wait_status(lambda s: s["local_step"] >= 3, 120, "3 steps")
    b.signal(signal.SIGSTOP)  # the donor stops answering, its record stays
    try:
        c = swarm.start("c", stage="1", initial=first, extra=("state_load_timeout_s=120",))
        c.wait_for(lambda: "state sources" in c.log(), 90, "the state load")
        time.sleep(1.0)  # waiting on the silent donor's first chunk
        _stops_within(c, 5.0)
        assert c.proc.returncode == 0
        assert "Traceback" not in c.log()
        assert not (c.dir / "ckpt" / "stage-1.pt").exists()  # an unloaded worker is never checkpointed
    finally:
        b.signal(signal.SIGCONT)
