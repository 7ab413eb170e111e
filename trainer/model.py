"""The model: a nanoGPT-style decoder, and the pipeline stages that are slices of it; the architecture dispatch.

``build_stage`` and ``build_model`` build the run's ``model.arch`` from the module that ``ARCHITECTURES``
(trainer/config.py) names for it: this one for ``"gpt"``, trainer/llama.py for ``"llama"``. Each such module provides
``Stage`` (one pipeline stage), ``Model`` (the whole model) and ``LAYERS`` (the blocks' name prefix).

``GPT`` is the whole model (token + position embeddings, ``n_layer`` pre-LN blocks, final LayerNorm, untied head).
``StageModule`` holds one stage's slice as computed by the pure function ``trainer.config.stage_layer_ranges``:
stage 0 also holds the embeddings, the last stage the final norm, the head and the loss.

Every parameter is initialised from its own generator, seeded by (run seed, the parameter's name in the full model),
so a stage built alone has exactly the weights of the same slice of a full ``GPT`` built with that seed, without
ever building the full model (a peer of a large model holds one stage only). The init distribution is nanoGPT's:
N(0, 0.02) for linear and embedding weights, N(0, 0.02/sqrt(2 n_layer)) for the residual projections, zero biases,
LayerNorm weight 1.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import math
from types import ModuleType

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.config import ARCHITECTURES, ModelConfig, RunConfig, stage_layer_ranges

logger = logging.getLogger(__name__)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # fused q, k, v
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)  # residual projection (scaled init)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # x: [B, T, C]
        q, k, v = self.c_attn(x).split(C, dim=2)  # each [B, T, C]
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # [B, nh, T, hs]
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # [B, nh, T, hs]
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # [B, nh, T, hs]
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # [B, nh, T, hs]
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # [B, T, C]
        out: torch.Tensor = self.resid_dropout(self.c_proj(y))  # [B, T, C]
        return out


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)  # residual projection (scaled init)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.c_fc(x))  # [B, T, 4C]
        out: torch.Tensor = self.dropout(self.c_proj(h))  # [B, T, C]
        return out


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # [B, T, C]
        out: torch.Tensor = x + self.mlp(self.ln_2(x))  # [B, T, C]
        return out


def param_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed for one parameter, from the run seed and its name in the full model."""
    digest = hashlib.sha256(f"asyncmesh-init/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seeded_normal(seed: int, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    """N(0, std) values of the full model's parameter ``name`` as the init draws them (fp32, CPU)."""
    gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, name))
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def starts_at_zero(name: str) -> bool:
    """Whether the seeded init sets parameter ``name`` to zero (every bias, LayerNorm's included): such a tensor is
    small next to how far training moves it, so its witnessed distance needs a floor of its own
    (``peer.state.digest.witness_floors``)."""
    return name.rsplit(".", 1)[-1] == "bias"


@torch.no_grad()
def _init_named(module: nn.Module, names: dict[str, str], seed: int, n_layer: int) -> None:
    """Initialise each parameter of ``module`` from its own generator; ``names`` maps local to full-model names."""
    for local, p in module.named_parameters():
        if p.is_meta:  # built on the meta device for shapes and counts only: nothing to fill
            continue
        full = names[local]
        if starts_at_zero(full):
            p.zero_()
        elif ".ln_" in f".{full}":  # LayerNorm: weight 1 (and bias 0, above)
            p.fill_(1.0)
        else:
            std = 0.02 / math.sqrt(2 * n_layer) if full.endswith("c_proj.weight") else 0.02
            p.copy_(seeded_normal(seed, full, tuple(p.shape), std))


