"""Re-checks from the held copy (peer/pipeline/recheck.py): the copy's gradient against the last stage's own, the
bookkeeping they share with the spot checks, and in process: an honest lone next stage passes with a stale copy, a
lone fabricating one and two colluding ones are banned with none of their gradients trained on."""

from __future__ import annotations

import asyncio
import functools
import random
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from peer.config import PeerConfig
from peer.membership.records import PeerRecord
from peer.membership.routing import Router
from peer.ops.metrics import PeerMetrics
from peer.pipeline.boundary import Boundary
from peer.pipeline.recheck import HeldCopy, RecheckConfig, Rechecks, as_sent, input_gradient, judgeable
from peer.pipeline.servicer import PipelineServicer
from peer.pipeline.spotcheck import SpotCheckConfig, SpotChecker, agreement, distance
from peer.pipeline.work import BackwardWork
from peer.state.spare import SpareStore
from protocol.codecs.registry import encode
from protocol.messages import Ack, Backward
from tests.test_peer_pipeline import RUN, Net, _run_driver, build, corpus  # noqa: F401  (fixture)
from tests.test_peer_spotcheck import Fabricator
from trainer.data import BatchStream
from trainer.worker import StageWorker


def _held(worker: StageWorker) -> SpareStore:
    spares = SpareStore(RUN, None)
    assert spares.offer(1, worker.state_dict(), source="b1", taken_at=time.time())
    return spares


def test_the_copy_recomputes_the_last_stages_gradient(corpus):  # noqa: F811
    torch.manual_seed(0)
    w0, w1 = StageWorker(RUN, 0), StageWorker(RUN, 1)
    copy = HeldCopy(RUN, 1, _held(w1))
    stream = BatchStream(corpus.train, 32, 8, seed=1)
    x, y = stream.next()
    act = w0.forward(0, x)
    module = copy.module()
    assert module is not None and copy.nbytes() == sum(p.numel() * 4 for p in w1.model.parameters())
    ref = input_gradient(module, act, y)
    _, grad = w1.forward_loss(0, act, y)  # the live stage, which then steps
    assert grad is not None and distance(ref, grad) < 1e-5
    rows = torch.tensor([5, 2])  # rows are independent: two of them, scaled to the mean over all, are exact
    assert distance(input_gradient(module, act[rows], y[rows]) * 2 / 8, grad[rows]) < 1e-5
    for p in module.parameters():
        assert p.grad is None and not p.requires_grad  # the copy computes no weight gradients and never trains
    for step in range(1, 20):  # the live stage moves on; the copy stays where it was taken
        x, y = stream.next()
        w0.drop(step - 1)
        w1.forward_loss(step, w0.forward(step, x), y)
    x, y = stream.next()
    act = w0.forward(99, x)
    _, live = w1.forward_loss(99, act, y)
    stale = input_gradient(module, act, y)
    cfg = RecheckConfig()
    cos, ratio = agreement(live, stale)
    assert cos >= cfg.min_cosine and ratio <= cfg.max_norm_ratio and distance(live, stale) > 1e-3  # stale, passes
    assert agreement(-live, stale)[0] < cfg.min_cosine and agreement(torch.randn_like(live), stale)[0] < cfg.min_cosine
    assert copy.module() is module  # built once per copy
    copy.spares.offer(1, w1.state_dict(), source="b1", taken_at=time.time())
    assert copy.module() is not module  # a newer copy replaces it


