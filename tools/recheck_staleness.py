#!/usr/bin/env python3
"""How far a stale copy of the last stage disagrees with the live stage on the gradients it returns.

A stage re-computes a sample of its next (last) stage's gradients from the copy of that stage it holds
(peer/pipeline/recheck.py); the copy is up to a backup period older than the stage that answered. This trains a
2-stage run with two ``StageWorker``s in one process (no network), keeps copies of the last stage every
``--every`` steps, and at each measurement point compares, on fresh micro-batches, the live stage's input gradient
with each older copy's (lags in steps), both through the wire's codecs (activations as the last stage receives them,
gradients quantized as they return): cosine similarity and norm ratio, the figures the re-check's thresholds are set
from. A negated and a random gradient are measured beside them. ``forward_*``: the same for stage 0's output against
a copy of stage 0 as old (what a forward re-check at the last stage would compare), and ``first_token_found``: the
share of sequences whose first input id the copy recovers from the received position-0 activations (a plain
``Forward`` carries only the targets, which give every other id).

    python tools/recheck_staleness.py --run tests/runs/tiny.toml --steps 2000 --every 50 --measure-every 250 \
        --lags 0,50,100,250,500,1000,2000 --json docs/bench/recheck_staleness_tiny.json

``--middle`` (automatic for a run of 3 stages or more; a 2-stage run file is cut into 3 stages of at least one block
each): the same for a *middle* stage, which stage 0 re-checks with a witness's testimony (peer/pipeline/testimony.py).
Every stage trains in one process, every hop through the wire's codecs; copies of stage 1 are kept every ``--every``
steps, and at each measurement point, on fresh micro-batches and ``--rows`` random rows of each, what the live
stage 1 added (its output as stage 2 received it, its input gradient as stage 0 received it, given the gradient
stage 2 returned) is compared with what each older copy adds (``middle_agreement``: cosine and norm ratio, for the
activations and for the gradients). The same for a hop that attacks: ``identity`` (passes its input on and the
gradient back unchanged), ``noise`` (adds random noise of the norm the live stage adds, to both), ``negated`` (adds
the negation of what the live stage adds), ``other_seed`` (a stage 1 of another seed, untrained) and
``other_seed_trained`` (one of another seed trained beside the live one, on the same inputs and on gradients of the
same downstream stages; ``--no-trained-impostor`` leaves it out). Each attack's witness answers what it received
from the attacker, and the gradient it returned for that. The JSON's ``middle`` holds, per lag and case, the
quantiles of each figure and the share the re-check's thresholds fail (``summary``, ``separation``: copies of step
>= ``recheck_after_warmups`` x warm-up steps, the ones a peer uses; ``early_copies``: honest checks of earlier
copies), and every check (``rows``):

    python tools/recheck_staleness.py --run tests/runs/tiny.toml --middle --steps 2000 --every 50 \
        --measure-every 250 --batches 8 --lags 0,50,100,250,500,1000,1500,1950,2000 \
        --json docs/bench/recheck_staleness_middle_tiny.json
    python tools/recheck_staleness.py --middle --steps 2500 --every 50 --measure-every 250 \
        --lags 0,100,250,500,1000,1500,2000 --json docs/bench/recheck_staleness_middle_default.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from peer.config import PeerConfig  # noqa: E402
from peer.pipeline.boundary import Boundary  # noqa: E402
from peer.pipeline.recheck import RecheckConfig, input_gradient  # noqa: E402
from peer.pipeline.spotcheck import agreement, quantiles  # noqa: E402
from peer.pipeline.testimony import as_carried, middle_agreement, middle_reference  # noqa: E402
from trainer.config import RunConfig  # noqa: E402
from trainer.data import BatchStream, load_corpus  # noqa: E402
from trainer.model import StageBase, build_stage  # noqa: E402
from trainer.worker import StageWorker  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, default=None, help="run file (default: the embedded default run)")
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--every", type=int, default=100, help="keep a copy of the last stage every this many steps")
    ap.add_argument("--measure-every", type=int, default=500)
    ap.add_argument("--lags", default="0,100,500,1000,2000,3600")
    ap.add_argument("--batches", type=int, default=4, help="micro-batches per measurement")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--middle", action="store_true",
                    help="measure a middle stage (stage 1 of 3; automatic for a run of 3 stages or more)")
    ap.add_argument("--rows", type=int, default=RecheckConfig().rows, help="--middle: rows re-computed per check")
    ap.add_argument("--no-trained-impostor", action="store_true",
                    help="--middle: leave out the other-seed stage 1 trained beside the live one (saves its compute)")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    run = RunConfig.from_toml(args.run) if args.run else RunConfig.default()
    if args.middle or run.n_stages >= 3:
        if run.n_stages == 2:  # cut into 3 stages of at least one block each
            run = run.replace(n_stages=3, model={"n_layer": max(3, run.model.n_layer)})
        _middle(args, run)
        return
    if run.n_stages != 2:
        raise SystemExit("a 2-stage run is measured")
    lags = [int(v) for v in args.lags.split(",")]
    boundary = Boundary(run, None)
    corpus = load_corpus(run.data, run.model.vocab_size)
    train = BatchStream(corpus.train, run.model.block_size, run.data.batch_size, seed=1)
    fresh = BatchStream(corpus.train, run.model.block_size, run.data.batch_size, seed=2)
    w0, w1 = StageWorker(run, 0), StageWorker(run, 1)
    copies: dict[int, dict[str, torch.Tensor]] = {}
    firsts: dict[int, dict[str, torch.Tensor]] = {}  # copies of stage 0, for the forward figures
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for step in range(args.steps + 1):
        if step % args.every == 0:
            copies[step] = {k: v.detach().clone() for k, v in w1.model.state_dict().items()}
            firsts[step] = {k: v.detach().clone() for k, v in w0.model.state_dict().items()}
        if step % args.measure_every == 0 and step > 0:
            live = copies[step]
            for lag in lags:
                old = copies.get(step - lag)
                if old is None:
                    continue
                a, b = build_stage(run, 1), build_stage(run, 1)
                a.load_state_dict(live)
                b.load_state_dict(old)
                for m in (a, b):
                    m.requires_grad_(False).eval()
                for _ in range(args.batches):
                    x, y = fresh.next()
                    with torch.no_grad():
                        act = w0.model(x)
                    act = boundary.decode_forward(_fwd(boundary, act, boundary.first_hop(x, y)[1]), "me")[0]
                    g_live = boundary.decode_gradient(boundary.encode_gradient(input_gradient(a, act, y)), "me")
                    g_copy = boundary.decode_gradient(boundary.encode_gradient(input_gradient(b, act, y)), "me")
                    cos, ratio = agreement(g_live, g_copy)
                    neg = agreement(-g_live, g_copy)[0]
                    noise = agreement(torch.randn_like(g_live) * g_live.std(), g_copy)[0]
                    f_cos, f_ratio, first_ok = _forward_figures(run, boundary, firsts[step - lag], w0, x, y)
                    rows.append({"step": step, "lag": lag, "cosine": cos, "norm_ratio": ratio, "negated_cosine": neg,
                                 "noise_cosine": noise, "forward_cosine": f_cos, "forward_norm_ratio": f_ratio,
                                 "first_token_found": first_ok})
            print(f"step {step} ({time.monotonic() - t0:.0f} s): " + ", ".join(
                f"lag {lag}: cos {min(r['cosine'] for r in rows if r['step'] == step and r['lag'] == lag):.3f} "
                f"ratio {max(r['norm_ratio'] for r in rows if r['step'] == step and r['lag'] == lag):.2f}"
                for lag in lags if step - lag in copies), flush=True)
        if step == args.steps:
            break
        x, y = train.next()
        act = w0.forward(step, x)
        _, g = w1.forward_loss(step, act, y)
        assert g is not None
        w0.backward(step, g)
    summary = {str(lag): {"checks": len(rs), "cosine_min": min(r["cosine"] for r in rs),
                          "cosine_p50": sorted(r["cosine"] for r in rs)[len(rs) // 2],
                          "norm_ratio_max": max(r["norm_ratio"] for r in rs),
                          "negated_cosine_max": max(r["negated_cosine"] for r in rs),
                          "noise_cosine_max": max(abs(r["noise_cosine"]) for r in rs),
                          "forward_cosine_min": min(r["forward_cosine"] for r in rs),
                          "forward_norm_ratio_max": max(r["forward_norm_ratio"] for r in rs),
                          "first_token_found": sum(r["first_token_found"] for r in rs) / len(rs)}
               for lag in lags if (rs := [r for r in rows if r["lag"] == lag])}
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"command": "python tools/recheck_staleness.py " + " ".join(sys.argv[1:]),
                                         "run": run.name, "steps": args.steps, "summary": summary, "rows": rows},
                                        indent=1) + "\n")


def _forward_figures(run: RunConfig, boundary: Boundary, old: dict[str, torch.Tensor], w0: StageWorker,
                     x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
    """What a forward re-check from a stale copy of stage 0 would see: the cosine and norm ratio between the live
    stage's output (as received, int8) and the copy's for the same ids, and the share of sequences whose first token
    the copy recovers from the received position-0 activations (the targets give every other input id)."""
    copy = build_stage(run, 0)
    copy.load_state_dict(old)
    copy.eval()
    window = boundary.first_hop(x, y)[1]
    with torch.no_grad():
        live = boundary.decode_forward(_fwd(boundary, w0.model(x), window), "me")[0]
        ids = torch.cat([x[:, :1], y[:, :-1]], dim=1)  # the targets shifted back: x, given its first column
        table = copy(torch.arange(run.model.vocab_size).unsqueeze(1))[:, 0]  # [V, d]: position 0 of each token
        found = torch.cdist(live[:, 0], table).argmin(dim=1)
        ref = copy(ids)
    cos, ratio = agreement(boundary.sent(live, window), boundary.sent(ref, window))  # as the re-check compares them
    return cos, ratio, float((found == x[:, 0]).float().mean())


def _fwd(boundary: Boundary, act: torch.Tensor, window: torch.Tensor | None = None) -> Any:
    from protocol.messages import Forward

    env, tokens = boundary.encode_forward(act, window)
    return Forward(run_id="r", mb_id=0, route=["a"], activations=env, targets=None, is_eval=False, sent_at=0.0,
                   tokens=tokens)


# --- a middle stage --------------------------------------------------------------------------------------------------

#: what a hop may send on and return: honest, and the attacks (see the module's docstring)
CASES = ("honest", "identity", "noise", "negated", "other_seed", "other_seed_trained")


def _middle(args: argparse.Namespace, run: RunConfig) -> None:
    """Train every stage of ``run`` in one process and measure stage 1's re-check (see the module's docstring)."""
    lags = [int(v) for v in args.lags.split(",")]
    if args.measure_every % args.every:
        raise SystemExit("--measure-every must be a multiple of --every (the live stage is measured from its copy)")
    min_copy = math.ceil(PeerConfig().recheck_after_warmups * run.optim.warmup_steps)
    boundary = Boundary(run, None)
    corpus = load_corpus(run.data, run.model.vocab_size)
    train = BatchStream(corpus.train, run.model.block_size, run.data.batch_size, seed=1)
    fresh = BatchStream(corpus.train, run.model.block_size, run.data.batch_size, seed=2)
    workers = [StageWorker(run, s) for s in range(run.n_stages)]
    fresh_impostor = build_stage(run, 1, run.seed + 1).requires_grad_(False).eval()
    trained = None if args.no_trained_impostor else StageWorker(run, 1, seed=run.seed + 1)

    def fwd_hop(act: torch.Tensor, window: torch.Tensor | None) -> torch.Tensor:
        return boundary.decode_forward(_fwd(boundary, act, window), "me")[0]

    def grad_hop(g: torch.Tensor) -> torch.Tensor:
        return boundary.decode_gradient(boundary.encode_gradient(g), "me")

    copies: dict[int, dict[str, torch.Tensor]] = {}
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for step in range(args.steps + 1):
        if step % args.every == 0:
            copies[step] = {k: v.detach().clone() for k, v in workers[1].model.state_dict().items()}
        if step % args.measure_every == 0 and step > 0:
            olds = {lag: copies[step - lag] for lag in lags if step - lag in copies}
            impostors: dict[str, StageBase] = {"other_seed": fresh_impostor}
            if trained is not None:
                impostors["other_seed_trained"] = trained.model
            for m in [w.model for w in workers] + list(impostors.values()):
                m.eval()
            try:
                for _ in range(args.batches):
                    rows += _middle_checks(run, boundary, workers, impostors, olds, *fresh.next(), n_rows=args.rows,
                                           fwd_hop=fwd_hop, grad_hop=grad_hop, step=step)
            finally:
                for m in [w.model for w in workers] + list(impostors.values()):
                    m.train()
            fresh_impostor.eval()
            here = [r for r in rows if r["step"] == step]
            print(f"step {step} ({time.monotonic() - t0:.0f} s): " + ", ".join(
                f"lag {lag}: act cos {min(r['act_cos'] for r in rs):.3f} ratio {max(r['act_ratio'] for r in rs):.2f}"
                f" grad cos {min(r['grad_cos'] for r in rs):.3f} ratio {max(r['grad_ratio'] for r in rs):.2f}"
                for lag in olds if (rs := [r for r in here if r["lag"] == lag and r["case"] == "honest"])) +
                  "; attacks' best cos " + ", ".join(
                f"{case} {max(min(r['act_cos'], r['grad_cos']) for r in rs):.3f}"
                for case in CASES[1:] if (rs := [r for r in here if r["case"] == case])), flush=True)
        if step == args.steps:
            break
        _train_step(workers, trained, boundary, step, *train.next(), fwd_hop=fwd_hop, grad_hop=grad_hop)
    cfg = RecheckConfig()
    middle = {"stage": 1, "n_stages": run.n_stages, "n_layer": run.model.n_layer, "rows_per_check": args.rows,
              "batches": args.batches, "min_copy_step": min_copy, "wall_s": round(time.monotonic() - t0, 1),
              "thresholds": {"min_cosine": cfg.min_cosine, "max_norm_ratio": cfg.max_norm_ratio},
              "summary": _middle_summary(rows, lags, min_copy, cfg),
              "early_copies": _middle_summary([r for r in rows if r["case"] == "honest"], lags, -1, cfg,
                                              below=min_copy),
              "separation": _separation(rows, min_copy), "rows": rows}
    print(f"copies of step >= {min_copy}; honest: lowest cosine / largest norm ratio, activations | gradients; "
          "attacks: highest verdict cosine (the lower half's)")
    for lag, per in middle["summary"].items():
        h = per.get("honest")
        if h is None:
            continue
        print(f"lag {lag:>5}: {h['checks']:3d} checks, act {h['act_cos_min']:.3f} / {h['act_ratio_max']:.2f} | grad "
              f"{h['grad_cos_min']:.3f} / {h['grad_ratio_max']:.2f}, failing {h['failing']:.2f}; attacks " +
              ", ".join(f"{case} {f['cos_max']:.3f}" for case, f in per.items() if case != "honest"))
    print(json.dumps(middle["separation"], indent=1))
    if args.json:
        args.json.write_text(json.dumps({"command": "python tools/recheck_staleness.py " + " ".join(sys.argv[1:]),
                                         "run": run.name, "steps": args.steps, "middle": middle}, indent=1) + "\n")


def _train_step(workers: list[StageWorker], trained: StageWorker | None, boundary: Boundary, step: int,
                x: torch.Tensor, y: torch.Tensor, *, fwd_hop: Callable[[torch.Tensor, torch.Tensor | None],
                                                                       torch.Tensor],
                grad_hop: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """One micro-batch through every stage, each hop through the wire's codecs; ``trained`` (a stage 1 of another
    seed) trains on stage 1's input and on the gradient the downstream stages give its own output (they do not
    train on it)."""
    window = boundary.first_hop(x, y)[1]
    inputs = [fwd_hop(workers[0].forward(step, x), window)]
    for w in workers[1:-1]:
        inputs.append(fwd_hop(w.forward(step, inputs[-1]), window))
    _, g = workers[-1].forward_loss(step, inputs[-1], y)
    for w in reversed(workers[:-1]):
        assert g is not None
        g = w.backward(step, grad_hop(g))
    if trained is not None:
        out = fwd_hop(trained.forward(step, inputs[0]), window)
        trained.backward(step, _downstream(workers[2:], out, y, window, fwd_hop=fwd_hop, grad_hop=grad_hop))


def _downstream(stages: Sequence[StageWorker], x: torch.Tensor, y: torch.Tensor, window: torch.Tensor | None, *,
                fwd_hop: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
                grad_hop: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The gradient the stages after a hop return for what it sent on (``x``, as the first of them decoded it), as
    the hop decodes it: forward to the loss, back to ``x``, every hop through the codecs; no weight changes."""
    inputs = [x]
    with torch.no_grad():
        for w in stages[:-1]:
            inputs.append(fwd_hop(w.model(inputs[-1]), window))
    g = input_gradient(stages[-1].model, inputs[-1], y)
    for w, xin in zip(reversed(stages[:-1]), reversed(inputs[:-1]), strict=True):
        g = middle_reference(w.model, xin, grad_hop(g))[1]
    return grad_hop(g)


