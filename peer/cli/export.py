"""`asyncmesh-peer export`: assemble the stages' latest checkpoints into one model (safetensors + config.json).

Each peer checkpoints only the stage it serves (``<checkpoint-dir>/stage-N.pt``). ``export`` looks in every folder
given, takes for each stage the checkpoint with the highest step (replicas of a stage average towards one model; the
most advanced one is the freshest), renames the stages' layers to those of the whole GPT (``trainer.export``) and
writes ``model.safetensors`` and ``config.json`` to ``--out``. Load it with a few lines of plain PyTorch (see
docs/export.md) or sample it with ``asyncmesh-peer generate``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from peer.errors import UserError, user_input

HELP = "Assemble the stages' latest checkpoints into one model file (safetensors) with its config."
EPILOG = """examples:
  the checkpoints of a local swarm (each peer's folder), into model/:
    asyncmesh-peer export --run tests/runs/tiny.toml --checkpoint-dir swarm/peer*/ckpt --out model
  a volunteer's own folder plus folders copied from other stages' peers:
    asyncmesh-peer export --run myrun.toml --checkpoint-dir ~/.asyncmesh/ckpt stage1-ckpt --out model
then: asyncmesh-peer generate --model model --prompt 'def main('
exit codes: 0 written; 2 bad input (a folder, a missing stage, another run's checkpoints)"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", default=None, metavar="FILE", help="the run file the peers trained (default: embedded)")
    p.add_argument("--checkpoint-dir", nargs="+", required=True, metavar="DIR",
                   help="folders holding stage-N.pt checkpoints (the peers' --checkpoint-dir); every stage is needed")
    p.add_argument("--out", required=True, metavar="DIR", help="where to write model.safetensors and config.json")


def run(args: argparse.Namespace) -> int:
    import torch

    from peer.state.checkpoint import CheckpointError, checkpoint_path
    from trainer.config import RunConfig
    from trainer.export import gpt_state, save_model

    with user_input(f"--run {args.run}" if args.run else ""):
        run_cfg = RunConfig.from_toml(args.run) if args.run else RunConfig.default()
    best: dict[int, tuple[int, Path, dict]] = {}
    for folder in map(Path, args.checkpoint_dir):
        if not folder.is_dir():
            raise UserError(f"--checkpoint-dir {folder} is not a folder")
        for stage in range(run_cfg.n_stages):
            path = checkpoint_path(folder, stage)
            if not path.exists():
                continue
            try:
                payload = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:  # a damaged or foreign file: name it
                raise UserError(f"cannot read {path}: {type(e).__name__}: {e}") from None
            if not isinstance(payload, dict) or payload.get("run_id") != run_cfg.run_id:
                theirs = payload.get("run_id") if isinstance(payload, dict) else "?"
                raise UserError(f"{path} belongs to run {theirs}, not to run {run_cfg.run_id} ({run_cfg.name!r}); "
                                "pass the run file the peers trained with --run")
            step = int(payload.get("step", -1))
            if stage not in best or step > best[stage][0]:
                best[stage] = (step, path, payload["state"]["model"])
    missing = [s for s in range(run_cfg.n_stages) if s not in best]
    if missing:
        raise UserError(f"no checkpoint of stage(s) {missing} in {' '.join(args.checkpoint_dir)}; add the folder of a "
                        f"peer that served it (its --checkpoint-dir)")
    try:
        state = gpt_state(run_cfg, {s: m for s, (_, _, m) in best.items()})
    except (ValueError, CheckpointError) as e:
        raise UserError(str(e)) from None
    sources = {f"stage {s}": {"checkpoint": str(p), "step": step} for s, (step, p, _) in sorted(best.items())}
    with user_input(f"--out {args.out}"):
        out = save_model(args.out, run_cfg, state, sources)
    n = sum(t.numel() for t in state.values())
    steps = ", ".join(f"stage {s} step {step}" for s, (step, _, _) in sorted(best.items()))
    print(f"wrote {out / 'model.safetensors'} ({n:,} parameters of run {run_cfg.name} ({run_cfg.run_id}); {steps}) "
          f"and {out / 'config.json'}")
    return 0