def test_a_copy_received_before_our_step_reached_the_minimum_is_not_used():
    """Early in training an honest gradient can disagree with a copy a few dozen steps old: a copy first seen while
    our own step was below min_step serves no re-check (nor blocks spot checks); the next copy, seen later, does."""
    step = [3]
    spares = SpareStore(RUN, None)
    copy = HeldCopy(RUN, 1, spares, local_step=lambda: step[0], min_step=40)
    assert not copy.available() and copy.module() is None  # nothing held
    w1 = StageWorker(RUN, 1)
    w1.local_step = 50
    assert spares.offer(1, w1.state_dict(), source="b1", taken_at=time.time())
    assert not copy.available() and copy.module() is None  # held, but received at our step 3
    step[0] = 100
    assert not copy.available()  # still the same copy: our step when it came is what counts
    assert spares.offer(1, w1.state_dict(), source="b1", taken_at=time.time() + 1)
    assert not copy.available()  # the same state taken again (one snapshot served for a while): still seen at 3
    w1.local_step = 60
    assert spares.offer(1, w1.state_dict(), source="b1", taken_at=time.time() + 2)
    assert copy.available() and copy.module() is not None  # a newer state, received at step 100
    w0 = StageWorker(RUN, 1)  # a young state received late (a stale snapshot): of a step below the minimum
    fresh = SpareStore(RUN, None)
    late = HeldCopy(RUN, 1, fresh, local_step=lambda: step[0], min_step=40)
    assert fresh.offer(1, w0.state_dict(), source="b1", taken_at=time.time()) and not late.available()


@pytest.mark.parametrize("compression", [{}, {"activations": "subspace", "gradients": "subspace", "subspace_rank": 4}],
                         ids=["int8", "subspace"])
def test_the_copys_gradient_is_compared_as_the_wire_delivers_it(compression):
    run = RUN.replace(compression=compression) if compression else RUN
    boundary = Boundary(run, None)
    g = torch.randn(8, 32, run.model.n_embd)
    wire = boundary.decode_gradient(boundary.encode_gradient(g), "b1")
    cos, ratio = agreement(as_sent(boundary, g), wire)
    assert cos > 0.999 and abs(ratio - 1) < 0.01
    if compression:  # projected: far from the full gradient, which a returned one can never be
        assert agreement(g, wire)[0] < 0.5


def test_recheck_bookkeeping_is_the_spot_checks():
    counts: list[str] = []
    spot = SpotChecker(SpotCheckConfig(trust_after=2, ban_after=2), count=counts.append, rng=random.Random(0))
    assert spot.wants_recheck("h", fraction=0.0) and not spot.recheck_trusted("h")
    assert not spot.recheck_verdict("h", True, copy=40) and not spot.recheck_verdict("h", True, copy=40)
    assert spot.recheck_trusted("h") and spot.trusted("h")  # a passed re-check counts as a passed check
    assert not spot.wants_recheck("h", fraction=0.0) and spot.wants_recheck("h", fraction=0.0, learning=True)
    assert not spot.wants_recheck("h", fraction=1.0, busy=True)  # a sample is skipped while the queue is busy
    assert not spot.recheck_verdict("h", False, copy=40)  # one failure costs its trust, bans nobody
    assert not spot.trusted("h") and not spot.recheck_trusted("h") and spot.wants_recheck("h", fraction=0.0)
    g = torch.ones(4)
    spot.judge("h", g, "colluder", g)  # a passed spot check with a colluder does not wash the strike away
    assert spot.recheck_verdict("h", False, copy=None)  # second failed re-check in a row, proven: banned
    assert counts.count("recheck_failed") == 2 and counts.count("recheck_passed") == 2


def test_failed_rechecks_against_one_copy_ban_only_once_a_stale_copy_cannot_explain_them():
    """An honest stage in a loss spike fails re-checks against a copy a few steps old (docs/security.md): the
    failures that ban must span two copies, or include one proven without a copy, or last ``one_copy_ban_s``."""
    now = [0.0]
    spot = SpotChecker(SpotCheckConfig(ban_after=3, one_copy_ban_s=30.0), clock=lambda: now[0])
    for _ in range(10):  # the same copy, over and over: not banned, and a fresher copy is worth taking
        now[0] += 1.0
        assert not spot.recheck_verdict("spike", False, copy=68) and spot.one_copy_only("spike")
    assert spot.recheck_verdict("spike", False, copy=80)  # a fresher copy disagrees too: banned
    # the honest case: a fresher copy agrees, which ends the streak (and the fresher copy's count starts afresh)
    for _ in range(5):
        assert not spot.recheck_verdict("honest", False, copy=68)
    assert not spot.recheck_verdict("honest", True, copy=80) and not spot.one_copy_only("honest")
    assert not spot.recheck_verdict("honest", False, copy=80) and not spot.recheck_verdict("honest", False, copy=80)
    # a streak against one copy that lasts one_copy_ban_s (nobody can give a fresher copy of a lone hop): banned
    start = now[0]
    assert not spot.recheck_verdict("lone", False, copy=68)
    now[0] = start + 29.0
    assert not spot.recheck_verdict("lone", False, copy=68) and not spot.recheck_verdict("lone", False, copy=68)
    now[0] = start + 30.0
    assert spot.recheck_verdict("lone", False, copy=68)
    # a failure proven without a copy (a signed lie, silent witnesses) makes the streak conclusive
    assert not spot.recheck_verdict("liar", False, copy=68) and not spot.recheck_verdict("liar", False, copy=None)
    assert not spot.one_copy_only("liar") and spot.recheck_verdict("liar", False, copy=68)
    with pytest.raises(ValueError):
        SpotCheckConfig(one_copy_ban_s=-1.0)