def _middle_checks(run: RunConfig, boundary: Boundary, workers: list[StageWorker], impostors: dict[str, StageBase],
                   olds: dict[int, dict[str, torch.Tensor]], x: torch.Tensor, y: torch.Tensor, *, n_rows: int,
                   fwd_hop: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
                   grad_hop: Callable[[torch.Tensor], torch.Tensor], step: int) -> list[dict[str, Any]]:
    """One fresh micro-batch: for the live stage 1 and each attack, what it sent on (as the witness decoded it), the
    witness's gradient for that, and what it returned (as stage 0 decoded it), judged by every old copy on
    ``n_rows`` random rows as ``MiddleRechecks`` does."""
    live, down = workers[1].model, workers[2:]
    window = boundary.first_hop(x, y)[1]
    with torch.no_grad():
        xin = fwd_hop(workers[0].model(x), window)  # stage 1's input, as stage 0 sent it and stage 1 decoded it

    def returned(module: StageBase, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(what the witness received, its gradient, what the hop returned) for a hop computing with ``module``."""
        received = fwd_hop(out, window)
        g_out = _downstream(down, received, y, window, fwd_hop=fwd_hop, grad_hop=grad_hop)
        return received, g_out, grad_hop(middle_reference(module, xin, g_out)[1])

    def per_row_like(noise: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``noise`` scaled to ``like``'s norm, row by row."""
        norm = torch.linalg.vector_norm
        scale: torch.Tensor = norm(like.flatten(1), dim=1) / norm(noise.flatten(1), dim=1)
        return noise * scale.view(-1, 1, 1)

    with torch.no_grad():
        y_live = live(xin)
    cases: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {"honest": returned(live, y_live)}
    received = fwd_hop(xin, window)  # identity: the input passed on, the gradient passed back
    g_out = _downstream(down, received, y, window, fwd_hop=fwd_hop, grad_hop=grad_hop)
    cases["identity"] = (received, g_out, grad_hop(g_out))
    received = fwd_hop(xin + per_row_like(torch.randn_like(xin), y_live - xin), window)
    g_out = _downstream(down, received, y, window, fwd_hop=fwd_hop, grad_hop=grad_hop)
    added = middle_reference(live, xin, g_out)[1] - g_out  # what the live stage would add to this gradient
    cases["noise"] = (received, g_out, grad_hop(g_out + per_row_like(torch.randn_like(g_out), added)))
    received = fwd_hop(xin - (y_live - xin), window)
    g_out = _downstream(down, received, y, window, fwd_hop=fwd_hop, grad_hop=grad_hop)
    cases["negated"] = (received, g_out, grad_hop(g_out - (middle_reference(live, xin, g_out)[1] - g_out)))
    for name, module in impostors.items():
        with torch.no_grad():
            cases[name] = returned(module, module(xin))
    rows = torch.randperm(x.shape[0])[:n_rows].tolist()
    ids = None if window is None else window[rows, :-1]
    out: list[dict[str, Any]] = []
    for lag, state in olds.items():
        copy = build_stage(run, 1)
        copy.load_state_dict(state)
        copy.requires_grad_(False).eval()
        for case, (received, g_out, ret) in cases.items():
            c_out, c_grad = middle_reference(copy, xin[rows], g_out[rows])
            (a_cos, a_ratio), (g_cos, g_ratio) = middle_agreement(
                xin[rows], received[rows], as_carried(boundary, c_out, ids), g_out[rows], ret[rows],
                as_carried(boundary, c_grad, gradient=True))
            out.append({"step": step, "lag": lag, "copy_step": step - lag, "case": case, "act_cos": a_cos,
                        "act_ratio": a_ratio, "grad_cos": g_cos, "grad_ratio": g_ratio})
    return out


def _middle_summary(rows: list[dict[str, Any]], lags: list[int], min_copy: int, cfg: RecheckConfig, *,
                    below: int | None = None) -> dict[str, Any]:
    """Per lag and case: the checks, the quantiles of each figure, of the verdict's (the lower cosine and the
    larger ratio of the two halves) and the share failing ``cfg``'s thresholds; copies of step >= ``min_copy``
    (``below``: of step < it instead)."""
    out: dict[str, Any] = {}
    for lag in lags:
        per: dict[str, Any] = {}
        for case in CASES:
            rs = [r for r in rows if r["lag"] == lag and r["case"] == case and
                  (r["copy_step"] < below if below is not None else r["copy_step"] >= min_copy)]
            if not rs:
                continue
            fig: dict[str, Any] = {"checks": len(rs)}
            for name in ("act_cos", "act_ratio", "grad_cos", "grad_ratio"):
                fig.update(quantiles(name, [r[name] for r in rs]))
            fig.update(quantiles("cos", [min(r["act_cos"], r["grad_cos"]) for r in rs]))
            fig.update(quantiles("ratio", [max(r["act_ratio"], r["grad_ratio"]) for r in rs]))
            fig["failing"] = sum(min(r["act_cos"], r["grad_cos"]) < cfg.min_cosine or
                                 max(r["act_ratio"], r["grad_ratio"]) > cfg.max_norm_ratio for r in rs) / len(rs)
            per[case] = fig
        if per:
            out[str(lag)] = per
    return out


def _separation(rows: list[dict[str, Any]], min_copy: int) -> dict[str, Any]:
    """Over every lag, copies of step >= ``min_copy``: the honest checks' lowest cosines and largest norm ratios,
    and per attack the highest cosine (the verdict's: the lower of its two halves) and the ratio of that check."""
    rows = [r for r in rows if r["copy_step"] >= min_copy]
    honest = [r for r in rows if r["case"] == "honest"]
    out: dict[str, Any] = {"honest": {"checks": len(honest)}}
    if honest:
        out["honest"].update({"act_cos_min": min(r["act_cos"] for r in honest),
                              "grad_cos_min": min(r["grad_cos"] for r in honest),
                              "act_ratio_max": max(r["act_ratio"] for r in honest),
                              "grad_ratio_max": max(r["grad_ratio"] for r in honest)})
    for case in CASES[1:]:
        rs = [r for r in rows if r["case"] == case]
        if not rs:
            continue
        best = max(rs, key=lambda r: min(r["act_cos"], r["grad_cos"]))
        out[case] = {"checks": len(rs), "act_cos_max": max(r["act_cos"] for r in rs),
                     "grad_cos_max": max(r["grad_cos"] for r in rs),
                     "cos_max": min(best["act_cos"], best["grad_cos"]),
                     "ratio_at_cos_max": max(best["act_ratio"], best["grad_ratio"]),
                     "act_ratio_min": min(r["act_ratio"] for r in rs),
                     "grad_ratio_min": min(r["grad_ratio"] for r in rs)}
    return out


if __name__ == "__main__":
    main()
