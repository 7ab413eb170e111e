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
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from peer.pipeline.boundary import Boundary  # noqa: E402
from peer.pipeline.recheck import input_gradient  # noqa: E402
from peer.pipeline.spotcheck import agreement  # noqa: E402
from trainer.config import RunConfig  # noqa: E402
from trainer.data import BatchStream, load_corpus  # noqa: E402
from trainer.model import build_stage  # noqa: E402
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
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    run = RunConfig.from_toml(args.run) if args.run else RunConfig.default()
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
                    act = boundary.decode_forward(_fwd(boundary, act), "me")[0]
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
    with torch.no_grad():
        live = boundary.decode_forward(_fwd(boundary, w0.model(x)), "me")[0]
        ids = torch.cat([x[:, :1], y[:, :-1]], dim=1)  # the targets shifted back: x, given its first column
        table = copy(torch.arange(run.model.vocab_size).unsqueeze(1))[:, 0]  # [V, d]: position 0 of each token
        found = torch.cdist(live[:, 0], table).argmin(dim=1)
        ref = copy(ids)
    cos, ratio = agreement(live, ref)
    return cos, ratio, float((found == x[:, 0]).float().mean())


def _fwd(boundary: Boundary, act: torch.Tensor) -> Any:
    from protocol.messages import Forward

    env, tokens = boundary.encode_forward(act, None)
    return Forward(run_id="r", mb_id=0, route=["a"], activations=env, targets=None, is_eval=False, sent_at=0.0,
                   tokens=tokens)


if __name__ == "__main__":
    main()