def test_an_answer_of_nothing_is_proven_wrong_whatever_the_copy():
    """A zero or non-finite answer (a hop that added nothing) fails with norm ratio inf: no staleness of the copy
    explains it, so it counts as proven (3 in a row ban with one copy, no fresher copy asked for); a copy whose own
    result is zero or not finite judges nothing."""
    wanted: list[int] = []
    ns = SimpleNamespace(spot=SpotChecker(SpotCheckConfig(ban_after=3)), config=RecheckConfig(),
                         copy=SimpleNamespace(want_fresh=lambda: wanted.append(1)))
    ns.passes = functools.partial(Rechecks.passes, ns)
    nothing = agreement(torch.zeros(4), torch.ones(4))
    assert nothing == (-1.0, float("inf"))
    assert Rechecks.record(ns, "lazy", nothing, 68) == (False, False)
    assert Rechecks.record(ns, "lazy", nothing, 68) == (False, False)
    assert Rechecks.record(ns, "lazy", nothing, 68) == (False, True) and wanted == []
    assert Rechecks.record(ns, "stale", (0.05, 2.0), 68) == (False, False) and wanted == [1]  # a fresher copy, please
    assert judgeable(torch.ones(3)) and not judgeable(torch.zeros(3)) and not judgeable(torch.tensor([float("nan")]))
    with pytest.raises(ValueError):
        RecheckConfig(fraction=1.5)
    with pytest.raises(ValueError):
        PeerConfig(recheck_min_cosine=1.0)


def test_two_disagreeing_answers_the_copy_finds_both_right_are_dropped_and_credit_nobody():
    """A spot check's answers disagree and the held copy passes each (at a middle stage, each by its own hop's
    witnesses: a hop whose colluding witness vouches for its fabrication passes too): the micro-batch is dropped and
    neither hop earns a passed check, so the liar earns no trust from it; neither is blamed. With one answer right,
    that one is trained on, credited and vouched for, the other struck."""
    spot = SpotChecker(SpotCheckConfig(trust_after=2, ban_after=3))
    requeued: list[BackwardWork] = []
    vouched: list[str] = []
    metrics = PeerMetrics("a0", 0)
    copy = SimpleNamespace(want_fresh=lambda: None, nbytes=lambda: 0)
    ns = SimpleNamespace(spot=spot, config=RecheckConfig(), copy=copy, held=lambda mb_id, p: True, judged=0,
                         metrics=metrics, requeue=requeued.append, vouch=vouched.append, seen=[], compute_s=0.0,
                         revoke=lambda peer: None, stage=0, router=None)
    for name in ("passes", "record", "snapshot", "_banned"):
        setattr(ns, name, functools.partial(getattr(Rechecks, name), ns))
    p = SimpleNamespace(trained_from=None)
    g = torch.ones(4)
    answers = {peer: (Backward(run_id=RUN.run_id, mb_id=7, route=[], gradient=encode(sign * g, "none"), loss=1.0,
                               is_eval=False), sign * g) for peer, sign in (("liar", -1.0), ("honest", 1.0))}
    right = ((0.9, 1.0), "", 68)
    Rechecks.decide(ns, p, answers, {"liar": right, "honest": right})  # type: ignore[arg-type]
    assert [w.grad for w in requeued] == [None] and vouched == [] and p.trained_from is None  # dropped
    assert spot._hop("liar").passed == 0 and spot._hop("honest").passed == 0  # nobody credited
    assert spot._hop("liar").re_strikes == 0 and spot._hop("honest").re_strikes == 0  # nobody blamed
    assert metrics.snapshot()["counters"]["spotcheck_unresolved"] == 1
    requeued.clear()
    Rechecks.decide(ns, p, answers, {"liar": ((-1.0, 1.0), "", 68), "honest": right})  # type: ignore[arg-type]
    assert len(requeued) == 1 and requeued[0].grad is answers["honest"][1] and vouched == ["honest"]
    assert spot._hop("honest").passed == 1 and spot._hop("liar").re_strikes == 1


