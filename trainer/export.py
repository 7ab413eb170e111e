"""One model from a pipeline's stages: assemble the stages' weights into the full model, save it, load it, sample it.

A swarm holds the model in pieces, one per pipeline stage (``trainer.model.build_stage``), each with its own layer
numbering. ``gpt_state`` renames every stage's parameters to those of the whole model (stage ``s``'s block ``i`` is
block ``layer_start(s) + i``) and checks that together they are exactly the model's parameters, no more, no less,
with the right shapes (for either architecture; trainer/hf.py turns the same state into a transformers folder).
``save_model`` writes them as safetensors (no pickle: safe to load from strangers) next to a ``config.json`` with
the model's shape and where the weights came from; ``load_model`` is the few lines of plain PyTorch a user needs::

    import json
    from safetensors.torch import load_file
    from trainer.config import ModelConfig
    from trainer.model import build_model

    config = json.load(open("model/config.json"))
    model = build_model(ModelConfig(**config["model"]))
    model.load_state_dict(load_file("model/model.safetensors"))

``sample`` draws tokens from a model autoregressively (temperature, top-k), cropping the context to its block size;
``next_token`` is its draw of one token from logits, shared with generation through a live swarm.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from trainer.config import ARCHITECTURES, ModelConfig, RunConfig, stage_layer_ranges
from trainer.model import build_model, global_name

WEIGHTS, CONFIG = "model.safetensors", "config.json"
EXPORT_FORMAT = 1
TIED = "lm_head.weight"  # with model.tie_embeddings, the head is the token embedding and is saved once


def gpt_state(run: RunConfig, stages: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The whole GPT's state dict from every stage's ``StageModule`` state dict; ValueError names what is wrong."""
    missing = [s for s in range(run.n_stages) if s not in stages]
    if missing:
        raise ValueError(f"no state for stage(s) {missing} of {run.n_stages}; every stage is needed")
    ranges = stage_layer_ranges(run)
    out: dict[str, torch.Tensor] = {}
    for stage, state in sorted(stages.items()):
        for name, tensor in state.items():
            name = global_name(run.model.arch, ranges[stage][0], name)
            if name in out:
                raise ValueError(f"parameter {name} appears in two stages")
            out[name] = tensor.detach().to("cpu").contiguous()
    with torch.device("meta"):  # shapes only: nothing allocated, however large the model
        expected = {k: v.shape for k, v in build_model(run.model).state_dict().items()}
    if run.model.tie_embeddings:  # one tensor under two names: keep the embedding's (safetensors refuses shared ones)
        out.pop(TIED, None)
        expected.pop(TIED, None)
    if set(out) != set(expected):
        raise ValueError(f"the stages do not make this run's model: missing {sorted(set(expected) - set(out))[:5]}, "
                         f"unexpected {sorted(set(out) - set(expected))[:5]}")
    wrong = [k for k in out if out[k].shape != expected[k]]
    if wrong:
        raise ValueError(f"shape of {wrong[0]} is {tuple(out[wrong[0]].shape)}, the run's model needs "
                         f"{tuple(expected[wrong[0]])}")
    return out


def save_model(directory: str | Path, run: RunConfig, state: dict[str, torch.Tensor],
               sources: dict[str, Any] | None = None) -> Path:
    """Write ``state`` (from ``gpt_state``) and its config to ``directory``; returns the directory."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    meta = {"format": str(EXPORT_FORMAT), "run_id": run.run_id, "run_name": run.name}
    save_file(state, str(d / WEIGHTS), metadata=meta)
    arch = run.model.arch
    config = {"format": EXPORT_FORMAT, "architecture": f"asyncmesh {arch} ({ARCHITECTURES[arch]})",
              "run_id": run.run_id, "run_name": run.name, "model": dataclasses.asdict(run.model),
              "tokenizer": "bytes" if run.model.vocab_size == 256 and run.data.bin_vocab_size == 0
              else "token ids (see the run's data)",
              "sources": sources or {}}
    (d / CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    return d


@contextmanager
def atomic_folder(out: str | Path) -> Iterator[Path]:
    """A fresh hidden sibling of ``out`` to write the export into: on success it becomes ``out`` (replacing an earlier
    export there), on any error it is deleted, so ``out`` is never left half-written. A non-empty ``out`` that is not
    an export (no config.json) is refused rather than replaced."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / CONFIG).exists())):
        raise ValueError(f"{out} exists and is not an earlier export; choose a new folder (nothing was written)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # readable like any folder a user makes (mkdtemp's are private), files too
        for f in tmp.rglob("*"):
            os.chmod(f, 0o755 if f.is_dir() else 0o644)
        old = out.with_name(f".{out.name}.{os.getpid()}.old")
        if out.exists():
            out.rename(old)
        try:
            tmp.rename(out)
        except OSError:
            if old.exists():
                old.rename(out)  # the earlier export stays where it was
            raise
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already on success


def load_model(directory: str | Path, device: str = "cpu") -> tuple[torch.nn.Module, dict[str, Any]]:
    """(the model in eval mode, its config.json) from a folder written by ``save_model``."""
    from safetensors.torch import load_file

    d = Path(directory)
    config = json.loads((d / CONFIG).read_text())
    cfg = ModelConfig(**config["model"])
    model = build_model(cfg)
    state = load_file(str(d / WEIGHTS), device=device)
    if cfg.tie_embeddings:
        state[TIED] = state["model.embed_tokens.weight"]
    model.load_state_dict(state)
    return model.to(device).eval(), config


@torch.no_grad()
def sample(model: Callable[[torch.Tensor], torch.Tensor], prompt: list[int], max_new_tokens: int, *,
           temperature: float = 1.0, top_k: int = 0, generator: torch.Generator | None = None,
           block_size: int | None = None, device: str | torch.device | None = None) -> list[int]:
    """``prompt`` continued by ``max_new_tokens`` sampled tokens (greedy when ``temperature`` is 0).

    ``model`` maps tokens [1, T] to logits [1, T, vocab]: one of ours (its ``cfg`` gives the context length and
    its parameters the device), or any callable with ``block_size`` and ``device`` given (a transformers model)."""
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    if temperature < 0 or top_k < 0 or max_new_tokens < 0:
        raise ValueError("temperature, top_k and max_new_tokens must be >= 0")
    if block_size is None or device is None:
        assert isinstance(model, torch.nn.Module)
        cfg = model.cfg
        assert isinstance(cfg, ModelConfig), "a model given without block_size is one of ours, with its ModelConfig"
        block_size = cfg.block_size if block_size is None else block_size
        device = next(model.parameters()).device if device is None else device
    idx = torch.tensor([prompt], dtype=torch.long, device=device)  # [1, T]
    for _ in range(max_new_tokens):
        logits = model(idx[:, -block_size:])[:, -1, :]  # [1, vocab]
        nxt = next_token(logits, temperature=temperature, top_k=top_k, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
    return idx[0].tolist()


def next_token(logits: torch.Tensor, *, temperature: float, top_k: int,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token [1, 1] drawn from the last position's ``logits`` [1, vocab]: the most likely one when
    ``temperature`` is 0, else a draw at that temperature among the ``top_k`` most likely (0: all). Sampling from an
    exported model and through a live swarm (``asyncmesh-peer generate``) share it, so equal logits and an equal seed
    give an equal sample."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
