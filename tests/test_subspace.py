"""The subspace model+codec pair: exact rebuild, gradients in the subspace, the invariant kept after optimiser steps,
averaging and state loads, frame validation, export, and a 2-stage in-process pipeline that trains with it."""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from peer.config import PeerConfig
from peer.handlers.sizes import pipeline_request_bytes
from peer.membership.records import PeerRecord
from peer.membership.routing import Router
from peer.ops.metrics import PeerMetrics
from peer.pipeline.boundary import Boundary
from peer.pipeline.driver import Stage0Driver
from peer.pipeline.servicer import PipelineServicer
from protocol.codecs.registry import decode, encode
from protocol.errors import ValidationError
from protocol.messages import Forward, pack, unpack
from tests.notaries import NamedNotary
from trainer.config import RunConfig
from trainer.data import BatchStream, load_corpus, val_batches
from trainer.export import gpt_state
from trainer.model import GPT
from trainer.worker import StageWorker

TINY = RunConfig.from_toml(Path(__file__).parent / "runs" / "tiny.toml")
SUB = TINY.replace(compression={"activations": "subspace", "gradients": "subspace", "subspace_rank": 4})


def _batch(run: RunConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, t, v = run.data.batch_size, run.model.block_size, run.model.vocab_size
    return torch.randint(0, v, (b, t), generator=g), torch.randint(0, v, (b, t), generator=g)


def test_config_checks_and_run_ids():
    assert "subspace_rank" not in TINY.to_dict()["compression"]  # plain runs keep the run ids they had
    assert SUB.run_id != TINY.run_id and RunConfig.from_dict(__import__("tomllib").loads(SUB.to_toml())) == SUB
    with pytest.raises(ValueError, match="both"):
        TINY.replace(compression={"activations": "subspace", "subspace_rank": 4})
    with pytest.raises(ValueError, match="subspace_rank"):
        TINY.replace(compression={"activations": "subspace", "gradients": "subspace"})
    with pytest.raises(ValueError, match="below"):
        SUB.replace(compression={"subspace_rank": 32})
    with pytest.raises(ValueError, match="dropout"):
        SUB.replace(model={"dropout": 0.1})
    assert "subspace_table_std" not in TINY.to_dict()["compression"]
    assert SUB.replace(compression={"subspace_table_std": 0.02}).run_id != SUB.run_id  # F is part of the model
    with pytest.raises(ValueError, match="subspace_table_std"):
        SUB.replace(compression={"subspace_table_std": float("nan")})
    for unused in ({"subspace_codec": "ecq"}, {"subspace_table_std": 0.3}):  # silently unused, yet a new run id
        with pytest.raises(ValueError, match="applies only with"):
            TINY.replace(compression=unused)


def test_boundary_rebuilds_exactly_and_gradients_lose_nothing():
    """Coefficients + ids rebuild stage 0's output to float rounding, and the subspace gradient gives stage 0 the
    same update as the full gradient would."""
    ids, targets = _batch(SUB)
    w0, w1 = StageWorker(SUB, 0), StageWorker(SUB, 1)
    ss = w0.subspace
    y = w0.forward(1, ids)
    x = ss.rebuild(ss.coefficients(y, ids), ids)
    assert float((x - y).abs().max()) < 1e-6 * float(y.abs().max())
    _, g = w1.forward_loss(1, x, targets)
    assert float((g - ss.grad_rebuild(ss.grad_coefficients(g))).norm()) > 0.1 * float(g.norm())  # g leaves it...
    twin = StageWorker(SUB, 0, auto_step=False)
    w0.auto_step = False
    twin.forward(1, ids)
    w0.backward(1, ss.grad_rebuild(ss.grad_coefficients(g)))  # ... yet only its part in the subspace trains
    twin.backward(1, g)
    w0.optimizer_step(), twin.optimizer_step()
    for a, b in zip(w0.parameters(), twin.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    # the last stage's residual stream never crosses a boundary: its writers train freely
    assert not w1.constrained and ss.distance(w1.model) > 1e-4


def test_invariant_kept_after_step_averaging_and_load():
    w = StageWorker(SUB, 0)
    ss = w.subspace
    assert ss.distance(w.model) < 1e-6
    ids, _ = _batch(SUB)
    for i in range(3):
        w.forward(i, ids)
        w.backward(i, torch.randn(*ids.shape, SUB.model.n_embd))
    assert w.local_step == 3 and ss.distance(w.model) < 1e-6
    begun = w.averaging_begin(0)
    w.averaging_finish(0, [v + torch.randn_like(v) for v in begun])  # a mean that leaves the subspace
    assert ss.distance(w.model) < 1e-6
    state = w.state_dict()
    state["model"] = {k: v + torch.randn_like(v) for k, v in state["model"].items()}
    w.load_state_dict(state)
    assert ss.distance(w.model) < 1e-6
    # the fixed embedding tables are the seeded init of every replica: two replicas agree without communicating
    other = StageWorker(SUB, 0, replica=1).subspace
    assert torch.equal(other.u, ss.u) and torch.equal(other.tok_table, ss.tok_table)
    later = StageWorker(SUB, 1).subspace  # a stage without embeddings holds U only, not the tables
    assert torch.equal(later.u, ss.u) and not later.has_tables and later.tok_table.numel() == 0
    with pytest.raises(RuntimeError, match="without the fixed tables"):
        later.fixed(torch.zeros(1, 2, dtype=torch.long))
    assert float(ss.tok_table.std()) == pytest.approx(SUB.compression.subspace_table_std, rel=0.05)


def test_a_constrained_stage_steps_adam_in_the_subspace_coordinates():
    """The optimiser of a constrained stage holds [k, *] moments and takes Adam's step on the coordinates: the same
    weights as NAdam run by hand on (W - F) U / U^T W, which is not what projecting a full-coordinate step gives."""
    w = StageWorker(SUB, 0, auto_step=False)
    ss, k = w.subspace, SUB.compression.subspace_rank
    named = dict(w.model.named_parameters())
    targets = {n for n, _ in ss._targets(w.model)}
    assert targets and {"wte.weight", "wpe.weight"} <= targets
    coords = {n: ss.to_coords(n, p.detach(), fixed=True).clone().requires_grad_(True) for n, p in named.items()
              if n in targets}
    others = {n: p.detach().clone().requires_grad_(True) for n, p in named.items() if n not in targets}
    by_hand = torch.optim.NAdam([coords.get(n, others.get(n)) for n in named], lr=1.0, betas=(SUB.optim.beta1,
                                SUB.optim.beta2), eps=SUB.optim.eps, weight_decay=SUB.optim.weight_decay,
                                momentum_decay=SUB.optim.momentum_decay, decoupled_weight_decay=True)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        grads = {n: torch.randn(p.shape, generator=g) * 1e-3 for n, p in named.items()}  # below the clip
        for n, p in named.items():
            p.grad = grads[n].clone()
            t = coords.get(n, others.get(n))
            t.grad = ss.to_coords(n, grads[n], fixed=False) if n in targets else grads[n].clone()
        for group in by_hand.param_groups:
            group["lr"] = w.lr_now()
        w.optimizer_step()
        by_hand.step()
        by_hand.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in named.values())
    for n, p in named.items():
        want = ss.from_coords(n, coords[n], fixed=True) if n in targets else others[n]
        assert torch.allclose(p, want, atol=1e-6), n
    assert ss.distance(w.model) < 1e-6
    moments = w.state_dict()["optimizer"]["state"]
    index = {n: i for i, n in enumerate(named)}
    assert moments[index["wte.weight"]]["exp_avg"].shape == (SUB.model.vocab_size, k)
    assert moments[index["blocks.0.mlp.c_proj.weight"]]["exp_avg_sq"].shape == (k, 4 * SUB.model.n_embd)
    assert moments[index["blocks.0.mlp.c_fc.weight"]]["exp_avg"].shape == named["blocks.0.mlp.c_fc.weight"].shape


def test_a_state_carries_the_coordinates_moments_and_older_states_still_load():
    """A constrained stage's state round-trips its [k, *] moments (the next step is the same), and a state whose
    moments have the parameters' shapes (written before stages stepped coordinates) loads without them."""
    ids, _ = _batch(SUB)
    w = StageWorker(SUB, 0)
    for i in range(3):
        w.forward(i, ids)
        w.backward(i, torch.randn(*ids.shape, SUB.model.n_embd))
    state = w.state_dict()
    twin = StageWorker(SUB, 0)
    twin.load_state_dict(state)
    for i, entry in twin.state_dict()["optimizer"]["state"].items():
        assert all(torch.equal(v, state["optimizer"]["state"][i][key]) for key, v in entry.items())
    grad = torch.randn(*ids.shape, SUB.model.n_embd)
    for x in (w, twin):
        x.forward(9, ids)
        x.backward(9, grad)
    for a, b in zip(w.parameters(), twin.parameters(), strict=True):  # the load's projection rounds (~3e-8), which
        assert torch.allclose(a, b, atol=1e-4)  # Adam's division by sqrt(v) of a young state can magnify a little
    ss, named = w.subspace, [n for n, _ in w.model.named_parameters()]
    older = w.state_dict()
    for i, n in enumerate(named):  # moments as a full-coordinate optimiser held them
        if n.endswith("c_proj.weight"):
            entry = older["optimizer"]["state"][i]
            entry["exp_avg"] = ss.from_coords(n, entry["exp_avg"], fixed=False)
            entry["exp_avg_sq"] = entry["exp_avg"] ** 2  # within what an Adam state reaches (|m| <= c sqrt(v))
    fresh = StageWorker(SUB, 0)
    fresh.load_state_dict(older)  # its second moments have no coordinates' equivalent: loaded without moments
    assert fresh.state_dict()["optimizer"]["state"] == {} and fresh.rewarm_from == fresh.local_step == 4
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(fresh.parameters(), w.parameters(), strict=True))
    wrong = w.state_dict()
    first = next(i for i, n in enumerate(named) if n.endswith("c_proj.weight"))
    wrong["optimizer"]["state"][first]["exp_avg"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="shape"):
        fresh.load_state_dict(wrong)


