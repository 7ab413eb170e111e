"""Sybils against averaging rounds: strangers are refused, announced liars are bounded by the robust aggregate.

Whole rounds among in-process peers over test_netavg_rounds.py's in-memory transport (the real protocol codec, the
real AveragingLoop); the sybils are raw callers that send crafted parts for every round.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from test_netavg_rounds import RUN, SHAPES, FakeWorker, MemTransport, _make_peer, _run_rounds, aio

from peer.averaging.aggregate import robust_combine
from peer.averaging.loop import next_round
from protocol.codecs.registry import encode
from protocol.errors import RemoteError
from protocol.messages import AveragingPart
from trainer.attacks import byzantine_part
from trainer.config import AveragingConfig


def _honest_mean(workers: list[FakeWorker], j: int) -> torch.Tensor:
    return sum(w.values[j] for w in workers) / len(workers)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


async def _sybils(net: MemTransport, parts: dict[str, list[torch.Tensor]], targets: list[str], seconds: float,
                  replies: dict[str, list[str]]) -> None:
    """Each sybil sends its part to every target at the start of every round for ``seconds``; records the replies."""
    end = time.time() + seconds
    while time.time() < end - RUN.averaging.period_s * 0.5:
        r = next_round(time.time(), RUN.averaging.period_s)
        await asyncio.sleep(max(0.0, r * RUN.averaging.period_s - time.time()) + 0.05)

        async def send(sybil: str, target: str, tensors: list[torch.Tensor], r: int) -> None:
            part = AveragingPart(run_id=RUN.run_id, stage=0, round_no=r, sender=sybil,
                                 tensors=[encode(t, "int8") for t in tensors], weight=1e6)
            try:
                await net.for_peer(sybil).call(target, "avg_part", part, timeout=0.5)
                replies.setdefault(sybil, []).append("accepted")
            except RemoteError as e:
                replies.setdefault(sybil, []).append(e.code.name)
            except TimeoutError:
                replies.setdefault(sybil, []).append("timeout")

        await asyncio.gather(*(send(s, t, v, r) for s, v in parts.items() for t in targets))


@pytest.mark.timeout(30)
@aio
async def test_parts_from_ids_outside_the_stage_view_are_refused_and_counted():
    net, names = MemTransport(), ["p0", "p1", "p2"]
    workers = [FakeWorker(i) for i in range(3)]
    peers = [_make_peer(net, n, w, names) for n, w in zip(names, workers, strict=True)]
    zeros = [torch.zeros(s) for s in SHAPES]
    replies: dict[str, list[str]] = {}
    sybils = asyncio.create_task(_sybils(net, {f"s{i}": zeros for i in range(3)}, names, 2.6, replies))
    await _run_rounds([lp for lp, _ in peers], 2.6)
    await sybils
    assert replies and all(set(r) == {"UNAUTHORIZED"} for r in replies.values()), replies
    for _, metrics in peers:
        assert metrics.snapshot()["counters"].get("rejected:avg_not_member", 0) >= 3
    assert all(w.finished for w in workers)
    for w in workers:
        for mean in w.finished.values():
            for j in range(len(SHAPES)):
                assert _rel(mean[j], _honest_mean(workers, j)) < 0.1  # the median of 3 honest parts


@pytest.mark.timeout(30)
@aio
async def test_announced_sybils_sending_zeros_scaled_and_flipped_parts_barely_move_the_honest_result():
    net, honest = MemTransport(), ["p0", "p1", "p2", "p3", "p4"]
    sybil_names = ["s-zeros", "s-scale", "s-flip"]
    workers = [FakeWorker(i) for i in range(len(honest))]
    # the sybils announced DHT records of the stage: they are in every honest peer's view
    peers = [_make_peer(net, n, w, honest + sybil_names) for n, w in zip(honest, workers, strict=True)]
    own = FakeWorker(99).values
    parts = {"s-zeros": [byzantine_part("zeros", v) for v in own],
             "s-scale": [byzantine_part("scale", v) for v in own],
             "s-flip": [byzantine_part("signflip", v) for v in own]}
    replies: dict[str, list[str]] = {}
    sybils = asyncio.create_task(_sybils(net, parts, honest, 5.2, replies))
    await _run_rounds([lp for lp, _ in peers], 5.2)
    await sybils
    # x-10 and sign flip are refused on arrival (too far from the receiver's values); zeros pass that check ...
    # (a part that arrives before a peer opened the round is answered NOT_READY: a race, not an acceptance)
    for name in ("s-scale", "s-flip"):
        assert "BAD_REQUEST" in replies[name] and set(replies[name]) <= {"BAD_REQUEST", "NOT_READY"}, replies[name]
    assert "accepted" in replies["s-zeros"]
    for _, metrics in peers:
        counters = metrics.snapshot()["counters"]
        assert counters.get("rejected:avg_too_far", 0) >= 2
        assert counters.get("rejected:avg_outlier", 0) >= 1  # ... and are dropped as far from the robust centre
    assert all(w.finished for w in workers)
    for w in workers:
        for mean in w.finished.values():
            for j in range(len(SHAPES)):
                assert _rel(mean[j], _honest_mean(workers, j)) < 0.1


def _contributions(n_honest: int, attack: str, n_bad: int) -> tuple[dict[str, list[torch.Tensor]], list[FakeWorker]]:
    workers = [FakeWorker(i) for i in range(n_honest)]
    parts = {f"h{i}": w.values for i, w in enumerate(workers)}
    g = torch.Generator().manual_seed(5)
    for k in range(n_bad):
        honest = [torch.stack([w.values[j] for w in workers]) for j in range(len(SHAPES))]
        parts[f"z{k}"] = [byzantine_part(attack, workers[k].values[j], honest[j], generator=g)
                          for j in range(len(SHAPES))]
    return parts, workers


@pytest.mark.parametrize("attack", ["zeros", "scale", "signflip", "noise", "alie"])
@pytest.mark.parametrize("aggregator", ["trimmed", "centered_clip"])
def test_robust_combine_bounds_one_in_four_and_two_in_eight(attack: str, aggregator: str):
    cfg = AveragingConfig(aggregator=aggregator)
    for n_honest, n_bad in ((3, 1), (6, 2)):
        parts, workers = _contributions(n_honest, attack, n_bad)
        others = {k: v for k, v in parts.items() if k != "h0"}
        values, dropped, _ = robust_combine("h0", parts["h0"], others, cfg, outlier_factor=4.0, outlier_rms=0.01)
        assert not any(d.startswith("h") for d in dropped)
        if attack in ("zeros", "scale", "signflip"):
            assert sorted(dropped) == [f"z{k}" for k in range(n_bad)]
        for j in range(len(SHAPES)):
            assert _rel(values[j], _honest_mean(workers, j)) < 0.15, (attack, n_honest, n_bad, j)
        plain, _, _ = robust_combine("h0", parts["h0"], others, AveragingConfig(aggregator="mean"),
                                     outlier_factor=1e9, outlier_rms=1e9)
        if attack in ("scale", "signflip", "zeros"):
            assert _rel(plain[0], _honest_mean(workers, 0)) > 0.2  # what the unprotected mean would have done


@pytest.mark.parametrize("attack", ["zeros", "scale", "signflip", "noise"])
def test_a_lone_partner_is_clipped_to_a_twentieth_of_our_norm(attack: str):
    """A round where only one of the partners asked sent its part cannot tell a liar apart: its pull is bounded.
    Without the bound a zero part halves our values."""
    cfg = AveragingConfig(aggregator="trimmed")
    parts, _ = _contributions(3, attack, 1)
    own = parts["h0"]
    values, _, clipped = robust_combine("h0", own, {"z0": parts["z0"]}, cfg, outlier_factor=4.0, outlier_rms=0.01,
                                        lone_bound=0.05, asked=3)
    assert clipped
    for j in range(len(SHAPES)):
        limit = 0.05 * float(own[j].norm()) + 1e-3 * own[j].numel() ** 0.5
        assert float((values[j] - own[j]).norm()) <= limit / 2 + 1e-5
    unbounded, _, _ = robust_combine("h0", own, {"z0": parts["z0"]}, cfg, outlier_factor=4.0, outlier_rms=0.01)
    assert float((unbounded[0] - own[0]).norm()) > 0.05 * float(own[0].norm())
    # a pair by design (a stage of two, a WAGMA pair: one partner asked) is averaged as it is
    _, _, clipped = robust_combine("h0", own, {"z0": parts["z0"]}, cfg, outlier_factor=4.0, outlier_rms=0.01,
                                   lone_bound=0.05, asked=1)
    assert not clipped
    # the plain mean claims no robustness and is left alone
    _, _, clipped = robust_combine("h0", own, {"z0": parts["z0"]}, AveragingConfig(aggregator="mean"),
                                   outlier_factor=4.0, outlier_rms=0.01, lone_bound=0.05, asked=3)
    assert not clipped
    # an honest partner closer than the bound is averaged as it is
    near = [o + 0.01 * o.norm() / o.numel() ** 0.5 * torch.randn(o.shape, generator=torch.Generator().manual_seed(1))
            for o in own]
    pair, _, clipped = robust_combine("h0", own, {"h1": near}, cfg, outlier_factor=4.0, outlier_rms=0.01,
                                      lone_bound=0.05, asked=3)
    assert not clipped and all(torch.allclose(pair[j], (own[j] + near[j]) / 2) for j in range(len(SHAPES)))


@pytest.mark.parametrize("aggregator", ["trimmed", "centered_clip"])
def test_a_round_that_only_the_liars_reached_moves_us_a_fortieth_of_our_norm_at_most(aggregator: str):
    """An 8-replica stage (7 partners asked) with 2 replicas sending zeros: a round of 3 (us and both liars, the
    honest ones late) is past the breakdown point; its pull is bounded. A round of 5, the stage's quorum, is not."""
    cfg = AveragingConfig(aggregator=aggregator)
    parts, workers = _contributions(6, "zeros", 2)
    own = parts["h0"]
    liars = {k: parts[k] for k in ("z0", "z1")}
    free, _, _ = robust_combine("h0", own, liars, cfg, outlier_factor=4.0, outlier_rms=0.01)
    assert float((free[0] - own[0]).norm()) > 0.5 * float(own[0].norm())  # unbounded: our slice goes to zero
    values, _, clipped = robust_combine("h0", own, liars, cfg, outlier_factor=4.0, outlier_rms=0.01,
                                        lone_bound=0.05, asked=7)
    assert clipped
    for j in range(len(SHAPES)):
        limit = 0.05 * float(own[j].norm()) + 1e-3 * own[j].numel() ** 0.5
        assert float((values[j] - own[j]).norm()) <= limit / 2 + 1e-5
    # the stage's quorum (5 of 8): the aggregate as it is, the liars dropped as outliers
    full = {k: parts[k] for k in ("h1", "h2", "z0", "z1")}
    values, dropped, clipped = robust_combine("h0", own, full, cfg, outlier_factor=4.0, outlier_rms=0.01,
                                              lone_bound=0.05, asked=7)
    assert not clipped and dropped == ["z0", "z1"]
    # an honest round of 3 among 8 is averaged as it is: honest replicas are closer than the bound
    near = {f"h{i}": [o + 0.01 * o.norm() / o.numel() ** 0.5 * torch.randn(o.shape, generator=torch.Generator()
                                                                           .manual_seed(i)) for o in own]
            for i in (1, 2)}
    _, _, clipped = robust_combine("h0", own, near, cfg, outlier_factor=4.0, outlier_rms=0.01, lone_bound=0.05,
                                   asked=7)
    assert not clipped


