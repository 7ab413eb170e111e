"""The Llama-style decoder (``model.arch = "llama"``) and its pipeline stages.

The math is transformers' ``LlamaForCausalLM`` (no rope scaling, no biases): RMSNorm before attention and MLP,
rotary positions with the rotate-half convention and base ``rope_theta``, grouped-query attention (``n_kv_head``
key/value heads, each shared by ``n_head / n_kv_head`` query heads), a SwiGLU MLP ``down(silu(gate(x)) * up(x))``, a
final RMSNorm and an output head, optionally tied to the token embedding. Parameter names are transformers' too, so
the whole model's state dict *is* a ``LlamaForCausalLM`` state dict and the Hugging Face export is a copy::

    model.embed_tokens.weight                                  [vocab, C]
    model.layers.{i}.input_layernorm.weight                    [C]
    model.layers.{i}.self_attn.{q,o}_proj.weight               [C, C]
    model.layers.{i}.self_attn.{k,v}_proj.weight               [n_kv_head * hs, C]
    model.layers.{i}.post_attention_layernorm.weight           [C]
    model.layers.{i}.mlp.{gate,up}_proj.weight                 [F, C]
    model.layers.{i}.mlp.down_proj.weight                      [C, F]
    model.norm.weight                                          [C]
    lm_head.weight                                             [vocab, C]

A stage holds ``model.layers`` ``stage_layer_ranges(run)[stage]`` under local indices (and the embedding on the first
stage, the norm and head on the last), exactly as the GPT's stages do. Init follows trainer/model.py: every parameter
from its own generator seeded by its full-model name, N(0, 0.02), the residual projections (``o_proj``,
``down_proj``) N(0, 0.02/sqrt(2 n_layer)), norms 1.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.config import ModelConfig, RunConfig, stage_layer_ranges
from trainer.model import StageBase, param_seed, shift_layer

LAYERS = "model.layers"
"""Prefix of the transformer blocks' names; stage-local indices after it become global ones in the full model."""


def rotary_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [block_size, hs] of every position, as transformers' LlamaRotaryEmbedding computes them."""
    hs = cfg.n_embd // cfg.n_head
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hs, 2, dtype=torch.int64).float() / hs))  # [hs/2]
    freqs = torch.outer(torch.arange(cfg.block_size).float(), inv_freq)  # [T, hs/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, hs]
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension's two halves (transformers' convention, not interleaved)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv = cfg.n_head, cfg.kv_heads
        self.hs = cfg.n_embd // cfg.n_head
        self.q_proj = nn.Linear(cfg.n_embd, self.n_head * self.hs, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, self.n_kv * self.hs, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, self.n_kv * self.hs, bias=False)
        self.o_proj = nn.Linear(self.n_head * self.hs, cfg.n_embd, bias=False)  # residual projection (scaled init)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # x: [B, T, C]; cos, sin: [T, hs]
        q = self.q_proj(x).view(B, T, self.n_head, self.hs).transpose(1, 2)  # [B, nh, T, hs]
        k = self.k_proj(x).view(B, T, self.n_kv, self.hs).transpose(1, 2)  # [B, nkv, T, hs]
        v = self.v_proj(x).view(B, T, self.n_kv, self.hs).transpose(1, 2)  # [B, nkv, T, hs]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if self.n_kv != self.n_head:  # each key/value head serves n_head / n_kv consecutive query heads
            k = k.repeat_interleave(self.n_head // self.n_kv, dim=1)  # [B, nh, T, hs]
            v = v.repeat_interleave(self.n_head // self.n_kv, dim=1)  # [B, nh, T, hs]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, nh, T, hs]
        out: torch.Tensor = self.o_proj(y.transpose(1, 2).reshape(B, T, C))  # [B, T, C]
        return out


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.mlp_width, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.mlp_width, bias=False)
        self.down_proj = nn.Linear(cfg.mlp_width, cfg.n_embd, bias=False)  # residual projection (scaled init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # [B, T, F] -> [B, T, C]
        return out


class Block(nn.Module):
    """x + attn(rmsnorm(x)), then x + mlp(rmsnorm(x)); transformers' LlamaDecoderLayer."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.n_embd, eps=cfg.rms_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.n_embd, eps=cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)  # [B, T, C]
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))  # [B, T, C]
        return out


class _Trunk(nn.Module):
    """The ``model.`` part of the names: embedding (first stage), blocks, final norm (last stage)."""

    def __init__(self, cfg: ModelConfig, n_blocks: int, first: bool, last: bool) -> None:
        super().__init__()
        if first:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(n_blocks))
        if last:
            self.norm = nn.RMSNorm(cfg.n_embd, eps=cfg.rms_eps)


@torch.no_grad()
def _init_named(module: nn.Module, names: dict[str, str], seed: int, n_layer: int) -> None:
    """Each parameter of ``module`` from its own generator; ``names`` maps local to full-model names."""
    for local, p in module.named_parameters():
        if p.is_meta:  # built on the meta device for shapes and counts only: nothing to fill
            continue
        full = names[local]
        if full.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, full))
        std = 0.02 / math.sqrt(2 * n_layer) if full.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
        p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)


class Stage(StageBase):
    """One pipeline stage of the Llama; the contract of trainer.model.StageBase, as StageModule (forward, loss)."""

    cos: torch.Tensor
    sin: torch.Tensor
    """Rotary tables [block_size, hs], registered as non-persistent buffers."""

    def __init__(self, run: RunConfig, stage: int, seed: int | None = None) -> None:
        super().__init__()
        if not 0 <= stage < run.n_stages:
            raise ValueError(f"stage must be in [0, {run.n_stages}), got {stage}")
        cfg = self.cfg = run.model
        self.stage, self.n_stages = stage, run.n_stages
        self.is_first, self.is_last = stage == 0, stage == run.n_stages - 1
        self.layer_start, self.layer_end = stage_layer_ranges(run)[stage]
        self.model = _Trunk(cfg, self.layer_end - self.layer_start, self.is_first, self.is_last)
        if self.is_last:
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg)
        self.register_buffer("cos", cos, persistent=False)  # [block_size, hs]: not weights, not in the state dict
        self.register_buffer("sin", sin, persistent=False)
        names = {local: shift_layer(LAYERS, self.layer_start, local) for local, _ in self.named_parameters()}
        _init_named(self, names, run.seed if seed is None else seed, cfg.n_layer)
        if cfg.tie_embeddings:  # one stage holds both (RunConfig checks it): the head is the embedding
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model.layers

    def forward(self, x: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Tokens [B, T] (first stage) or activations [B, T, C] -> activations [B, T, C], or logits [B, T or 1,
        vocab] on the last stage (``last_only``: the last position's only, for generation)."""
        if self.is_first:
            x = self.model.embed_tokens(x)  # [B, T, C]
        T = x.shape[1]
        cos, sin = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype)  # [T, hs]
        for block in self.model.layers:
            x = block(x, cos, sin)  # [B, T, C]
        if self.is_last:
            x = self.lm_head(self.model.norm(x[:, -1:] if last_only else x))  # [B, T or 1, vocab]
        return x


class Model(Stage):
    """The whole Llama: the single stage of a one-stage run; its state dict is a LlamaForCausalLM state dict."""

    def __init__(self, cfg: ModelConfig, seed: int = 0) -> None:
        super().__init__(RunConfig(n_stages=1, model=cfg, seed=seed), 0)
