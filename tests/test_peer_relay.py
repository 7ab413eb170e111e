"""The relay settings of peer.membership.relay: which p2pd flags each mode gives, and when a peer rejoins through a
relay (the namespace test that exercises them end to end is tests/test_nat_relay.py, ``-m wan``)."""

from __future__ import annotations

import pytest

from peer.config import PeerConfig
from peer.membership.relay import STATIC_RELAYS, needs_relay_restart, p2p_relay_kwargs, relay_targets

RELAY = "/ip4/11.77.0.1/tcp/31337/p2p/12D3KooWExample"


def test_modes_give_the_p2pd_flags() -> None:
    relayed = p2p_relay_kwargs(through_relay=True, relay_service="auto", relays=[RELAY])
    assert relayed == dict(use_relay=True, use_auto_relay=True, force_reachability=STATIC_RELAYS,
                           trusted_relays=[RELAY])
    from hivemind.p2p import P2P  # our mode is registered, with the flag hivemind does not pass

    assert P2P.FORCE_REACHABILITY_MAPPING[STATIC_RELAYS] == {"forceReachabilityPrivate": 1, "relayDiscovery": 0}
    assert P2P._make_process_args("p2pd", **P2P.FORCE_REACHABILITY_MAPPING[STATIC_RELAYS])[1:] == [
        "-forceReachabilityPrivate=1", "-relayDiscovery=0"]
    for service, force in (("auto", None), ("on", "public"), ("off", "private")):
        kw = p2p_relay_kwargs(through_relay=False, relay_service=service, relays=[RELAY])
        assert kw == dict(use_relay=True, use_auto_relay=False, force_reachability=force)
    with pytest.raises(ValueError, match="needs a relay"):
        p2p_relay_kwargs(through_relay=True, relay_service="auto", relays=[])


def test_relays_default_to_the_initial_peers_and_auto_rejoins_only_when_unreachable() -> None:
    assert relay_targets([], [RELAY, "/ip4/1.2.3.4/tcp/5"]) == [RELAY]  # only full multiaddrs name a relay
    assert relay_targets([RELAY], []) == [RELAY]
    assert needs_relay_restart("auto", False, through_relay=False)
    assert not needs_relay_restart("auto", True, through_relay=False)
    assert not needs_relay_restart("auto", None, through_relay=False)  # could not be checked: stay direct
    assert not needs_relay_restart("auto", False, through_relay=True)
    assert not needs_relay_restart("off", False, through_relay=False)


def test_config_validates_the_modes() -> None:
    assert PeerConfig().relay == "auto" and PeerConfig().relay_service == "auto"
    with pytest.raises(ValueError, match="--relay must be"):
        PeerConfig(relay="sometimes")
    with pytest.raises(ValueError, match="contradict"):
        PeerConfig(relay="on", relay_service="on")