@pytest.mark.timeout(30)
@aio
async def test_a_lone_partner_is_refused_while_another_replica_answered_recently():
    net, names = MemTransport(), ["p0", "p1", "x"]
    workers = [FakeWorker(i, drift=0.02) for i in range(3)]
    peers = [_make_peer(net, n, w, names, attack="zeros" if n == "x" else "")
             for n, w in zip(names, workers, strict=True)]
    for loop, _ in peers:
        await loop.start()
    try:
        await asyncio.sleep(2.6)  # rounds of three: the zero part is dropped
        assert all(w.finished for w in workers[:2])
        net.down.add("p1")  # now p0 hears only from the attacker
        await asyncio.sleep(1.0)  # a round already under way may still finish with p1's part
        before = dict(workers[0].finished)
        await asyncio.sleep(2.6)
    finally:
        for loop, _ in peers:
            await loop.stop()
    counters = peers[0][1].snapshot()["counters"]
    assert counters.get("avg_below_quorum", 0) >= 1, counters
    assert set(workers[0].finished) == set(before), "no round with the lone attacker may be applied"


@pytest.mark.timeout(30)
@aio
async def test_the_red_team_knob_makes_a_real_loop_send_attacked_parts_that_the_honest_peers_drop():
    net, names = MemTransport(), ["p0", "p1", "p2", "x"]
    workers = [FakeWorker(i) for i in range(4)]
    # tools/byzantine_peer.py hands the same Attacker to the daemon (Daemon(averaging_behaviour=...))
    peers = [_make_peer(net, n, w, names, attack="zeros" if n == "x" else "")
             for n, w in zip(names, workers, strict=True)]
    await _run_rounds([lp for lp, _ in peers], 2.6)
    honest = workers[:3]
    assert all(w.finished for w in honest)
    for _, metrics in peers[:3]:
        assert metrics.snapshot()["counters"].get("rejected:avg_outlier", 0) >= 1
    for w in honest:
        for mean in w.finished.values():
            for j in range(len(SHAPES)):
                assert _rel(mean[j], _honest_mean(honest, j)) < 0.1