class GPT(nn.Module):
    """The whole decoder; used for tests, the synchronous single-process reference and evaluation.

    Args:
        cfg: the run's model section (layers, width, heads, context, vocab, dropout).
        seed: init seed; the same seed gives the same weights as the stages built by ``build_stage``.
    """

    def __init__(self, cfg: ModelConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)  # untied from wte, as in the papers' runs
        _init_named(self, {n: n for n, _ in self.named_parameters()}, seed, cfg.n_layer)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx: LongTensor [B, T] -> logits [B, T, vocab]."""
        _, T = idx.shape
        pos = torch.arange(T, device=idx.device)  # [T]
        x = self.drop(self.wte(idx) + self.wpe(pos))  # [B, T, C]
        for block in self.blocks:
            x = block(x)  # [B, T, C]
        logits: torch.Tensor = self.lm_head(self.ln_f(x))  # [B, T, vocab]
        return logits


class StageBase(nn.Module):
    """What every architecture's stage module is (``Stage`` in its module): ``forward`` from the stage's input to its
    output, and ``loss``, the mean token cross-entropy of the last stage's logits, shared by every architecture."""

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of logits [B, T, vocab] against targets [B, T]."""
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class StageModule(StageBase):
    """One pipeline stage: blocks ``stage_layer_ranges(run)[stage]``, plus embeddings (first) / norm+head (last).

    ``forward`` maps the stage's input to its output: tokens [B, T] (first stage) or activations [B, T, C] to
    activations [B, T, C], or logits [B, T, vocab] on the last stage; ``loss`` turns logits and targets into the mean
    token cross-entropy.

    Args:
        run: the run config; its ``n_stages``/``layers_per_stage`` decide which blocks this stage holds.
        stage: 0 <= stage < run.n_stages.
        seed: init seed (default ``run.seed``); replicas of a swarm must share it.
    """

    def __init__(self, run: RunConfig, stage: int, seed: int | None = None) -> None:
        super().__init__()
        if not 0 <= stage < run.n_stages:
            raise ValueError(f"stage must be in [0, {run.n_stages}), got {stage}")
        cfg = run.model
        self.cfg = cfg
        self.stage, self.n_stages = stage, run.n_stages
        self.is_first, self.is_last = stage == 0, stage == run.n_stages - 1
        self.layer_start, self.layer_end = stage_layer_ranges(run)[stage]
        if self.is_first:
            self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
            self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(self.layer_end - self.layer_start))
        if self.is_last:
            self.ln_f = nn.LayerNorm(cfg.n_embd)
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        names = {local: shift_layer(LAYERS, self.layer_start, local) for local, _ in self.named_parameters()}
        _init_named(self, names, run.seed if seed is None else seed, cfg.n_layer)

    def forward(self, x: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """``last_only`` (last stage, generation): the logits of the last position only, [B, 1, vocab]."""
        if self.is_first:
            _, T = x.shape  # x: tokens [B, T]
            pos = torch.arange(T, device=x.device)  # [T]
            x = self.drop(self.wte(x) + self.wpe(pos))  # [B, T, C]
        for block in self.blocks:
            x = block(x)  # [B, T, C]
        if self.is_last:
            x = self.lm_head(self.ln_f(x[:, -1:] if last_only else x))  # [B, T or 1, vocab]
        return x


LAYERS = "blocks"
"""Prefix of the transformer blocks' names; stage-local indices after it become global ones in the full model."""
Stage, Model = StageModule, GPT  # this module's builders under the names every architecture module provides


def arch_module(arch: str) -> ModuleType:
    """The module that builds ``arch`` (``Stage``, ``Model``, ``LAYERS``), from the one table in trainer/config.py."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown model.arch {arch!r}; known: {sorted(ARCHITECTURES)}")
    return importlib.import_module(ARCHITECTURES[arch])


def build_stage(run: RunConfig, stage: int, seed: int | None = None) -> StageBase:
    """The stage's module of the run's architecture with the run's seeded init (``seed`` overrides ``run.seed``)."""
    module: StageBase = arch_module(run.model.arch).Stage(run, stage, seed)
    return module


def build_model(cfg: ModelConfig, seed: int = 0) -> nn.Module:
    """The whole model of ``cfg.arch``: forward(tokens [B, T]) -> logits [B, T, vocab], the full model's names."""
    model: nn.Module = arch_module(cfg.arch).Model(cfg, seed)
    return model


def build_gpt(run: RunConfig, seed: int | None = None) -> nn.Module:
    """The full model of the run (any architecture) with the run's seeded init (``seed`` overrides ``run.seed``)."""
    return build_model(run.model, run.seed if seed is None else seed)


def stage_parameter_counts(run: RunConfig) -> list[int]:
    """Parameters of every stage, counted on the meta device (no memory, no init: instant even for a 1B model)."""
    with torch.device("meta"):
        return [sum(p.numel() for p in build_stage(run, s).parameters()) for s in range(run.n_stages)]


def shift_layer(layers: str, layer_start: int, local: str) -> str:
    """A stage's parameter name in the whole model: the block index after ``layers`` shifted by the stage's first
    block (``blocks.0.attn...`` of a stage starting at block 4 is ``blocks.4.attn...``); other names unchanged."""
    if not local.startswith(layers + "."):
        return local
    idx, rest = local[len(layers) + 1:].split(".", 1)
    return f"{layers}.{layer_start + int(idx)}.{rest}"


def global_name(arch: str, layer_start: int, local: str) -> str:
    """``shift_layer`` with the block prefix of ``arch``."""
    return shift_layer(arch_module(arch).LAYERS, layer_start, local)
