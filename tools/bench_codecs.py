"""Benchmark the wire codecs: compression ratio, relative error on three kinds of data, encode/decode speed.

For each codec: ratio = fp32 bytes / envelope bytes (headers included) on an 8x128x128 tensor; relative L2 error
||decode(encode(x)) - x|| / ||x|| on (a) Gaussian data, (b) Gaussian data where 0.1 % of the entries are 50x larger
(outliers), (c) a real activation: the output of stage 0 of RunConfig.default() (freshly initialised with the run
seed) on a batch of the run's own text; and encode / decode throughput in MB/s of fp32 input (1 MB = 1e6 bytes) on
one CPU thread through the full encode()/decode() path (payload bytes and validation included), on a --size-mib
tensor, the median (or with --stat best the fastest) of --repeats runs, timed by the wall clock (or with --clock cpu
by this thread's CPU time, for hosts where other processes compete for the cores).

    python tools/bench_codecs.py --json docs/protocol_codecs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from protocol.codecs.registry import decode, encode  # noqa: E402

CODECS = {"none": "none", "fp16": "fp16", "bf16": "bf16", "int8": "int8", "int4": "int4", "int3": "int3", "ecq": "ecq",
          "topk": "topk:0.01"}


def rel_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx.float() - exact.float()).norm() / exact.float().norm())


def real_activation(seed: int) -> torch.Tensor:
    """Stage 0 output of the default run on real text: [batch_size, block_size, n_embd]."""
    from trainer.config import RunConfig
    from trainer.data import BatchStream, load_corpus
    from trainer.model import build_stage

    run = RunConfig.default()
    corpus = load_corpus(run.data, run.model.vocab_size)
    x, _ = BatchStream(corpus.train, run.model.block_size, run.data.batch_size, seed).next()
    with torch.no_grad():
        return build_stage(run, 0).eval()(x)


def datasets(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gaussian = torch.randn(8, 128, 128, generator=gen)
    outliers = torch.randn(8, 128, 128, generator=gen)
    picks = torch.randperm(outliers.numel(), generator=gen)[: outliers.numel() // 1000]
    outliers.view(-1)[picks] *= 50
    return {"gaussian": gaussian, "outliers": outliers, "activation": real_activation(seed)}


def throughput(
    codec: str, x: torch.Tensor, repeats: int, stat: str = "median", clock: str = "wall"
) -> tuple[float, float]:
    now = time.thread_time if clock == "cpu" else time.perf_counter
    enc, dec = [], []
    for _ in range(repeats):
        start = now()
        env = encode(x, codec)
        mid = now()
        decode(env, peer="bench")
        end = now()
        enc.append(mid - start)
        dec.append(end - mid)
    pick = min if stat == "best" else statistics.median
    mb = x.numel() * 4 / 1e6
    return mb / pick(enc), mb / pick(dec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results to this JSON file")
    parser.add_argument("--size-mib", type=int, default=64, help="fp32 tensor size for the throughput runs (MiB)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per codec (the median is reported)")
    parser.add_argument("--stat", choices=("median", "best"), default="median",
                        help="time to report: the median run, or the fastest (closer to an idle core on a busy host)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: elapsed time; cpu: this thread's CPU time (user+sys), which leaves out the time "
                             "a busy host kept us waiting for a core")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.size_mib < 1 or args.repeats < 1:
        parser.error("--size-mib and --repeats must be positive")

    torch.set_num_threads(1)
    data = datasets(args.seed)
    big = torch.randn(args.size_mib * 2**18, generator=torch.Generator().manual_seed(args.seed))
    results: dict[str, dict[str, float]] = {}
    for name, codec in CODECS.items():
        env = encode(data["gaussian"], codec)
        row = {"ratio": data["gaussian"].numel() * 4 / env.wire_bytes}
        for kind, x in data.items():
            row[f"rel_error_{kind}"] = rel_error(decode(encode(x, codec), peer="bench"), x)
        row["encode_mb_s"], row["decode_mb_s"] = throughput(codec, big, args.repeats, args.stat, args.clock)
        results[name] = row

    columns = ("ratio", "err gauss", "err outl", "err act", "enc MB/s", "dec MB/s")
    header = f"{'codec':<6} " + " ".join(f"{c:>10}" for c in columns)
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        print(
            f"{name:<6} {r['ratio']:>9.2f}x {r['rel_error_gaussian']:>10.2e} {r['rel_error_outliers']:>10.2e} "
            f"{r['rel_error_activation']:>10.2e} {r['encode_mb_s']:>10.0f} {r['decode_mb_s']:>10.0f}"
        )
    int8 = results["int8"]
    both = 1 / (1 / int8["encode_mb_s"] + 1 / int8["decode_mb_s"])
    print(f"\nint8 encode+decode: {both:.0f} MB/s on one thread ({args.size_mib} MiB fp32 tensor, {args.stat} of "
          f"{args.repeats} runs, {args.clock} clock)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"codecs": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
