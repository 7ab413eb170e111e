"""Train one ad-hoc variant of a simulator method: change its optimiser, stashing or averaging and print its curve.

For ablations that the named methods do not cover, e.g. the bisection of ``full-avg`` in docs/convergence.md:

    python tools/sim_variant.py --steps 400 --tau 0 --rule avg --fraction 1 --optimizer adamw --beta1 0.9
    python tools/sim_variant.py --steps 400 --tau 0 --rule avg --fraction 1 --no-stashing
    python tools/sim_variant.py --steps 400 --tau 0 --rule avg --fraction 1 --stages 1

The variant runs the asynchronous 1F1B schedule of trainer/sim/simulator.py on the chosen preset (default: paper) with
parameter averaging by ``--rule`` (or gradient all-reduce with ``--rule grad``) and prints the validation loss at
each evaluation.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.rules import RULES  # noqa: E402
from trainer.sim.methods import METHODS, Combine, MethodSpec  # noqa: E402
from trainer.sim.presets import PRESETS, preset, with_overrides  # noqa: E402
from trainer.sim.simulator import run_method  # noqa: E402

NAME = "variant"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=PRESETS, default="paper")
    p.add_argument("--steps", type=int, default=400, help="micro-batches per replica")
    p.add_argument("--stages", type=int, default=None, help="pipeline stages (default: the preset's)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--optimizer", choices=("nadam", "adamw"), default="nadam")
    p.add_argument("--beta1", type=float, default=0.99)
    p.add_argument("--stashing", action=argparse.BooleanOptionalAction, default=True, help="weight stashing")
    p.add_argument("--rule", choices=("grad", *(name for name, rule in RULES.items() if rule.averages)),
                   default="ema", help="'grad': gradient all-reduce every step; otherwise the parameter-averaging "
                   "rule (trainer/rules.py)")
    p.add_argument("--fraction", type=float, default=0.05, help="p: fraction averaged per local step")
    p.add_argument("--tau", type=int, default=10, help="averaging delay in local steps")
    args = p.parse_args(argv)

    def configure(run, sim):
        run = run.replace(optim={"optimizer": args.optimizer, "beta1": args.beta1,
                                 "weight_stashing": args.stashing, "accumulate": 1})
        if args.rule == "grad":
            return run.replace(averaging={"rule": "none"})
        return run.replace(averaging={"rule": args.rule, "fraction": args.fraction, "round_steps": 1})

    combine = Combine.GRADIENTS if args.rule == "grad" else Combine.PARAMETERS
    METHODS[NAME] = MethodSpec(NAME, "async", combine, configure, "ad-hoc variant (tools/sim_variant.py)")
    sim = with_overrides(preset(args.preset), steps=args.steps, eval_every=args.eval_every, tau=args.tau,
                         stages=args.stages)
    rec = run_method(sim, NAME, NAME, args.tau)
    print(" ".join(f"{p['val_loss']:.3f}" for p in rec["curve"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