@pytest.mark.timeout(30)
@aio
async def test_a_rushing_alie_peer_sends_mean_minus_std_of_what_it_read_before_sending():
    """'alie' on a real loop holds its part back, reads the honest parts sent to it first, and sends their mean
    minus one standard deviation (its own values included); the honest peers accept it and stay near their mean."""
    net, names = MemTransport(), ["p0", "p1", "p2", "x"]
    workers = [FakeWorker(i) for i in range(4)]
    peers = [_make_peer(net, n, w, names, attack="alie" if n == "x" else "")
             for n, w in zip(names, workers, strict=True)]
    sent: list[list[torch.Tensor]] = []
    publish = peers[3][0].exchange.publish

    async def spy(slot, values):
        sent.append(values)
        await publish(slot, values)

    peers[3][0].exchange.publish = spy
    await _run_rounds([lp for lp, _ in peers], 2.6)
    assert sent
    for values in sent:
        for j in range(len(SHAPES)):
            stack = torch.stack([w.values[j] for w in workers])  # the attacker's own values and the 3 honest parts
            want = stack.mean(0) - stack.std(0, unbiased=False)
            assert _rel(values[j], want) < 0.05, j  # int8 noise of the parts it read
    assert peers[3][1].count("byzantine_parts") == len(sent)
    assert peers[3][1].count("byzantine_parts_read") >= 2 * len(sent)  # what it saw of the 3 honest parts
    honest = workers[:3]
    assert all(w.finished for w in honest)
    for _, metrics in peers[:3]:
        assert metrics.snapshot()["counters"].get("rejected:avg_too_far", 0) == 0
    for w in honest:
        for mean in w.finished.values():
            for j in range(len(SHAPES)):
                assert _rel(mean[j], _honest_mean(honest, j)) < 0.1


