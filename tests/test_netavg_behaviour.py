"""Attack code stays out of the product: Byzantine behaviours are injected through peer/averaging/behaviour.py by
tools/ and tests, never selected by a peer's configuration nor patched into the exchange."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

from peer.averaging.behaviour import HONEST
from peer.config import PeerConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tools.byzantine_peer import Attacker  # noqa: E402


def test_the_product_holds_no_attack_code():
    for path in (ROOT / "peer").rglob("*.py"):
        text = path.read_text()
        for needle in ("trainer.attacks", "byzantine_part(", "byzantine_attack"):
            assert needle not in text, f"{path.relative_to(ROOT)} mentions {needle}"
    assert "byzantine_attack" not in {f.name for f in dataclasses.fields(PeerConfig)}


def test_behaviours_through_the_seam():
    def honest_check(received, own):
        return "far" if received[0].abs().sum() > 10 else None

    assert HONEST.check(honest_check) is honest_check and not HONEST.keeps_offers
    zeros = Attacker("zeros")
    assert zeros.check(honest_check)([torch.full((3,), 100.0)], [torch.zeros(3)]) is None  # it takes everything
    assert not zeros.keeps_offers and Attacker("alie").keeps_offers
