"""The run: one TOML file that every peer of a swarm shares.

A run fixes the model (layers, width, heads, context, vocab), how its layers are split into pipeline stages, the
optimiser, the data-parallel averaging rule, the wire compression and the data. Its **run id** is a hash of the
canonical form of the config, and every DHT key is prefixed with it, so peers with different settings never mix.

The embedded default run (``trainer/runs/default.toml``) is a small byte-level GPT trained on the Python standard
library's own source files; it is what ``asyncmesh-peer swarm`` trains when given no ``--run``.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import math
import tomllib
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from protocol.codecs.names import RUN_CODECS
from trainer.sources import file_sha256, is_streamed_source, tokenizer_vocab_size

# The model architectures a run may name, each with the module that builds it (trainer/model.py dispatches on it;
# every module provides the same builders). One table: the config validates against it, the model builds from it.
ARCHITECTURES = {"gpt": "trainer.model", "llama": "trainer.llama"}
SUBSPACE = "subspace"  # the model+codec pair of trainer/subspace.py: k coefficients per token cross a boundary
AVERAGING_RULES = ("ema", "delta", "avg", "full", "wagma", "none")  # trainer/rules.py: RULES
AGGREGATORS = ("mean", "trimmed", "centered_clip")  # implemented in trainer/robust.py (kept torch-free here)
CLIP_STARTS = ("median", "own")
OPTIMIZERS = ("nadam", "adamw")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder: nanoGPT's GPT (``arch = "gpt"``) or a Llama-style one (``arch = "llama"``, trainer/llama.py)."""

    arch: str = "gpt"
    """'gpt' (learned positions, LayerNorm, GELU MLP, biases) or 'llama' (rotary positions, RMSNorm, SwiGLU,
    grouped-query attention, no biases; the math of transformers' LlamaForCausalLM)."""
    n_layer: int = 4
    """Transformer blocks in the whole model (summed over all stages)."""
    n_embd: int = 128
    """Width of the residual stream; must be divisible by n_head."""
    n_head: int = 4
    """Attention heads per block."""
    block_size: int = 128
    """Context length in tokens; also the length of every training sequence."""
    vocab_size: int = 256
    """Token vocabulary; 256 for the byte-level default."""
    dropout: float = 0.0
    """Dropout probability; 0 as in the papers' runs."""
    # --- llama only (the run id leaves them out while they hold their defaults, so GPT run ids are unchanged) ---
    n_kv_head: int = 0
    """Key/value heads (grouped-query attention); n_head must be a multiple of it. 0: n_head (multi-head)."""
    intermediate_size: int = 0
    """Width of the SwiGLU MLP. 0: 8/3 n_embd rounded up to a multiple of 64 (Llama's rule)."""
    rope_theta: float = 10000.0
    """Base of the rotary position frequencies."""
    rms_eps: float = 1e-5
    """Epsilon of RMSNorm."""
    tie_embeddings: bool = False
    """Share the token embedding with the output head; both must live on one stage (n_stages = 1)."""

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"model.arch must be one of {tuple(ARCHITECTURES)}, got {self.arch!r}")
        for name in ("n_layer", "n_embd", "n_head", "block_size", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be a positive integer, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.n_kv_head < 0 or self.intermediate_size < 0:
            raise ValueError("model.n_kv_head and model.intermediate_size must be >= 0 (0: the default)")
        if self.rope_theta <= 0 or self.rms_eps <= 0:
            raise ValueError("model.rope_theta and model.rms_eps must be positive")
        if self.arch == "llama":
            if self.n_head % self.kv_heads:
                raise ValueError(f"model.n_head ({self.n_head}) must be a multiple of model.n_kv_head "
                                 f"({self.n_kv_head}): each key/value head serves a whole group of query heads")
            if (self.n_embd // self.n_head) % 2:
                raise ValueError(f"rotary positions need an even head size; n_embd / n_head is "
                                 f"{self.n_embd // self.n_head}")
            if self.dropout:
                raise ValueError("model.dropout must be 0 for arch 'llama' (transformers' Llama has none)")
        else:
            llama_only = [f.name for f in dataclasses.fields(self) if f.name in LLAMA_ONLY
                          and getattr(self, f.name) != f.default]
            if llama_only:
                raise ValueError(f"model.{llama_only[0]} is a setting of arch 'llama'; this run's arch is "
                                 f"{self.arch!r}")

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_head, or n_head when it is 0."""
        return self.n_kv_head or self.n_head

    @property
    def mlp_width(self) -> int:
        """Hidden width of the MLP: 4 n_embd (gpt); intermediate_size or 8/3 n_embd rounded up to 64 (llama)."""
        if self.arch == "gpt":
            return 4 * self.n_embd
        return self.intermediate_size or 64 * math.ceil(8 * self.n_embd / 3 / 64)

    def id_dict(self) -> dict[str, Any]:
        """The section as the run id sees it: llama-only fields left out while at their defaults."""
        d = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            if (f.name in LLAMA_ONLY or f.name == "arch") and d[f.name] == f.default:
                del d[f.name]
        return d


LLAMA_ONLY = ("n_kv_head", "intermediate_size", "rope_theta", "rms_eps", "tie_embeddings")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """The per-stage optimiser. Defaults are AsyncPP's released code (NAdam, beta1 0.99), see docs/design.md."""

    optimizer: str = "nadam"
    """'nadam' (AsyncPP look-ahead, torch.optim.NAdam with decoupled weight decay) or 'adamw' (naive/sync)."""
    lr: float = 3e-4
    """Peak learning rate."""
    beta1: float = 0.99
    """First-moment coefficient; 0.99 is the AsyncPP look-ahead, 0.9 the usual AdamW value."""
    beta2: float = 0.999
    """Second-moment coefficient."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    momentum_decay: float = 0.004
    """NAdam's psi: a built-in momentum warm-up (mu_t starts near beta1/2). Keep it."""
    grad_clip: float = 10.0
    """Gradient-norm clip applied to each stage separately; 0 disables."""
    warmup_steps: int = 300
    """Linear warm-up of the learning rate, in local optimiser steps."""
    total_steps: int = 10_000
    """Steps of the cosine schedule; after it the learning rate stays at min_lr_ratio * lr."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr."""
    weight_stashing: bool = True
    """Backward at the weights the forward used (PipeDream/AsyncPP). False: backward through the latest weights."""
    nows_beta1_first: float = 0.99
    """Without stashing: beta1 of the first stage (largest delay); interpolated linearly to nows_beta1_last."""
    nows_beta1_last: float = 0.9
    """Without stashing: beta1 of the last stage (no delay)."""
    accumulate: int = 1
    """Sum this many asynchronous gradients before one optimiser step (Aji & Heafield); 1 applies each at once."""

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optim.optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be positive, got {self.lr}")
        for name in ("beta1", "beta2", "nows_beta1_first", "nows_beta1_last"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"optim.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError("optim.warmup_steps must be >= 0 and optim.total_steps >= 1")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.accumulate < 1:
            raise ValueError(f"optim.accumulate must be >= 1, got {self.accumulate}")
        if self.grad_clip < 0:
            raise ValueError(f"optim.grad_clip must be >= 0 (0 disables), got {self.grad_clip}")


@dataclass(frozen=True, kw_only=True)
class AveragingConfig:
    """Data-parallel averaging between replicas of one stage (AsyncMesh sparse EMA by default)."""

    rule: str = "ema"
    """'ema' (AsyncMesh), 'delta' (a + lam*drift), 'avg' (stale overwrite, AsyncSPARTA), 'full' (whole tensors,
    overwrite), 'wagma' (rotating groups, delta form), or 'none' (trainer/rules.py)."""
    fraction: float = 0.05
    """p: fraction of each tensor averaged per local step (the paper's 0.05); rounds batch round_steps of it."""
    lam: float = 1.0
    """lambda: multiplier on the drift correction."""
    mu_start: float = 0.5
    """EMA coefficient mu before and at the start of annealing."""
    mu_end: float = 0.99
    """EMA coefficient mu at the end of the cosine annealing."""
    mu_warmup_steps: int = 1000
    """Local steps at mu_start before the cosine annealing to mu_end begins."""
    round_steps: int = 1
    """Local steps one averaging round stands for: a round averages fraction * round_steps of each tensor (capped at
    1), and a replica takes part in one round per round_steps local steps (simulator and daemon alike)."""
    period_s: float = 1.0
    """Daemon: the round clock. Every period_s of unix time a tick opens the rounds a replica owes (it owes one per
    round_steps local steps it made, the remainder carried to the next tick), and a replica asked by a partner takes
    part in that round; a round collects parts for 0.6 period_s (at most timeout_s)."""
    rounds_per_tick: int = 1
    """Daemon: at most this many rounds open at one tick (each a different partition). A replica making more than
    rounds_per_tick * round_steps steps per period_s averages less per step than ``fraction`` (the summary's
    avg_fraction_per_step says how much; its dashboard says what to raise)."""
    wagma_group_size: int = 2
    """WAGMA: replicas per averaging group (groups rotate over the bit-fields of the replica index)."""
    wagma_global_every: int = 11
    """WAGMA: every this many steps a global average bounds staleness (tau + 1 = 11 in the paper)."""
    timeout_s: float = 30.0
    """Daemon: a round stops collecting partners' parts at most this many seconds after it opens."""
    aggregator: str = "trimmed"
    """How a replica combines the round's contributions (trainer/robust.py): 'mean', 'trimmed' or 'centered_clip'."""
    trim: float = 0.25
    """'trimmed': fraction of values dropped at each end of every coordinate (rounded up, at most (n-1)//2 of n)."""
    clip_scale: float = 1.0
    """'centered_clip': tau = clip_scale x the median L2 distance of the contributions from the start."""
    clip_iters: int = 3
    """'centered_clip': iterations of v <- v + mean clip(x_i - v, tau)."""
    clip_start: str = "median"
    """'centered_clip': start from the coordinate-wise 'median' or from the replica's 'own' values."""

    def __post_init__(self) -> None:
        if self.aggregator not in AGGREGATORS:
            raise ValueError(f"averaging.aggregator must be one of {AGGREGATORS}, got {self.aggregator!r}")
        if not 0.0 <= self.trim < 0.5:
            raise ValueError(f"averaging.trim must be in [0, 0.5), got {self.trim}")
        if self.clip_scale <= 0 or self.clip_iters < 1:
            raise ValueError("averaging.clip_scale must be positive and averaging.clip_iters >= 1")
        if self.clip_start not in CLIP_STARTS:
            raise ValueError(f"averaging.clip_start must be one of {CLIP_STARTS}, got {self.clip_start!r}")
        if self.rule not in AVERAGING_RULES:
            raise ValueError(f"averaging.rule must be one of {AVERAGING_RULES}, got {self.rule!r}")
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"averaging.fraction must be in (0, 1], got {self.fraction}")
        for name in ("mu_start", "mu_end"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"averaging.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.round_steps < 1 or self.mu_warmup_steps < 0:
            raise ValueError("averaging.round_steps must be >= 1 and mu_warmup_steps >= 0")
        if self.period_s <= 0:
            raise ValueError(f"averaging.period_s must be positive, got {self.period_s}")
        if self.rounds_per_tick < 1:
            raise ValueError(f"averaging.rounds_per_tick must be >= 1, got {self.rounds_per_tick}")
        if self.wagma_group_size < 2 or self.wagma_global_every < 1:
            raise ValueError("averaging.wagma_group_size must be >= 2 and wagma_global_every >= 1")
        if self.timeout_s <= 0:
            raise ValueError(f"averaging.timeout_s must be positive, got {self.timeout_s}")

    @property
    def round_fraction(self) -> float:
        """Fraction of each tensor one round averages: p * round_steps, at most 1."""
        return min(1.0, self.fraction * self.round_steps)

    @property
    def n_partitions(self) -> int:
        """n = ceil(1 / round_fraction) disjoint partitions per tensor, cycled one per round."""
        return max(1, math.ceil(1.0 / self.round_fraction - 1e-9))


@dataclass(frozen=True, kw_only=True)
class CompressionConfig:
    """Codec ids (see protocol.codecs.registry) for what crosses the wire."""

    activations: str = "int8"
    """Forward activations between stages."""
    gradients: str = "int8"
    """Backward gradients between stages."""
    averaging: str = "int8"
    """Averaging payloads (the partition's values)."""
    subspace_rank: int = 0
    """With activations = gradients = "subspace": k, the dimension of the fixed subspace the residual stream is
    confined to (k coefficients per token cross a stage boundary instead of n_embd values); 0 otherwise."""
    subspace_codec: str = "none"
    """With "subspace": the codec of the coefficients ("none": fp32, exact; int8, int4 and int3 quantise them; ecq
    quantises them on a finer grid and Huffman-codes the steps)."""
    subspace_table_std: float = 0.2
    """With "subspace": the std of the fixed embedding tables F (every token's and position's embedding outside the
    subspace, drawn from the seed, never trained). Larger than the usual 0.02 init: F is all a boundary carries of a
    token's identity outside the k trained dimensions, and at 0.02 the trained writes drown it (0.2: the best of
    0.1-0.4 over three seeds of the links bench, docs/performance.md)."""

    def __post_init__(self) -> None:
        if (self.activations == SUBSPACE) != (self.gradients == SUBSPACE):
            raise ValueError('compression.activations and compression.gradients must both be "subspace" or neither: '
                             "the subspace model sends activations and their gradients as coefficients of one basis")
        if self.subspace != (self.subspace_rank > 0):
            raise ValueError('compression.subspace_rank must be > 0 with "subspace" compression and 0 without it, got '
                             f"{self.subspace_rank}")
        if self.subspace_codec not in RUN_CODECS:
            raise ValueError(f"compression.subspace_codec must be one of {RUN_CODECS}, got {self.subspace_codec!r}")
        if not 0.0 < self.subspace_table_std <= 10.0:  # NaN fails too
            raise ValueError(f"compression.subspace_table_std must be in (0, 10], got {self.subspace_table_std}")
        if not self.subspace:  # unused without it, yet part of the run's id: a run that differs in nothing else
            defaults = CompressionConfig.__dataclass_fields__
            for name in ("subspace_codec", "subspace_table_std"):
                if getattr(self, name) != defaults[name].default:
                    raise ValueError(f'compression.{name} applies only with "subspace" compression '
                                     '(compression.activations = "subspace"); remove it, or set the codec of '
                                     "compression.activations and compression.gradients instead")
        for name in ("activations", "gradients", "averaging"):
            if self.subspace and name != "averaging":
                continue
            if str(getattr(self, name)).startswith("topk"):
                raise ValueError(f"compression.{name} cannot be TopK: activations, gradients and averaging rounds "
                                 "send values, not deltas, and a TopK of values zeroes what it drops (see "
                                 "docs/design.md, Compression); use int8 or int4")
            if getattr(self, name) not in RUN_CODECS:
                raise ValueError(f"compression.{name} must be one of {RUN_CODECS}, got {getattr(self, name)!r}")

    @property
    def subspace(self) -> bool:
        """Activations and gradients cross stage boundaries as subspace coefficients (trainer/subspace.py)."""
        return self.activations == SUBSPACE


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where tokens come from."""

    source: str = "stdlib"
    """'stdlib' (the running interpreter's own .py sources), a path (text files/folders read as bytes, uint16 .bin
    shards), or a streamed source (trainer/stream.py): 'hf:NAME' (a Hugging Face dataset), .jsonl/.parquet files, a
    glob, or any text with data.tokenizer set."""
    batch_size: int = 8
    """Sequences per micro-batch."""
    val_fraction: float = 0.05
    """Fraction of files held out for validation (chosen deterministically by file path)."""
    max_bytes: int = 8_000_000
    """Read at most this many bytes of text (keeps start-up fast); 0 reads everything."""
    bin_vocab_size: int = 0
    """For pre-tokenized .bin shards: their vocabulary size (must equal model.vocab_size); 0 for text."""
    tokenizer: str = ""
    """A Hugging Face ``tokenizers`` file (tokenizer.json; in a run file, relative to the run file's folder); empty:
    byte level (vocab 256). Its sha256 stands for it in the run id (``tokenizer_sha256``), not its path."""
    tokenizer_sha256: str = ""
    """The tokenizer file's digest, filled in from the file; given in a run file, the file must match it."""
    eot_token: str = "<|endoftext|>"
    """The tokenizer's end-of-text token, put between joined documents (byte level: byte 0)."""
    hf_config: str = ""
    """``source = "hf:NAME"``: the dataset's configuration name (empty: its default)."""
    split: str = "train"
    """``source = "hf:NAME"``: the split streamed (held-out documents of it are the validation set)."""
    text_field: str = "text"
    """Streamed sources (hub, .jsonl, .parquet): the column holding each document's text."""
    shards: int = 16
    """Streamed sources: the training documents are dealt into this many disjoint shards; each stage-0 peer reads
    one (see trainer/stream.py)."""
    shuffle_window: int = 1024
    """Streamed sources: a shard's sequences are taken in windows of this many consecutive ones and handed out in a
    seeded random order within each window, so a micro-batch mixes documents instead of walking through one long
    file; the validation set is drawn the same way from the held-out documents. 1: in order."""

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {self.batch_size}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.max_bytes < 0 or self.bin_vocab_size < 0:
            raise ValueError("data.max_bytes and data.bin_vocab_size must be >= 0")
        if self.bin_vocab_size > 2**16:
            raise ValueError(f".bin shards hold uint16 token ids (nanoGPT's format): data.bin_vocab_size must be at "
                             f"most 65536, got {self.bin_vocab_size}; a larger vocabulary needs its text and "
                             "data.tokenizer instead")
        if self.shards < 1:
            raise ValueError(f"data.shards must be >= 1, got {self.shards}")
        if self.shuffle_window < 1:
            raise ValueError(f"data.shuffle_window must be >= 1 (1 reads in order), got {self.shuffle_window}")
        if not self.text_field or not self.split:
            raise ValueError("data.text_field and data.split must not be empty")
        if self.tokenizer_sha256 and not self.tokenizer:
            raise ValueError("data.tokenizer_sha256 pins a tokenizer file: set data.tokenizer to its path too")
        if self.tokenizer:
            digest = file_sha256(self.tokenizer, what="data.tokenizer")
            if self.tokenizer_sha256 and self.tokenizer_sha256 != digest:
                raise ValueError(f"data.tokenizer {self.tokenizer} has sha256 {digest}, but the run pins "
                                 f"{self.tokenizer_sha256}: use the run's tokenizer file (or update the pin)")
            object.__setattr__(self, "tokenizer_sha256", digest)
        if self.tokenizer and (self.source == "stdlib" or self.source.endswith(".bin")):
            raise ValueError(f"data.tokenizer reads documents (.txt, .jsonl or .parquet files, or hf:NAME), but "
                             f"data.source {self.source!r} is a token array read as it is (the embedded stdlib "
                             "sources as bytes, .bin shards as token ids): point data.source at text documents, or "
                             "remove data.tokenizer")

    @property
    def streamed(self) -> bool:
        """Whether the source is read as documents through ``datasets`` (trainer/stream.py) rather than as one token
        array (trainer/data.py): a hub dataset, .jsonl/.parquet files, a glob, or any text with a tokenizer."""
        return is_streamed_source(self.source) or bool(self.tokenizer)


NEW_DATA_FIELDS = ("tokenizer_sha256", "eot_token", "hf_config", "split", "text_field", "shards", "shuffle_window")
"""DataConfig fields newer than the run ids in use: left out of the canonical form while at their defaults."""


ACCESS_MODES = ("open", "closed")


@dataclass(frozen=True, kw_only=True)
class AccessConfig:
    """Who may join the run: anyone (open), or peers holding a credential signed by the organiser (closed)."""

    mode: str = "open"
    """'open': any peer may join (strangers are contained, not excluded); 'closed': only admitted peers."""
    organiser_key: str = ""
    """Closed runs: the organiser's public key (base64 libp2p key, printed by `asyncmesh-peer admit --new-key`)."""

    def __post_init__(self) -> None:
        if self.mode not in ACCESS_MODES:
            raise ValueError(f"access.mode must be one of {ACCESS_MODES}, got {self.mode!r}")
        if self.mode == "closed":
            try:
                key = base64.b64decode(self.organiser_key, validate=True)
            except ValueError:
                key = b""
            if not key:
                raise ValueError("a closed run needs access.organiser_key (base64; `asyncmesh-peer admit --new-key`)")
        elif self.organiser_key:
            raise ValueError("access.organiser_key is only for closed runs (access.mode = \"closed\")")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything that must be identical on every peer of one swarm."""

    name: str = "default"
    """Human-readable name shown on dashboards."""
    seed: int = 0
    """Seeds the initial weights, the averaging partitions and the data shards."""
    n_stages: int = 2
    """Pipeline stages the model is split into."""
    layers_per_stage: tuple[int, ...] = ()
    """Explicit split of model.n_layer over the stages; empty splits as evenly as possible."""
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    access: AccessConfig = field(default_factory=AccessConfig)

    def __post_init__(self) -> None:
        if self.n_stages < 1:
            raise ValueError(f"n_stages must be >= 1, got {self.n_stages}")
        object.__setattr__(self, "layers_per_stage", tuple(self.layers_per_stage))
        stage_layer_ranges(self)  # validates the split
        if self.model.tie_embeddings and self.n_stages != 1:
            raise ValueError("model.tie_embeddings shares the embedding with the head, so both must be on one stage: "
                             f"it needs n_stages = 1 (this run has {self.n_stages}); untie them for a pipeline")
        if self.data.tokenizer:
            need = tokenizer_vocab_size(self.data.tokenizer)
            if need > self.model.vocab_size:
                raise ValueError(f"model.vocab_size ({self.model.vocab_size}) is smaller than the vocabulary of "
                                 f"data.tokenizer {self.data.tokenizer} ({need} token ids): set "
                                 f"model.vocab_size = {need} (or more, e.g. a multiple of 64)")
        elif self.data.streamed and self.model.vocab_size < 256:
            raise ValueError(f"data.source {self.data.source} is read as documents, byte by byte without "
                             f"data.tokenizer: model.vocab_size must be at least 256, got {self.model.vocab_size}")
        if self.compression.subspace:
            if not self.compression.subspace_rank < self.model.n_embd:
                raise ValueError(f"compression.subspace_rank ({self.compression.subspace_rank}) must be below "
                                 f"model.n_embd ({self.model.n_embd})")
            if self.model.dropout:
                raise ValueError('"subspace" compression needs model.dropout = 0: dropout scales each coordinate of '
                                 "the residual writes and would take them out of the subspace")
        if self.data.bin_vocab_size and self.data.bin_vocab_size != self.model.vocab_size:
            raise ValueError(
                f"data.bin_vocab_size ({self.data.bin_vocab_size}) must equal "
                f"model.vocab_size ({self.model.vocab_size})"
            )

    # --- identity -------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layers_per_stage"] = list(self.layers_per_stage)
        d["model"] = self.model.id_dict()
        if self.access == AccessConfig():
            del d["access"]  # open runs keep the run ids they had before access control existed
        default_data = DataConfig()
        for name in NEW_DATA_FIELDS:  # runs without these settings keep the run ids they had before them
            if getattr(self.data, name) == getattr(default_data, name):
                del d["data"][name]
        del d["data"]["tokenizer"]  # a path differs between machines; tokenizer_sha256 stands for the file
        if not self.compression.subspace:
            del d["compression"]["subspace_table_std"]  # unused without subspaces
            if self.compression.subspace_codec == "none":
                del d["compression"]["subspace_rank"], d["compression"]["subspace_codec"]  # run ids as before
        return d

    def canonical_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @property
    def run_id(self) -> str:
        """16 hex digits of sha256 over the canonical config; prefixes every DHT key of this run."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]

    # --- loading ----------------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        """Strict: an unknown key is an error that names it (a typo must not silently fork the run)."""
        sections = {"model": ModelConfig, "optim": OptimConfig, "averaging": AveragingConfig,
                    "compression": CompressionConfig, "data": DataConfig, "access": AccessConfig}
        kwargs: dict[str, Any] = {}
        top_fields = {f.name for f in dataclasses.fields(cls)}
        for key, value in d.items():
            if key not in top_fields:
                raise ValueError(f"unknown key {key!r} in run config; known keys: {sorted(top_fields)}")
            if key in sections:
                if not isinstance(value, dict):
                    raise ValueError(f"[{key}] must be a table, got {type(value).__name__}")
                kwargs[key] = _build_section(sections[key], key, value)
            elif key == "layers_per_stage":
                kwargs[key] = tuple(value)
            else:
                kwargs[key] = value
        return cls(**kwargs)

    @classmethod
    def from_toml(cls, path: str | Path) -> RunConfig:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise ValueError(f"cannot read run file {path}: {e}. Pass an existing TOML file to --run.") from e
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"run file {path} is not valid TOML: {e}") from e
        tok = data.get("data", {}).get("tokenizer") if isinstance(data.get("data"), dict) else None
        if isinstance(tok, str) and tok:  # relative to the run file, so a run folder can be moved or shared
            data["data"]["tokenizer"] = str((path.parent / Path(tok).expanduser()).resolve())
        return cls.from_dict(data)

    @classmethod
    def default(cls) -> RunConfig:
        """The embedded default run shipped inside the package."""
        text = resources.files("trainer").joinpath("runs/default.toml").read_text()
        return cls.from_dict(tomllib.loads(text))

    def replace(self, **sections: Any) -> RunConfig:
        """Copy with overrides; a section may be given as a dict of its fields, e.g. replace(optim={"lr": 1e-3})."""
        kwargs: dict[str, Any] = {}
        for key, value in sections.items():
            current = getattr(self, key)
            if dataclasses.is_dataclass(current) and not isinstance(current, type) and isinstance(value, dict):
                _check_types(type(current), key, value)
                kwargs[key] = dataclasses.replace(current, **value)
            else:
                kwargs[key] = value
        return dataclasses.replace(self, **kwargs)

    def to_toml(self) -> str:
        """Write the config as TOML (round-trips through from_toml to the same run id)."""
        lines = []
        d = self.to_dict()
        if self.data.tokenizer:  # the file's absolute path: the TOML is read back on this machine
            d["data"]["tokenizer"] = str(Path(self.data.tokenizer).resolve())
        for key, value in d.items():
            if not isinstance(value, dict):
                lines.append(f"{key} = {_toml_value(value)}")
        for key, value in d.items():
            if isinstance(value, dict):
                lines.append(f"\n[{key}]")
                lines.extend(f"{k} = {_toml_value(v)}" for k, v in value.items())
        return "\n".join(lines) + "\n"


_SCALARS: dict[Any, tuple[str, Callable[[Any], bool]]] = {
    bool: ("true or false", lambda v: isinstance(v, bool)),
    int: ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    float: ("a number", lambda v: isinstance(v, int | float) and not isinstance(v, bool)),
    str: ("a string", lambda v: isinstance(v, str)),
}


def _build_section(cls: type, name: str, values: dict[str, Any]) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"unknown key(s) {sorted(unknown)} in [{name}]; known keys: {sorted(known)}")
    _check_types(cls, name, values)
    return cls(**values)


def _check_types(cls: type, name: str, values: dict[str, Any]) -> None:
    """A ValueError for a value of the wrong kind in section ``name``: a quoted number or a fraction where a count
    goes fails here, with its key, instead of as a TypeError deep in a check or mid-run."""
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        what, ok = _SCALARS.get(hints.get(key), ("", lambda v: True))
        if not ok(value):
            quoted = " (in TOML a value in quotes is a string: remove them)" if isinstance(value, str) else ""
            raise ValueError(f"{name}.{key} must be {what}, got {value!r} ({type(value).__name__}){quoted}")


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def stage_layer_ranges(run: RunConfig) -> list[tuple[int, int]]:
    """Half-open ranges [start, end) of transformer blocks held by each stage.

    Stage 0 also holds the embeddings and the last stage the final norm, head and loss, so a stage may hold zero
    blocks only when it is the first or the last. With no explicit split, blocks are spread as evenly as possible,
    earlier stages taking the remainder (they carry no head).
    """
    n_layer, k = run.model.n_layer, run.n_stages
    if run.layers_per_stage:
        counts = list(run.layers_per_stage)
        if len(counts) != k:
            raise ValueError(f"layers_per_stage has {len(counts)} entries but n_stages is {k}")
        if any(c < 0 for c in counts) or sum(counts) != n_layer:
            raise ValueError(f"layers_per_stage {counts} must be non-negative and sum to model.n_layer ({n_layer})")
    else:
        if k > n_layer + 2 or (k > 2 and n_layer < k - 2):
            raise ValueError(f"cannot split {n_layer} layers into {k} stages; use fewer stages or more layers")
        base, extra = divmod(n_layer, k)
        counts = [base + (1 if s < extra else 0) for s in range(k)]
    for s, c in enumerate(counts):
        if c == 0 and 0 < s < k - 1:
            raise ValueError(f"middle stage {s} would hold no transformer block; adjust layers_per_stage")
    ranges, start = [], 0
    for c in counts:
        ranges.append((start, start + c))
        start += c
    return ranges