def test_a_round_needs_two_b_plus_one_contributions_b_the_liars_the_stage_tolerates():
    net = MemTransport()
    loop, _ = _make_peer(net, "p0", FakeWorker(0), ["p0"])
    assert [loop.quorum(asked) for asked in (1, 2, 3, 4, 7, 8, 11)] == [1, 3, 3, 5, 5, 7, 7]
    plain, _ = _make_peer(net, "p1", FakeWorker(1), ["p1"], run=RUN.replace(averaging={"aggregator": "mean"}))
    assert plain.quorum(7) == 2


def test_a_replica_whose_own_slice_is_the_outlier_of_a_quorum_round_takes_the_others_aggregate():
    """A replica that loaded a lying donor's state (here: its values x -10) refuses nothing the honest replicas send
    but would mix its wrecked values into every mean; judged by a round that reached its quorum, its own slice is
    the outlier and the others' aggregate replaces it. Without a quorum, or judged by a minority, it keeps its own."""
    cfg = AveragingConfig(aggregator="trimmed")
    parts, workers = _contributions(5, "zeros", 0)
    wrecked = [-10 * v for v in parts["h0"]]
    others = {k: v for k, v in parts.items() if k != "h0"}
    values, dropped, _ = robust_combine("h0", wrecked, others, cfg, outlier_factor=4.0, outlier_rms=0.01, quorum=5)
    assert dropped == ["h0"]
    for j in range(len(SHAPES)):
        centre = torch.stack([others[k][j] for k in sorted(others)])
        assert torch.allclose(values[j], centre.mean(0))  # the 4 honest others: their mean, as they are
    for kw in ({}, {"quorum": 7}):  # no quorum given (the sync barrier), or a round below its quorum
        _, dropped, _ = robust_combine("h0", wrecked, others, cfg, outlier_factor=4.0, outlier_rms=0.01, **kw)
        assert "h0" not in dropped
    # an honest replica in a round with one liar keeps its own slice
    parts, _ = _contributions(4, "zeros", 1)
    _, dropped, _ = robust_combine("h0", parts["h0"], {k: v for k, v in parts.items() if k != "h0"}, cfg,
                                   outlier_factor=4.0, outlier_rms=0.01, quorum=5)
    assert dropped == ["z0"]