def _with_copy(net: Net, cfg: PeerConfig, spares: SpareStore | None) -> PipelineServicer:
    """Stage 0 ("a0") rebuilt with the held copy of stage 1 (build() makes it without)."""
    old = net.stages["a0"]
    a0 = PipelineServicer(run=RUN, stage=0, worker=old.worker, compute=old.compute, send=old.send, swarm=old.swarm,
                          router=Router([1.0, 1.0], rng=random.Random(1)), metrics=PeerMetrics("a0", 0), cfg=cfg,
                          my_id="a0", cost=1.0, spares=spares, notary=old.notary)
    net.stages["a0"] = a0
    return a0


class Colluder(Fabricator):
    """A fake stage-1 replica of a ring of them: the first to get a micro-batch fabricates its gradient (the negated
    honest one), the others return the very same, so their spot checks of each other agree."""

    def __init__(self, net: Net, me: str, shared: dict[int, tuple[float, torch.Tensor]]) -> None:
        super().__init__(net, me)
        self.shared = shared

    async def rpc_forward(self, msg, peer_id):
        if msg.mb_id not in self.shared:
            reply = await super().rpc_forward(msg, peer_id)
            self.shared[msg.mb_id] = (0.0, self.sent[msg.mb_id])
            return reply
        fake = self.shared[msg.mb_id][1]
        self.sent[msg.mb_id] = fake
        reply = Backward(run_id=msg.run_id, mb_id=msg.mb_id, route=msg.route, gradient=encode(fake, "int8"),
                         loss=1.0, is_eval=False)
        task = asyncio.ensure_future(self.send(peer_id, "backward", reply))
        self.tasks.add(task)
        return Ack()


def _fabricators(net: Net, a0: PipelineServicer, names: list[str]) -> list[Fabricator]:
    """Fake stage-1 replicas returning negated gradients, all the same one for a micro-batch."""
    shared: dict[int, tuple[float, torch.Tensor]] = {}
    fabs: list[Fabricator] = [Colluder(net, name, shared) for name in names]
    records = a0.swarm()
    for fab in fabs:
        net.stages[fab.me] = fab  # type: ignore[assignment]
        records[fab.me] = PeerRecord(peer_id=fab.me, stage=1, throughput=1e9, queue=0, version=0, state="training")
    return fabs


def _recording(pipe: PipelineServicer) -> dict[int, torch.Tensor]:
    """The gradients ``pipe``'s stage trains on from now, by micro-batch."""
    applied: dict[int, torch.Tensor] = {}
    backward = pipe.worker.backward

    def recording(mb_id, grad):
        applied[mb_id] = grad.clone()
        return backward(mb_id, grad)

    pipe.worker.backward = recording  # type: ignore[method-assign]
    return applied


def _drive(net: Net, a0: PipelineServicer, corpus, cfg: PeerConfig, *, steps: int, seconds: float,  # noqa: F811
           until: Callable[[], bool] | None = None) -> None:
    """Stage 0 trains for ``seconds`` at most (or ``steps``, or until ``until()`` holds), with the daemon's timer
    dropping overdue micro-batches; once stopped, it stops waiting for a route too (all its next hops may be
    banned)."""
    async def expire() -> None:
        while True:
            await asyncio.sleep(0.5)
            await a0.expire()

    async def go() -> None:
        asyncio.get_running_loop().call_later(seconds, a0.stop_accepting)
        timer = asyncio.ensure_future(expire())
        await _run_driver(net, corpus, cfg, steps=steps, run_for=seconds, until=until)
        timer.cancel()
    asyncio.run(go())


