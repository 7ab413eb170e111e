#!/usr/bin/env python3
"""Peak memory of one stage's worker, measured, against trainer/memory.py's estimate.

One process, one stage: the worker is built, ``--inflight`` micro-batches are forwarded and kept pending, then for
``--steps`` rounds the oldest is backwarded (with a random output gradient; the worker steps after each) and a new
one is forwarded, so the weight stash holds what a pipeline in flight makes it hold; ``rounds_per_tick`` averaging
rounds are begun at the start and finished at the end (their snapshots live throughout). The last stage forwards
and backwards each micro-batch at once.

Speed: tokens per second over the timed steps (after the ``--inflight`` warm-up forwards), and with
``--peak-tflops`` (the device's dense peak at the precision used, e.g. 989 for an H100 SXM in bf16) the model FLOPs
utilisation, MFU = 6 x stage parameters x tokens/s / peak (the usual 6N per token; the worker's recompute adds 2N
more on every stage but the last, which MFU does not credit).

Measured memory: on CUDA ``torch.cuda.max_memory_allocated`` (what the estimate's ``device`` column predicts); on
the CPU the growth of the peak resident set size over the process before the worker was built (what ``device + host``
predicts; it also counts the allocator's slack and what torch loads on first use, tens of MB: meaningful for stages of
hundreds of MB, not for the tiny test runs).

    python tools/bench_memory.py --stage 0 --precision fp32 --device cpu --json out.json
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.config import RunConfig  # noqa: E402
from trainer.memory import estimate_stage  # noqa: E402
from trainer.worker import StageWorker, resolve_precision  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", default=None, help="run TOML (default: the embedded default run)")
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--inflight", type=int, default=0, help="micro-batches in flight (default n_stages + 1)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--peak-tflops", type=float, default=0.0, help="the device's peak, for MFU (0: no MFU)")
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args()
    run = RunConfig.from_toml(args.run) if args.run else RunConfig.default()
    precision = resolve_precision(args.precision, args.device)
    inflight = args.inflight or run.n_stages + 1
    est = estimate_stage(run, args.stage, precision=precision, inflight=inflight)
    cuda = args.device.startswith("cuda")
    b, t, c = run.data.batch_size, run.model.block_size, run.model.n_embd
    gen = torch.Generator().manual_seed(0)

    def stage_input() -> torch.Tensor:
        if args.stage == 0:
            return torch.randint(0, run.model.vocab_size, (b, t), generator=gen)
        return torch.randn(b, t, c, generator=gen)

    base = rss_bytes()
    if peak_rss_bytes() > base and not cuda:  # the peak so far is above now: measure growth over the peak instead
        base = peak_rss_bytes()
    t0 = time.perf_counter()
    worker = StageWorker(run, args.stage, device=args.device, precision=precision)
    rounds = list(range(run.averaging.rounds_per_tick)) if worker.averaging is not None else []
    sent = {r: worker.averaging_begin(r) for r in rounds}
    if worker.is_last:
        targets = torch.randint(0, run.model.vocab_size, (b, t), generator=gen)
        worker.forward_loss(0, stage_input(), targets)  # warm-up
        timed = time.perf_counter()
        for mb in range(1, args.steps + 1):
            worker.forward_loss(mb, stage_input(), targets)
    else:
        for mb in range(inflight):
            worker.forward(mb, stage_input())
        timed = time.perf_counter()
        for k in range(args.steps):
            worker.backward(k, torch.randn(b, t, c, generator=gen).to(args.device) * 1e-3)
            worker.forward(inflight + k, stage_input())
    if cuda:
        torch.cuda.synchronize()
    tokens_per_s = args.steps * b * t / (time.perf_counter() - timed)
    for r in rounds:
        worker.averaging_finish(r, sent[r])
    if cuda:
        measured, predicted = torch.cuda.max_memory_allocated(args.device), est.device_bytes
    else:
        measured, predicted = peak_rss_bytes() - base, est.total_bytes
    result = {"run": run.name, "stage": args.stage, "precision": precision, "device": args.device,
              "inflight": inflight, "steps": args.steps, "estimate": est.as_dict(), "predicted_bytes": predicted,
              "measured_bytes": measured, "measured_over_predicted": measured / predicted,
              "tokens_per_s": tokens_per_s,
              "mfu": 6 * est.params * tokens_per_s / (args.peak_tflops * 1e12) if args.peak_tflops > 0 else None,
              "seconds": time.perf_counter() - t0, "torch": torch.__version__}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