@pytest.mark.timeout(30)
@aio
async def test_an_announced_replica_that_never_answers_does_not_stop_the_others_averaging():
    """Only partners heard from recently set the quorum: a silent sybil in the view leaves the honest pair a
    quorum of two (their mean), where counting it would ask for three and refuse every round."""
    net, names = MemTransport(), ["p0", "p1", "silent"]
    workers = [FakeWorker(i) for i in range(2)]  # ~14 % apart: a pull of half of it is past a minority round's 2.5 %
    peers = [_make_peer(net, n, w, names) for n, w in zip(names[:2], workers, strict=True)]
    net.down.add("silent")
    await _run_rounds([lp for lp, _ in peers], 2.6)
    assert workers[0].finished and workers[1].finished
    for _, metrics in peers:
        assert metrics.snapshot()["counters"].get("avg_below_quorum", 0) == 0


@pytest.mark.timeout(30)
@aio
async def test_phantom_records_do_not_make_an_honest_pair_a_clipped_minority_round():
    """phantom_quorum: two honest replicas and two announced records that never answer. Before, the full quorum
    counted the 3 partners asked, so every round of the two (2 contributions) was clipped as a minority round."""
    net, names = MemTransport(), ["p0", "p1", "ghost0", "ghost1"]
    net.down.update({"ghost0", "ghost1"})
    workers = [FakeWorker(i) for i in range(2)]  # ~14 % apart: a pull of half of it is past a minority round's 2.5 %
    peers = [_make_peer(net, n, w, names) for n, w in zip(names[:2], workers, strict=True)]
    await _run_rounds([lp for lp, _ in peers], 3.2)
    assert all(w.finished for w in workers)
    for _, metrics in peers:
        assert metrics.snapshot()["counters"].get("avg_pull_clipped", 0) == 0


@pytest.mark.timeout(30)
@aio
async def test_parts_the_aggregate_kept_make_their_senders_known_and_dropped_ones_do_not():
    """Trust is earned: a part kept by the robust aggregate vouches for its sender; a zero part dropped as an outlier
    does not (before, any reply to our call made its sender known)."""
    net, names = MemTransport(), ["p0", "p1", "p2", "x"]
    workers = [FakeWorker(i) for i in range(4)]
    peers = [_make_peer(net, n, w, names, attack="zeros" if n == "x" else "")
             for n, w in zip(names, workers, strict=True)]
    vouched: list[str] = []
    peers[0][0].vouch = vouched.append
    await _run_rounds([lp for lp, _ in peers], 2.6)
    assert workers[0].finished
    assert {"p1", "p2"} <= set(vouched) and "x" not in vouched


@pytest.mark.timeout(30)
@aio
async def test_a_young_loop_counts_every_announced_partner_so_liars_who_answer_first_are_no_quorum():
    """8 announced replicas, of which only two liars sending zeros answer yet: counting only the partners heard, a
    round of us and the two passes a quorum of 3 and its aggregate (their median) is zero. While the loop is young
    every announced partner counts (5 of 8 needed), so those rounds are refused."""
    import dataclasses

    from test_netavg_rounds import FAST

    names = ["p0", "x0", "x1", "h1", "h2", "h3", "h4", "h5"]
    for startup, refused in ((60.0, True), (0.0, False)):
        net = MemTransport()
        net.down.update({"h1", "h2", "h3", "h4", "h5"})  # honest, not heard yet
        workers = [FakeWorker(i, drift=0.02) for i in range(3)]
        config = dataclasses.replace(FAST, quorum_startup_s=startup)
        peers = [_make_peer(net, n, w, names, config=config, attack="zeros" if n.startswith("x") else "")
                 for n, w in zip(names[:3], workers, strict=True)]
        await _run_rounds([lp for lp, _ in peers], 2.6)
        counters = peers[0][1].snapshot()["counters"]
        if refused:
            assert not workers[0].finished and counters.get("avg_below_quorum", 0) >= 1, counters
        else:  # the hole the start-up rule closes: the liars' rounds are applied, and they zero our slice
            assert workers[0].finished, counters
            own = float(workers[0].values[0].norm())
            assert min(float(m[0].norm()) for m in workers[0].finished.values()) < 0.1 * own
