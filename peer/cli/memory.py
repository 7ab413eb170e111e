"""`asyncmesh-peer memory`: how much memory each stage of a run needs, in fp32 and with bf16 autocast.

It prints trainer/memory.py's estimate per stage and precision, part by part, so an organiser can size a run, and
then which stages this machine can hold, as ``join`` would decide (peer/budget.py: the GPU's free memory, the
available RAM, or ``--memory-gb``). Nothing is allocated: the stages are built on the ``meta`` device.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from peer.config import DEVICES, Device
from peer.errors import UserError, user_input

if TYPE_CHECKING:
    from trainer.memory import StageMemory

HELP = "Print the memory each stage of a run needs (weights, optimiser, stash, averaging, activations), fp32 and bf16."
EPILOG = """examples:
  asyncmesh-peer memory                       # the embedded default run
  asyncmesh-peer memory --run myrun.toml --inflight 8
  asyncmesh-peer memory --run myrun.toml --device cpu --memory-gb 16   # what fits in 16 GiB
  asyncmesh-peer memory --run myrun.toml --json
The GPU must hold 'device'; a CPU peer 'device' + 'host'. With re-checks on (the default) a peer also builds the
held copies it re-checks its neighbours' work with on its device: 'copies' (counted in the last line, not in
'device'). join adds 15 % headroom when it decides what fits."""

COLUMNS = (("weights", "weights"), ("grads", "grads"), ("optimizer", "optim"), ("stash", "stash"),
           ("averaging", "avg"), ("inputs", "inputs"), ("backward", "backward"), ("subspace", "subspace"),
           ("device_bytes", "device"),
           ("host", "host"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", default=None, metavar="FILE", help="run TOML (default: the embedded default run)")
    p.add_argument("--inflight", type=int, default=0, metavar="N",
                   help="micro-batches in flight (default n_stages + 1, as join's max_inflight)")
    p.add_argument("--device", default=Device.AUTO.value, choices=DEVICES,
                   help="the device whose memory to check the stages against (default: cuda when available)")
    p.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"),
                   help="precision join would use (default: bf16 on CUDA, fp32 on the CPU)")
    p.add_argument("--memory-gb", type=float, default=0.0, metavar="GIB",
                   help="check against this much memory instead of what the device has free")
    p.add_argument("--json", action="store_true", help="print the estimates as JSON")


def mib(n: int) -> str:
    if n >= 1000 * 2**20:
        return f"{n / 2**20:.0f}"
    return f"{n / 2**20:.1f}" if n >= 2**20 or n == 0 else f"{n / 2**20:.2f}"


def table(estimates: list[StageMemory], copies: tuple[int, ...] = ()) -> str:
    """The estimates as a text table, one row per stage and precision, in MiB; ``copies``: per stage, the held
    copies its re-checks build on the device (a column of its own when given)."""
    head = ["stage", "prec", "params"] + [label for _, label in COLUMNS] + (["copies"] if copies else [])
    rows = [head]
    for e in estimates:
        d = e.as_dict()
        rows.append([str(e.stage), e.precision, f"{e.params / 1e6:.2f}M"] + [mib(int(d[k])) for k, _ in COLUMNS]
                    + ([mib(copies[e.stage])] if copies else []))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from peer.budget import plan
    from trainer.config import RunConfig
    from trainer.memory import HEADROOM, estimate_run
    from trainer.worker import resolve_device, resolve_precision

    if args.inflight < 0:
        raise UserError(f"--inflight must be >= 0 (0: n_stages + 1), got {args.inflight}")
    with user_input():
        run_cfg = RunConfig.from_toml(args.run) if args.run else RunConfig.default()
    if args.memory_gb < 0:
        raise UserError(f"--memory-gb must be >= 0 (0: what the device has free), got {args.memory_gb}")
    with user_input("--device"):
        device = resolve_device(args.device)
    inflight = args.inflight or run_cfg.n_stages + 1
    estimates = estimate_run(run_cfg, inflight=inflight)
    precision = resolve_precision(args.precision, device)
    here = plan(run_cfg, device=device, precision=precision, inflight=inflight, memory_gb=args.memory_gb)
    if args.json:
        print(json.dumps({"run": run_cfg.name, "run_id": run_cfg.run_id, "inflight": inflight,
                          "stages": [e.as_dict() for e in estimates], "copies_bytes": list(here.copy_bytes),
                          "here": here.as_dict()}, indent=2))
        return 0
    print(f"run {run_cfg.name!r} ({run_cfg.run_id}): {run_cfg.n_stages} stages, batch {run_cfg.data.batch_size} x "
          f"{run_cfg.model.block_size} tokens, {inflight} micro-batches in flight; MiB")
    print(table(estimates, here.copy_bytes))
    fitting = here.fitting or ()
    print(f"this machine ({device}, {precision}): may use {here.describe_limit()}; with "
          f"{round(HEADROOM * 100 - 100)} % headroom it can serve "
          + (f"stage{'s' if len(fitting) > 1 else ''} {', '.join(map(str, fitting))}" if fitting else "no stage"))
    return 0