def _liars_run(corpus, names: list[str], *, rechecks: bool):  # noqa: F811
    torch.manual_seed(0)
    net = Net()
    cfg = PeerConfig(microbatch_timeout_s=2.0, drain_timeout_s=1.0, recheck_after_warmups=0)
    pool = build(net, [["a0"], []], cfg)
    a0 = _with_copy(net, cfg, _held(StageWorker(RUN, 1)) if rechecks else None)
    fabs = _fabricators(net, a0, names)
    applied = _recording(a0)
    revoked: set[str] = set()
    a0.revoke = revoked.add
    if rechecks:  # until every liar is banned (a loaded machine gets through fewer re-checks a second)
        _drive(net, a0, corpus, cfg, steps=30, seconds=25.0, until=lambda: revoked >= set(names))
    else:
        _drive(net, a0, corpus, cfg, steps=30, seconds=4.0)
    pool.shutdown()
    sent = {mb: g for fab in fabs for mb, g in fab.sent.items()}
    trained = [mb for mb, g in applied.items() if mb in sent and distance(g, sent[mb]) < 0.5]
    return a0, sent, trained, revoked


@pytest.mark.timeout(60)
@pytest.mark.parametrize("names", [["fake1"], ["fake1", "fake2"]], ids=["lone", "colluding"])
def test_lying_next_stage_replicas_are_banned_by_the_copy(corpus, names):  # noqa: F811
    a0, sent, trained, revoked = _liars_run(corpus, names, rechecks=True)
    counters = a0.metrics.snapshot()["counters"]
    assert sent, "the fake stage got no traffic: the test tests nothing"
    assert trained == [], f"stage 0 trained on {len(trained)} fabricated gradients"
    assert counters.get("recheck_banned", 0) == len(names) and revoked == set(names), counters
    assert all(a0.router.candidates([PeerRecord(peer_id=n, stage=1, throughput=1.0, queue=0, version=0,
                                                state="training")], 1) == [] for n in names)
    assert a0.metrics.snapshot()["rechecks"]["cosine_max"] < 0  # negated: every re-check pointed the other way


@pytest.mark.timeout(60)
def test_without_the_copy_colluders_are_trained_on(corpus):  # noqa: F811
    """What re-checks close: two identities that agree with each other pass the spot checks."""
    a0, sent, trained, revoked = _liars_run(corpus, ["fake1", "fake2"], rechecks=False)
    assert sent and trained and not revoked


@pytest.mark.timeout(90)
@pytest.mark.parametrize("copy", [True, False], ids=["copy-decides", "history-decides"])
def test_a_liar_with_a_longer_record_cannot_get_its_honest_partner_blamed(corpus, copy):  # noqa: F811
    """A fabricating replica that earned more passed checks than its honest partner: when their spot check
    disagrees, the history rule blames the partner (three such blames in a row ban it); the held copy decides
    instead, blames the liar and trains on the partner's answer."""
    torch.manual_seed(0)
    net = Net()
    # every micro-batch spot-checked, none re-checked by sampling: the disagreements are what is judged
    cfg = PeerConfig(microbatch_timeout_s=10.0, recheck_after_warmups=0, spot_check_fraction=1.0,
                     recheck_fraction=0.0)
    pool = build(net, [["a0"], ["b1"]], cfg)
    a0 = _with_copy(net, cfg, _held(StageWorker(RUN, 1)) if copy else None)
    fab = Fabricator(net, "fake1")
    net.stages["fake1"] = fab  # type: ignore[assignment]
    a0.swarm()["fake1"] = PeerRecord(peer_id="fake1", stage=1, throughput=1e9, queue=0, version=0, state="training")
    spot = a0.spot
    assert spot is not None
    for name, passed in (("fake1", 50), ("b1", 5)):  # both past the trust bars; the liar with the longer record
        spot._hop(name).passed = passed
        spot._hop(name).rechecked = spot.config.trust_after
    revoked: set[str] = set()
    a0.revoke = revoked.add
    applied = _recording(a0)
    # until the one the rule decides against is banned and stage 0 trained on
    _drive(net, a0, corpus, cfg, steps=60, seconds=30.0,
           until=lambda: bool(revoked) and a0.worker.local_step >= 10)
    pool.shutdown()
    counters = a0.metrics.snapshot()["counters"]
    assert counters.get("spotcheck_failed", 0) >= 1, counters  # they disagreed: the test tests something
    trained_fake = [mb for mb, g in applied.items() if mb in fab.sent and distance(g, fab.sent[mb]) < 0.5]
    if copy:
        assert trained_fake == []
        assert counters.get("spotcheck_arbitrated", 0) >= 1, counters
        assert "b1" not in revoked and "fake1" in revoked, (revoked, counters)
        assert spot._hop("b1").strikes == 0 and spot._hop("b1").re_strikes == 0
        assert a0.worker.local_step >= 10  # trained on the honest partner's answers
    else:  # what the copy closes: the honest partner takes the blame, three times in a row, and is banned
        assert "b1" in revoked and counters.get("spotcheck_banned", 0) >= 1, (revoked, counters)


