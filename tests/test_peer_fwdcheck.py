"""Forward re-checks (peer/pipeline/fwdcheck.py): stage 1 re-computes a sample of stage 0's forwards from its held
copy of stage 0 (a 2-stage run's last stage: its neighbour copy; a longer run's stage 1: a private copy) and refuses
activations the copy does not reproduce; in process, an honest stage 0 passes with a stale copy and a fabricating
one has none of its micro-batches trained, nor sent on."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from peer.config import PeerConfig
from peer.ops.metrics import PeerMetrics
from peer.pipeline.boundary import Boundary
from peer.pipeline.fwdcheck import ForwardCheckConfig, ForwardChecks
from peer.pipeline.recheck import HeldCopy
from peer.pipeline.servicer import PipelineServicer
from peer.state.spare import SpareStore
from tests.test_peer_pipeline import RUN, Net, _run_driver, build, corpus  # noqa: F401  (fixture)
from trainer.data import BatchStream
from trainer.worker import StageWorker

pytestmark = pytest.mark.timeout(90)

RUN3 = RUN.replace(n_stages=3, model={"n_layer": 3})
RUN_SUB = RUN.replace(compression={"activations": "subspace", "gradients": "subspace", "subspace_rank": 4,
                                   "subspace_codec": "ecq"})


def _copy_of_stage0(worker: StageWorker) -> SpareStore:
    spares = SpareStore(worker.run, None)
    assert spares.offer(0, worker.state_dict(), source="a0", taken_at=time.time())
    return spares


async def _direct(fn, *args):
    return fn(*args)


def _checks(spares: SpareStore, run=RUN, **kw) -> tuple[ForwardChecks, PeerMetrics]:
    metrics = PeerMetrics("b1", 1)
    return ForwardChecks(ForwardCheckConfig(**kw), copy=HeldCopy(run, 0, spares), boundary=Boundary(run, None),
                         compute=_direct, queued=lambda: 0, metrics=metrics, rng=random.Random(0)), metrics


def _received(boundary: Boundary, y: torch.Tensor) -> torch.Tensor:
    """Stage-0 output as the last stage decodes it (the run's int8 codec)."""
    from protocol.codecs.registry import decode, encode
    return decode(encode(y, RUN.compression.activations))


def test_the_copy_reproduces_honest_activations_and_refuses_fabricated_ones(corpus):  # noqa: F811
    torch.manual_seed(0)
    w0 = StageWorker(RUN, 0)
    checks, metrics = _checks(_copy_of_stage0(w0))
    boundary = Boundary(RUN, None)
    x, y = BatchStream(corpus.train, 32, 8, seed=1).next()
    window = torch.cat([x, y[:, -1:]], dim=1)
    with torch.no_grad():
        honest = _received(boundary, w0.model(x))
        other = StageWorker(RUN.replace(seed=RUN.seed + 1), 0).model(x)  # another model's activations
    verdict = lambda acts, win=window: asyncio.run(checks.judge("a0", 1, acts, win))  # noqa: E731
    assert verdict(honest)
    for fake in (20 * honest, -honest, torch.randn_like(honest) * honest.std(), other):
        assert not verdict(fake)
    assert not verdict(honest, None)  # a forward without its window cannot be re-checked: refused
    counters = metrics.snapshot()["counters"]
    assert counters["fwdcheck_passed"] == 1 and counters["fwdcheck_failed"] == 5
    assert metrics.snapshot()["fwdchecks"]["checks"] == 6 and checks.compute_s > 0


def test_a_subspace_runs_forwards_are_judged_on_their_coefficients_not_the_fixed_tables(corpus):  # noqa: F811
    """In a subspace run the activations a receiver rebuilds are F (its own fixed tables' rows for the ids) + U c:
    judged whole, F dominates and fabricated coefficients (zeros, noise, negated, another model's) pass; judged on
    the coefficients the sender chose (``Boundary.sent``), they fail and honest ones pass. The norm bound reads the
    same coefficients."""
    from peer.pipeline.spotcheck import agreement
    from protocol.codecs.registry import decode, encode
    from tools.redteam_trust import subspace_impostor

    run = RUN_SUB
    torch.manual_seed(0)
    w0 = StageWorker(run, 0)
    checks, metrics = _checks(_copy_of_stage0(w0), run=run)
    boundary = checks.boundary
    x, y = BatchStream(corpus.train, 32, 8, seed=1).next()
    window = torch.cat([x, y[:, -1:]], dim=1)
    sub = boundary.subspace
    assert sub is not None

    def received(c: torch.Tensor) -> torch.Tensor:  # coefficients through the wire, rebuilt as the receiver does
        return sub.rebuild(decode(encode(c, run.compression.subspace_codec)), x)

    impostor = subspace_impostor(run, 1)  # another model in the run's subspace
    with torch.no_grad():
        c = sub.coefficients(w0.model(x), x)
        other = sub.coefficients(impostor(x), x)
    honest = received(c)
    fakes = {"zeros": received(torch.zeros_like(c)), "noise": received(torch.randn_like(c) * c.std()),
             "negated": received(-c), "other model": received(other)}
    assert agreement(fakes["zeros"], honest)[0] > 0.5  # whole vectors: F alone reads close to an honest frame
    verdict = lambda acts: asyncio.run(checks.judge("a0", 1, acts, window))  # noqa: E731
    assert verdict(honest)
    failed = {name: not verdict(fake) for name, fake in fakes.items()}
    assert all(failed.values()), (failed, list(checks.seen))
    assert metrics.snapshot()["counters"]["fwdcheck_failed"] == len(fakes)
    # the coefficients of what was received, as the norm bound reads them: zeros have none
    assert torch.allclose(boundary.sent(honest, window), decode(encode(c, run.compression.subspace_codec)),
                          atol=1e-4)
    assert float(boundary.sent(fakes["zeros"], window).norm()) < 1e-3 * float(c.norm())


def test_a_sender_is_checked_every_time_until_trusted_then_sampled(corpus):  # noqa: F811
    w0 = StageWorker(RUN, 0)
    spares = SpareStore(RUN, None)
    checks, _ = _checks(spares, fraction=0.0, trust_after=2)
    assert not checks.wants("a0")  # no copy held: nothing to check with
    spares.offer(0, w0.state_dict(), source="a0", taken_at=time.time())
    x, y = BatchStream(corpus.train, 32, 8, seed=1).next()
    window = torch.cat([x, y[:, -1:]], dim=1)
    with torch.no_grad():
        honest = w0.model(x)
    for _ in range(2):
        assert checks.wants("a0") and asyncio.run(checks.judge("a0", 1, honest, window))
    assert checks.trusted("a0") and not checks.wants("a0")  # trusted: sampled at fraction 0
    assert checks.wants("stranger")
    assert not asyncio.run(checks.judge("a0", 2, -honest, window))  # one failure: every forward checked again
    assert checks.wants("a0") and not checks.trusted("a0")
    with pytest.raises(ValueError):
        ForwardCheckConfig(fraction=2.0)


def _stage1_with_copy(net: Net, cfg: PeerConfig, spares: SpareStore, run=RUN) -> PipelineServicer:
    """Stage 1 ("b1") rebuilt with the held copy of stage 0 (build() makes it without): as its neighbour copy in a
    2-stage run, as its private copy in a longer one."""
    old = net.stages["b1"]
    copies = {"spares": spares} if run.n_stages == 2 else {"upstream": spares}
    b1 = PipelineServicer(run=run, stage=1, worker=old.worker, compute=old.compute, send=old.send, swarm=old.swarm,
                          router=old.router, metrics=PeerMetrics("b1", 1), cfg=cfg, my_id="b1", cost=1.0,
                          notary=old.notary, **copies)
    net.stages["b1"] = b1
    return b1


def _pipeline(corpus, *, fabricate: bool, steps: int, run_for: float, run=RUN):  # noqa: F811
    torch.manual_seed(0)
    net = Net()
    cfg = PeerConfig(microbatch_timeout_s=5.0, drain_timeout_s=1.0, recheck_after_warmups=0)
    pool = build(net, [["a0"], ["b1"], ["c2"]][: run.n_stages], cfg, run)
    a0 = net.stages["a0"]
    stale = SpareStore(run, None)  # the seeded init: a stale copy
    assert stale.offer(0, StageWorker(run, 0).state_dict(), source="a0", taken_at=time.time())
    b1 = _stage1_with_copy(net, cfg, stale, run)
    if fabricate:  # stage 0 trains honestly but sends another model's activations
        other = StageWorker(run.replace(seed=run.seed + 1), 0).model
        forward = a0.worker.forward

        def fabricated(mb_id, x):
            forward(mb_id, x)
            with torch.no_grad():
                return other(x)

        a0.worker.forward = fabricated  # type: ignore[method-assign]
    asyncio.run(_run_driver(net, corpus, cfg, steps=steps, run_for=run_for))
    pool.shutdown()
    return a0, b1, net


@pytest.mark.parametrize("run", [RUN, RUN3], ids=["2-stages", "3-stages"])
def test_an_honest_stage0_passes_with_a_stale_copy(corpus, run):  # noqa: F811
    """The stale copy here is the seeded init's (the copy rule keeps such copies out of a peer's checks): plain
    runs' activations still agree with it. A subspace run's coefficients do not reliably (cosine 0.08 once in 8
    checks on CI): their honest figures are measured from the copies a peer uses (docs/security.md, "Subspace runs:
    what is judged")."""
    a0, b1, _ = _pipeline(corpus, fabricate=False, steps=30, run_for=60.0, run=run)
    counters = b1.metrics.snapshot()["counters"]
    assert counters.get("fwdcheck_failed", 0) == 0 and counters.get("fwdcheck_passed", 0) >= 4, counters
    assert b1.worker.local_step >= 30
    figures = b1.metrics.snapshot()["fwdchecks"]
    assert figures["cosine_min"] >= ForwardCheckConfig().min_cosine, figures
    assert figures["norm_ratio_max"] <= ForwardCheckConfig().max_norm_ratio, figures


@pytest.mark.parametrize("run", [RUN, RUN3], ids=["2-stages", "3-stages"])
def test_a_fabricating_stage0_is_never_trained_on(corpus, run):  # noqa: F811
    a0, b1, net = _pipeline(corpus, fabricate=True, steps=30, run_for=6.0, run=run)
    counters = b1.metrics.snapshot()["counters"]
    assert counters.get("fwdcheck_failed", 0) >= 3 and counters.get("fwdcheck_passed", 0) == 0, counters
    assert b1.worker.local_step == 0  # none of its micro-batches was trained on
    if run.n_stages == 3:  # nor computed and sent on: the later stages never saw one
        assert net.stages["c2"].worker.local_step == 0
        assert net.stages["c2"].metrics.snapshot()["counters"].get("tokens", 0) == 0
    assert b1.guard.share.snapshot()["a0"]["refused"] >= 3
    assert a0.metrics.snapshot()["counters"].get("microbatches_refused", 0) >= 3  # told, and it re-sent the samples
