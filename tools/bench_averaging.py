"""What one averaging round costs the compute thread, against one training step, at several stage sizes.

The compute thread of a peer runs a round's two halves (``StageWorker.averaging_begin``: gather the slice of the
round's partition; ``averaging_finish``: apply the run's rule to it) between the micro-batches it trains on; the
partition itself is drawn ahead on another thread (``averaging_prepare``, timed apart as ``prepare_ms_off_thread``).
A round that costs a sizeable share of a step slows training down, and one that costs more than the round's window
(docs/design.md, "When rounds happen") makes rounds time out. This tool times both halves (median over several
consecutive rounds, so cycle boundaries are included; interleaved with the steps, so that both see the same load)
and one training step of the same stage (forward, backward with its recompute, optimiser step; stage 0 of two, on
the CPU or ``--device cuda``, at the run's micro-batch size) at stages of about 0.4 M, 4 M and 40 M parameters, with
the embedded default run's averaging (rule, p, round_steps). The round's aggregate is built on the host, where the
daemon decodes the partners' parts, and placed as the daemon does (``averaging_place``: checked finite and moved onto
the device on a worker thread, timed apart as ``place_ms_off_thread``); ``round_ms_unplaced`` times rounds whose
aggregate goes to the finish as decoded, which then checks and moves it itself. It also counts the torch operators
one round issues (``ops_per_round``; ``data_ops_per_round`` leaves out those that only make a view; on a GPU
``kernels_per_round``), which on a GPU are kernel launches: the count does not depend on the machine's clock or load.

    python tools/bench_averaging.py --json docs/bench/averaging_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from trainer.averaging import Placed
from trainer.config import RunConfig
from trainer.worker import StageWorker

SIZES = {  # name -> model overrides (n_layer over 2 stages: stage 0 holds 2 blocks and the embeddings)
    "0.4M": {"n_layer": 4, "n_embd": 128, "n_head": 4},
    "4M": {"n_layer": 4, "n_embd": 384, "n_head": 6},
    "40M": {"n_layer": 4, "n_embd": 1280, "n_head": 10},
}


def _ms(fn, device: str = "cpu") -> float:
    """Milliseconds the compute thread spends in ``fn``. On the CPU: this thread's CPU time (torch runs on it with
    --threads 1; on a shared machine wall time mostly measures the neighbours). On a GPU: wall time with the device
    synchronised before and after, so the kernels ``fn`` queued are counted."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) * 1e3
    t0 = time.thread_time()
    fn()
    return (time.thread_time() - t0) * 1e3


# ops that only make a new view or an empty tensor: no kernel, no pass over memory
_METADATA_OPS = frozenset({
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::slice", "aten::select", "aten::split",
    "aten::split_with_sizes", "aten::narrow", "aten::unsqueeze", "aten::squeeze", "aten::detach", "aten::alias",
    "aten::as_strided", "aten::expand", "aten::t", "aten::transpose", "aten::empty", "aten::empty_strided",
    "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg", "aten::is_nonzero", "aten::item",
    "aten::_local_scalar_dense"})