@pytest.mark.timeout(90)
def test_an_honest_lone_next_stage_passes_with_a_stale_copy(corpus):  # noqa: F811
    torch.manual_seed(0)
    net = Net()
    cfg = PeerConfig(microbatch_timeout_s=30.0, recheck_after_warmups=0)
    pool = build(net, [["a0"], ["b1"]], cfg)
    a0 = _with_copy(net, cfg, _held(StageWorker(RUN, 1)))  # the copy is of the seeded init; b1 trains away from it
    vouched: set[str] = set()
    a0.vouch = vouched.add
    asyncio.run(_run_driver(net, corpus, cfg, steps=40))
    pool.shutdown()
    counters = a0.metrics.snapshot()["counters"]
    assert counters.get("recheck_failed", 0) == 0 and counters.get("recheck_passed", 0) >= 4, counters
    assert a0.worker.local_step >= 40 and net.stages["b1"].worker.local_step >= 40 and "b1" in vouched
    figures = a0.metrics.snapshot()["rechecks"]
    assert figures["copy_bytes"] > 0 and figures["cosine_min"] >= RecheckConfig().min_cosine
    assert 0 < figures["compute_s"] and figures["norm_ratio_max"] <= RecheckConfig().max_norm_ratio, figures


@pytest.mark.timeout(90)
def test_the_stage_before_the_last_rechecks_in_a_three_stage_pipeline(corpus):  # noqa: F811
    """Stage 1 of 3 holds a copy of stage 2 and re-checks it; it forwards under ids of its own, and a held gradient
    comes back under the id it was sent with."""
    torch.manual_seed(0)
    net = Net()
    cfg = PeerConfig(microbatch_timeout_s=30.0, recheck_after_warmups=0)
    run = RUN.replace(n_stages=3, model={"n_layer": 3})
    pool = build(net, [["a0"], ["b1"], ["c2"]], cfg, run)
    old = net.stages["b1"]
    spares = SpareStore(run, None)
    assert spares.offer(2, StageWorker(run, 2).state_dict(), source="c2", taken_at=time.time())
    b1 = PipelineServicer(run=run, stage=1, worker=old.worker, compute=old.compute, send=old.send, swarm=old.swarm,
                          router=Router([1.0] * 3, rng=random.Random(1)), metrics=PeerMetrics("b1", 1), cfg=cfg,
                          my_id="b1", cost=1.0, spares=spares, notary=old.notary)
    net.stages["b1"] = b1
    assert net.stages["a0"].recheck is None  # build() gives stage 0 no copy: only stage n - 2 could use one anyway
    asyncio.run(_run_driver(net, corpus, cfg, steps=30))
    pool.shutdown()
    counters = b1.metrics.snapshot()["counters"]
    assert counters.get("recheck_passed", 0) >= 4 and counters.get("recheck_failed", 0) == 0, counters
    assert net.stages["a0"].worker.local_step >= 30 and counters.get("microbatches_dropped", 0) == 0, counters