def test_frames_are_validated():
    b = Boundary(SUB, None)
    ids, _ = _batch(SUB)
    seq = torch.cat([ids, ids[:, :1]], dim=1)  # each row a window of block + 1 tokens
    x_in, y_in = seq[:, :-1], seq[:, 1:]
    y = torch.randn(*ids.shape, SUB.model.n_embd)
    targets, window = b.first_hop(x_in, y_in)
    assert targets is None and torch.equal(window, seq)  # the targets ride in the window: one id per row more
    with pytest.raises(ValueError, match="shifted"):
        b.first_hop(x_in, torch.zeros_like(y_in))
    plain_targets, plain_window = Boundary(TINY, None).first_hop(x_in, y_in)
    assert plain_targets is not None and plain_targets.dtype == "int64"  # plain runs: the targets as ever,
    assert torch.equal(plain_window, seq)  # and the window, for forward re-checks
    assert Boundary(TINY, None).first_hop(x_in, torch.zeros_like(y_in))[1] is None  # not shifted: no window
    acts, tokens = b.encode_forward(y, window)
    assert acts.shape == (*ids.shape, 4) and tokens.dtype == "uint8" and tokens.shape == seq.shape

    def fwd(**kw):
        fields = dict(run_id=SUB.run_id, mb_id=1, route=["a"], activations=acts, targets=None, is_eval=False,
                      sent_at=1.0, tokens=tokens)
        return unpack(pack(Forward(**{**fields, **kw})))

    x, got = b.decode_forward(fwd(), "p")
    assert torch.equal(got, seq) and x.shape == y.shape
    assert torch.equal(x, b.subspace.rebuild(decode(acts), x_in))  # rebuilt from the inputs, not the targets
    with pytest.raises(ValidationError, match="tokens"):
        b.decode_forward(fwd(tokens=None), "p")
    with pytest.raises(ValidationError, match="targets"):  # the same ids twice: refused, not ignored
        b.decode_forward(fwd(targets=encode(y_in.to(torch.uint8), "none")), "p")
    with pytest.raises(ValidationError, match="shape"):  # ids without the window's last target
        b.decode_forward(fwd(tokens=encode(x_in.to(torch.uint8), "none")), "p")
    with pytest.raises(ValidationError, match="shape"):
        b.decode_forward(fwd(activations=encode(torch.zeros(*ids.shape, 5), "none")), "p")
    with pytest.raises(ValidationError, match="exceeds"):
        b.decode_forward(fwd(activations=encode(torch.full((*ids.shape, 4), 1e12), "none")), "p")
    with pytest.raises(ValidationError, match="dtype"):
        b.decode_forward(fwd(tokens=encode(seq, "none")), "p")  # int64 ids: not the run's uint8 frame
    big = TINY.replace(model={"vocab_size": 300}, compression=SUB.compression.__dict__)
    bb = Boundary(big, None)
    bad = torch.full(seq.shape, 299, dtype=torch.int16)
    for wrong in (300, -1):
        bad[1, -1] = wrong  # the last target alone is outside the vocabulary
        with pytest.raises(ValidationError, match="vocabulary"):
            bb.decode_forward(fwd(run_id=big.run_id, tokens=encode(bad, "none")), "p")
    bad[1, -1] = 299
    assert bb.decode_forward(fwd(run_id=big.run_id, tokens=encode(bad, "none")), "p")[1].max() == 299
    # the frames are small, and the receiver's size limit knows it
    assert pipeline_request_bytes(SUB)["forward"] < pipeline_request_bytes(TINY)["forward"]
    # a message without tokens packs as before (peers that predate the field read it)
    old = Forward(run_id="r", mb_id=1, route=["a"], activations=acts, targets=None, is_eval=False, sent_at=1.0)
    assert len(__import__("msgpack").unpackb(pack(old))[2]) == 8