def count_ops(fn: Callable[[], object], device: str = "cpu") -> dict[str, int]:
    """The torch operators ``fn`` issues (the outermost ones: an operator another calls is part of it), those that
    touch data (not a view or an empty tensor), and on a GPU the kernels it launches: what a round costs in launches,
    whatever the clock of the machine measuring it."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=acts) as prof:
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
    events = prof.events()
    top = [e for e in events if e.name.startswith("aten::") and (
        e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    out = {"ops": len(top), "data_ops": sum(1 for e in top if e.name not in _METADATA_OPS)}
    if device.startswith("cuda"):
        out["kernels"] = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return out


def measure(run: RunConfig, *, rounds: int, steps: int, device: str = "cpu") -> dict:
    """Round and step times (ms) of stage 0 of ``run`` on ``device``."""
    w = StageWorker(run, 0, device=device)
    params = sum(p.numel() for p in w.parameters())
    b, t = run.data.batch_size, run.model.block_size
    x = torch.randint(0, run.model.vocab_size, (b, t), device=device)
    grad_y = torch.randn(b, t, run.model.n_embd, device=device) * 1e-3

    def step(i: int) -> None:
        w.forward(i, x)
        w.backward(i, grad_y)  # auto_step: the optimiser steps after the backward

    def round_(r: int, *, placed: bool = True) -> tuple[float, float, float, float, int]:
        box: list[list[torch.Tensor]] = []
        p_ms = _ms(lambda: w.averaging_prepare(r), device)  # the daemon draws it on another thread than the compute's
        b_ms = _ms(lambda: box.append(w.averaging_begin(r)), device)
        # the aggregate as the daemon has it: decoded from the parts on the host, then moved onto the device on a
        # worker thread (averaging_place) before the compute thread's finish; placed=False hands it over on the host
        mean = [v.cpu() + 1e-3 * torch.randn(v.shape, generator=gen) for v in box[0]]
        held: list[list[torch.Tensor] | Placed] = [mean]
        m_ms = _ms(lambda: held.__setitem__(0, w.averaging_place(mean)), device) if placed else 0.0
        w.local_step += 1  # a step between begin and finish, as in a real round
        f_ms = _ms(lambda: w.averaging_finish(r, held[0]), device)
        return p_ms, b_ms, m_ms, f_ms, sum(v.numel() for v in box[0])

    gen = torch.Generator().manual_seed(0)
    step(-1)  # warm-up: allocations, optimiser state
    round_(0)
    step_ms, prepare_ms, begin_ms, place_ms, finish_ms, slice_sizes = [], [], [], [], [], []
    host_ms: list[float] = []  # the round with the aggregate handed to the finish as decoded, not placed
    r = 0
    for i in range(max(rounds, steps)):  # interleaved, so that both see the same load on a shared machine
        if i < steps:
            step_ms.append(_ms(lambda i=i: step(i), device))
        if i < rounds:
            r += 1
            p_ms, b_ms, m_ms, f_ms, n = round_(r)
            prepare_ms.append(p_ms)
            begin_ms.append(b_ms)
            place_ms.append(m_ms)
            finish_ms.append(f_ms)
            slice_sizes.append(n)
            r += 1
            _, hb_ms, _, hf_ms, _ = round_(r, placed=False)
            host_ms.append(hb_ms + hf_ms)
    # one more round, profiled apart from the timed ones (the profiler slows what it watches)
    r += 1
    w.averaging_prepare(r)
    box: list[list[torch.Tensor]] = []
    ops = count_ops(lambda: box.append(w.averaging_begin(r)), device)
    mean = w.averaging_place([v.cpu() + 1e-3 for v in box[0]])
    w.local_step += 1
    for k, v in count_ops(lambda: w.averaging_finish(r, mean), device).items():
        ops[k] += v
    begin, finish = statistics.median(begin_ms), statistics.median(finish_ms)
    step_med = statistics.median(step_ms)
    return {"params": params, "slice": int(statistics.median(slice_sizes)), "round_ms": round(begin + finish, 2),
            "begin_ms": round(begin, 2), "finish_ms": round(finish, 2),
            "prepare_ms_off_thread": round(statistics.median(prepare_ms), 2),
            "place_ms_off_thread": round(statistics.median(place_ms), 2),
            "round_ms_unplaced": round(statistics.median(host_ms), 2),
            "round_ms_max": round(
                max(a + b for a, b in zip(begin_ms, finish_ms, strict=True)), 2),
            "step_ms": round(step_med, 1), "round_share_of_step": round((begin + finish) / step_med, 4),
            "tensors": len(w.parameters()), **{f"{k}_per_round": v for k, v in ops.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--rounds", type=int, default=6, help="rounds timed per size (median)")
    ap.add_argument("--steps", type=int, default=3, help="training steps timed per size (median)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: the thread's CPU time is all the work; more would run on other threads)")
    ap.add_argument("--device", default="cpu", help="torch device of the stage ('cpu', 'cuda', 'cuda:1')")
    ap.add_argument("--json", type=Path, help="write the result here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = RunConfig.default()
    load_before = os.getloadavg()
    sizes = []
    for name in args.sizes:
        run = base.replace(model=SIZES[name])
        res = {"size": name, **measure(run, rounds=args.rounds, steps=args.steps, device=args.device)}
        print(json.dumps(res), flush=True)
        sizes.append(res)
    out = {
        "command": "python tools/bench_averaging.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "averaging": {"rule": base.averaging.rule, "fraction": base.averaging.fraction,
                      "round_steps": base.averaging.round_steps, "round_fraction": base.averaging.round_fraction},
        "batch": [base.data.batch_size, base.model.block_size],
        "clock": ("wall time with the GPU synchronised before and after" if args.device.startswith("cuda") else
                  "CPU time of the calling thread (time.thread_time), torch on that one thread"),
        "device": args.device if not args.device.startswith("cuda") else torch.cuda.get_device_name(args.device),
        "machine": {"cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "python": platform.python_version(), "loadavg_before": load_before,
                    "loadavg_after": os.getloadavg()},
        "sizes": sizes,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