def test_export_is_a_plain_gpt():
    """The stages' weights make an ordinary GPT whose logits equal the pipeline's."""
    w0, w1 = StageWorker(SUB, 0), StageWorker(SUB, 1)
    ids, targets = _batch(SUB)
    for i in range(2):
        y = w0.forward(i, ids)
        _, g = w1.forward_loss(i, y, targets)
        w0.backward(i, g)
    gpt = GPT(SUB.model)
    gpt.load_state_dict(gpt_state(SUB, {0: w0.model.state_dict(), 1: w1.model.state_dict()}))
    with torch.no_grad():
        ss = w0.subspace
        x = ss.rebuild(ss.coefficients(w0.evaluate(ids), ids), ids)
        assert torch.allclose(gpt(ids), w1.evaluate(x), atol=1e-4)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("n_stages", [2, 3])
def test_loopback_pipeline_trains_in_the_subspace(n_stages):
    """Stage 0's micro-batches through 2 or 3 stages (a middle stage passes the token window on), the coefficients in
    int8 or in ecq (Huffman-coded, variable length)."""
    codec = "int8" if n_stages == 2 else "ecq"
    run = SUB.replace(n_stages=n_stages, model={"n_layer": max(2, n_stages)}, compression={"subspace_codec": codec})
    pids = ["a0", "b1", "c2"][:n_stages]
    corpus = load_corpus(run.data, run.model.vocab_size)
    pool = ThreadPoolExecutor(max_workers=1)
    stages: dict[str, PipelineServicer] = {}

    def sender(me: str):
        async def send(peer: str, name: str, msg):
            target = stages[peer]
            handler = target.rpc_forward if name == "forward" else target.rpc_backward
            return unpack(pack(await handler(unpack(pack(msg)), me)))
        return send

    async def compute(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    records = {pid: PeerRecord(peer_id=pid, stage=s, throughput=1.0, queue=0, version=0, state="training")
               for s, pid in enumerate(pids)}
    cfg = PeerConfig(microbatch_timeout_s=30.0)
    book: dict = {}  # signed frames between stages (tests/notaries.py)
    for s, pid in enumerate(pids):
        stages[pid] = PipelineServicer(run=run, stage=s, worker=StageWorker(run, s), compute=compute, send=sender(pid),
                                       swarm=lambda: records, router=Router([1.0] * n_stages, rng=random.Random(0)),
                                       metrics=PeerMetrics(pid, s), cfg=cfg, my_id=pid, cost=1.0,
                                       notary=NamedNotary(pid, book))

    sent, trained = set(), []  # the last stage trains on the very targets stage 0 drew (cut from the window)
    stream = BatchStream(corpus.train, run.model.block_size, 8, seed=1)
    draw, train = stream.next, stages[pids[-1]].worker.forward_loss

    def drawn():
        x, y = draw()
        sent.add(y.numpy().tobytes())
        return x, y

    def trains(mb_id, x, targets, **kw):
        trained.append(targets.numpy().tobytes())
        return train(mb_id, x, targets, **kw)

    stream.next, stages[pids[-1]].worker.forward_loss = drawn, trains

    async def drive() -> Stage0Driver:
        stop = asyncio.Event()
        t = run.model.block_size
        driver = Stage0Driver(pipe=stages["a0"], stream=stream,
                              val=val_batches(corpus, t, 8, 2), inflight=3, stop=stop, max_steps=60,
                              metrics=stages["a0"].metrics)
        serving = [asyncio.ensure_future(p.serve()) for p in stages.values()]
        try:
            await driver.run_async()
            await driver.evaluate()
        finally:
            for task in serving:
                task.cancel()
        return driver

    try:
        driver = asyncio.run(drive())
    finally:
        pool.shutdown()
    assert all(p.worker.local_step >= 60 for p in stages.values())
    assert len(trained) >= 60 and set(trained) <= sent
    first, last = sum(driver.losses[:5]) / 5, sum(driver.losses[-5:]) / 5
    assert last < first - 0.5, (first, last)
    assert driver.val_losses and driver.val_losses[-1] < first
    for p in stages.values():
        assert (p.worker.subspace.distance(p.worker.model) < 1e-5) == p.worker.constrained
        assert not p.metrics.snapshot()["counters"].get("rejected:bad_tensor")


def test_llama_layout_rebuilds_exactly_and_keeps_the_invariant():
    """The same pair on the Llama-style stages (trainer/llama.py): o_proj and down_proj are the residual writers,
    the token table the only embedding (rotary positions)."""
    run = RunConfig.from_toml(Path(__file__).parent.parent / "trainer" / "runs" / "llama-tiny.toml").replace(
        n_stages=2, compression={"activations": "subspace", "gradients": "subspace", "subspace_rank": 8},
        optim={"warmup_steps": 0})
    w0, w1 = StageWorker(run, 0), StageWorker(run, 1)
    ss = w0.subspace
    assert ss.arch == "llama" and ss.pos_table is None
    ids, targets = torch.randint(0, run.model.vocab_size, (2, 16)), torch.randint(0, run.model.vocab_size, (2, 16))
    for i in range(2):
        y = w0.forward(i, ids)
        x = ss.rebuild(ss.coefficients(y, ids), ids)
        assert float((x - y).abs().max()) < 1e-6 * float(y.abs().max())
        _, g = w1.forward_loss(i, x, targets)
        w0.backward(i, ss.grad_rebuild(ss.grad_coefficients(g)))
    assert w0.local_step == 2 and ss.distance(w0.model) < 1e-6


@pytest.mark.parametrize("method", ["asyncpp", "fullsync"])
def test_simulator_runs_subspace_runs(tmp_path, method):
    """`simulate --subspace-rank` trains the subspace model in one process: the boundary's coefficients go through
    the coefficient codec and are rebuilt with the micro-batch's token ids, on both schedules."""
    from peer.cli import build_parser
    from peer.cli.simulate import build_config
    from trainer.sim.simulator import run_method

    args = build_parser().parse_args(["simulate", "--preset", "smoke", "--out", str(tmp_path), "--steps", "8",
                                      "--eval-every", "4", "--replicas", "1", "--subspace-rank", "8"])
    exact = build_config(args)
    assert exact.run.compression.subspace and exact.run.compression.subspace_rank == 8
    res = run_method(exact, method, method, 0)
    assert res["final_val_loss"] < res["first_val_loss"] + 1.0 and res["steps_skipped"] == 0
    assert res["curve"][-1]["act_codec_rel_err"] < 1e-5  # fp32 coefficients: the rebuild is exact
    assert res["curve"][-1]["grad_codec_rel_err"] < 1e-5
    args.subspace_codec = "int4"
    lossy = run_method(build_config(args), method, method, 0)
    assert 1e-3 < lossy["curve"][-1]["act_codec_rel_err"] < 0.5
    assert 1e-3 < lossy["curve"][-1]["grad_codec_rel_err"] < 0.5


def test_simulator_refuses_mixed_subspace_flags(tmp_path, capsys):
    from peer.cli import main

    assert main(["simulate", "--out", str(tmp_path), "--subspace-codec", "int4"]) == 2
    assert "--subspace-rank" in capsys.readouterr().err
    assert main(["simulate", "--out", str(tmp_path), "--subspace-rank", "8", "--compression", "int8"]) == 2
    assert "replaces --compression" in capsys.readouterr().err


def test_a_recheck_takes_the_targets_from_the_window():
    """The held copy's re-check (peer/pipeline/recheck.py) re-computes a subspace forward's gradient against the
    targets the window carries: its forwards have no `targets` field."""
    from types import SimpleNamespace

    from peer.pipeline.recheck import Rechecks

    b = Boundary(SUB, None)
    ids, _ = _batch(SUB)
    seq = torch.cat([ids, ids[:, :1]], dim=1)
    acts, tokens = b.encode_forward(torch.randn(*ids.shape, SUB.model.n_embd), seq)
    fwd = Forward(run_id=SUB.run_id, mb_id=1, route=["a"], activations=acts, targets=None, is_eval=False,
                  sent_at=1.0, tokens=tokens)
    rows = SUB.data.batch_size
    me = SimpleNamespace(boundary=b, tok_spec=None, my_id="p", config=SimpleNamespace(rows=rows))
    x, targets, order = Rechecks._inputs(me, fwd)  # type: ignore[arg-type]
    assert x.shape == (rows, *ids.shape[1:], SUB.model.n_embd) and torch.equal(targets, seq[order, 1:])
