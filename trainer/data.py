"""Tokens as one array: the embedded default corpus, user corpora, per-replica batch streams, a fixed validation set.
(Hugging Face datasets, .jsonl/.parquet files and tokenized text are streamed documents instead: trainer/stream.py.)

Default (``data.source = "stdlib"``): the ``.py`` sources of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``, present on every install; ``site-packages`` is skipped), byte-level (vocab 256).
Files are split into train/validation by a hash of their relative path (deterministic, independent of the machine),
read in sorted order, and capped at ``data.max_bytes``: each split stops reading once its share of the cap
(``1 - val_fraction`` for train, ``val_fraction`` for validation) is reached. Peers on different Python versions see
different stdlib sources; a swarm that needs bit-identical data across machines passes ``--data``.

``data.source = PATH``: a text file or a folder of text files (recursively; extensions ``TEXT_SUFFIXES``; bytes used
as-is, vocab 256), or pre-tokenized uint16 ``.bin`` shards (nanoGPT format, read with ``np.memmap``; their vocab size
is declared by ``data.bin_vocab_size`` and checked against the tokens). A folder holding ``train.bin`` and
``val.bin`` uses them as the two splits, memory-mapped and uncapped; a single shard is memory-mapped and uncapped too;
several other shards are split by file hash like text and concatenated in memory up to ``max_bytes``. When the hash
split leaves one side empty (a single file), the last ``val_fraction`` of the tokens becomes the validation split.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.config import DataConfig

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst", ".json", ".csv", ".html", ".c", ".h", ".tex", ".toml", ".yaml")
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", ".git"})
MIN_SPLIT_TOKENS = 1024
"""Each split must hold at least this many tokens (a handful of sequences) or loading fails with advice."""


class DataError(ValueError):
    """The corpus cannot be used: missing path, too small, or tokens out of the vocabulary."""


@dataclass(frozen=True)
class Corpus:
    """Token arrays of the two splits (uint8 for bytes, uint16 for .bin shards; possibly memory-mapped)."""

    train: np.ndarray
    val: np.ndarray


def corpus_identity(corpus: Corpus) -> dict[str, object]:
    """What a results file records about its data: a digest of both splits, their sizes and the Python version (the
    default 'stdlib' corpus is the running interpreter's own sources, so two interpreters train on different data)."""
    h = hashlib.sha256()
    for split in (corpus.train, corpus.val):
        h.update(np.ascontiguousarray(split).tobytes())
        h.update(b"|")
    return {"corpus_sha256": h.hexdigest()[:16], "train_tokens": int(len(corpus.train)),
            "val_tokens": int(len(corpus.val)), "python": platform.python_version()}


def _is_val(rel_path: str, val_fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "little")
    return h / 2**64 < val_fraction


def _walk(root: Path, suffixes: tuple[str, ...]) -> list[tuple[str, Path]]:
    """(relative path, path) of matching files under root, sorted by relative path."""
    if root.is_file():
        return [(root.name, root)]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
        for f in files:
            if f.endswith(suffixes):
                p = Path(d) / f
                out.append((p.relative_to(root).as_posix(), p))
    return sorted(out)


def _read_capped(files: list[Path], cap: int) -> bytes:
    """Concatenate files in order, stopping once ``cap`` bytes are read (cap 0: no limit)."""
    parts, total = [], 0
    for p in files:
        remaining = cap - total if cap else -1
        try:
            with open(p, "rb") as f:
                chunk = f.read(remaining) if cap else f.read()
        except OSError as e:
            raise DataError(f"cannot read {p}: {e}; fix its permissions or remove it from the data folder") from e
        parts.append(chunk)
        total += len(chunk)
        if cap and total >= cap:
            break
    return b"".join(parts)


def _tail_split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    n_val = max(1, int(len(tokens) * val_fraction))
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]


def _load_text(root: Path, cfg: DataConfig, files: list[tuple[str, Path]]) -> Corpus:
    train_files = [p for rel, p in files if not _is_val(rel, cfg.val_fraction)]
    val_files = [p for rel, p in files if _is_val(rel, cfg.val_fraction)]
    if not train_files or not val_files:
        data = _read_capped([p for _, p in files], cfg.max_bytes)
        train, val = _tail_split(np.frombuffer(data, dtype=np.uint8), cfg.val_fraction)
        return Corpus(train, val)
    cap_train = int(cfg.max_bytes * (1 - cfg.val_fraction)) if cfg.max_bytes else 0
    cap_val = max(1, int(cfg.max_bytes * cfg.val_fraction)) if cfg.max_bytes else 0
    train = np.frombuffer(_read_capped(train_files, cap_train), dtype=np.uint8)
    val = np.frombuffer(_read_capped(val_files, cap_val), dtype=np.uint8)
    return Corpus(train, val)


def _memmap(path: Path) -> np.ndarray:
    if path.stat().st_size % 2:
        raise DataError(f"{path} has an odd number of bytes; a .bin shard must hold uint16 tokens (nanoGPT format)")
    return np.memmap(path, dtype=np.uint16, mode="r")


def _concat_bins(paths: list[Path], cap_tokens: int) -> np.ndarray:
    """One shard stays memory-mapped (a slice of a memmap is free); several are concatenated in memory, in order,
    stopping at ``cap_tokens`` (0: no cap)."""
    arrays = [_memmap(p) for p in paths]
    if len(arrays) == 1:
        return arrays[0][:cap_tokens] if cap_tokens else arrays[0]
    parts, total = [], 0
    for a in arrays:
        take = a if not cap_tokens else a[: cap_tokens - total]
        parts.append(np.asarray(take))
        total += len(take)
        if cap_tokens and total >= cap_tokens:
            break
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


def _load_bins(root: Path, cfg: DataConfig, files: list[tuple[str, Path]], vocab_size: int) -> Corpus:
    if cfg.bin_vocab_size == 0:
        raise DataError(f"{root} holds pre-tokenized .bin shards: set data.bin_vocab_size to their vocabulary size")
    if cfg.bin_vocab_size != vocab_size:
        raise DataError(f"data.bin_vocab_size ({cfg.bin_vocab_size}) must equal model.vocab_size ({vocab_size})")
    names = {rel: p for rel, p in files}
    cap = cfg.max_bytes // 2 if len(files) > 1 else 0  # a lone memory-mapped shard costs no memory: no cap
    presplit = "train.bin" in names and "val.bin" in names  # read whole, memory-mapped
    total = sum(p.stat().st_size // 2 for _, p in files)
    if cap and not presplit and total > cap:
        logger.warning("data.max_bytes = %d reads %d of the %d tokens of the %d shards in %s (several shards are "
                       "concatenated in memory, 2 bytes a token): set data.max_bytes = 0 to train on all of them",
                       cfg.max_bytes, cap, total, len(files), root)
    if presplit:
        corpus = Corpus(_concat_bins([names["train.bin"]], 0), _concat_bins([names["val.bin"]], 0))
    else:
        train_p = [p for rel, p in files if not _is_val(rel, cfg.val_fraction)]
        val_p = [p for rel, p in files if _is_val(rel, cfg.val_fraction)]
        if train_p and val_p:
            cap_train = int(cap * (1 - cfg.val_fraction)) if cap else 0
            cap_val = max(1, int(cap * cfg.val_fraction)) if cap else 0
            corpus = Corpus(_concat_bins(train_p, cap_train), _concat_bins(val_p, cap_val))
        else:
            corpus = Corpus(*_tail_split(_concat_bins([p for _, p in files], cap), cfg.val_fraction))
    for split, arr in (("train", corpus.train), ("val", corpus.val)):
        top = int(arr.max()) if len(arr) else 0
        if top >= vocab_size:
            raise DataError(
                f"{split} split of {root} holds token id {top} >= vocab size {vocab_size}; "
                "set data.bin_vocab_size and model.vocab_size to the tokenizer's vocabulary size"
            )
    return corpus


def stdlib_root() -> Path:
    """The running interpreter's standard library folder: the embedded default corpus."""
    return Path(sysconfig.get_paths()["stdlib"])


def load_corpus(cfg: DataConfig, vocab_size: int) -> Corpus:
    """Load the run's corpus; raises DataError (a ValueError) with advice when it cannot be used."""
    if cfg.streamed:
        raise DataError(f"data.source {cfg.source!r} is streamed as documents (trainer/stream.py), which only "
                        "stage-0 peers read; the simulator reads token arrays: use 'stdlib', text or .bin shards")
    suffixes: tuple[str, ...]
    if cfg.source == "stdlib":
        root, suffixes = stdlib_root(), (".py",)
    else:
        root, suffixes = Path(cfg.source).expanduser(), TEXT_SUFFIXES + (".bin",)
        if not root.exists():
            raise DataError(f"data path {root} does not exist; pass a text file, a folder, or .bin shards to --data")
    files = _walk(root, suffixes)
    if not files:
        raise DataError(f"no usable files under {root} (looked for {', '.join(suffixes)})")
    bins = [(rel, p) for rel, p in files if rel.endswith(".bin")]
    if bins and len(bins) != len(files):
        raise DataError(f"{root} mixes .bin shards and text files; put them in separate folders")
    if bins:
        corpus = _load_bins(root, cfg, bins, vocab_size)
    else:
        if vocab_size < 256:
            raise DataError(f"text is read as bytes (vocab 256) but model.vocab_size is {vocab_size}; set it to 256")
        corpus = _load_text(root, cfg, files)
    for split, arr in (("train", corpus.train), ("val", corpus.val)):
        if len(arr) < MIN_SPLIT_TOKENS:
            raise DataError(
                f"the {split} split of {root} holds {len(arr)} tokens, fewer than {MIN_SPLIT_TOKENS}; "
                "add data, raise data.max_bytes, or adjust data.val_fraction"
            )
    logger.info("corpus %s: %d train tokens, %d validation tokens", root, len(corpus.train), len(corpus.val))
    return corpus


def shard_seed(run_seed: int, who: int | str) -> int:
    """A batch-stream seed for one replica (int) or peer (peer id string): every data reader gets its own shard."""
    digest = hashlib.sha256(f"asyncmesh-data/{run_seed}/{who}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class BatchStream:
    """Endless random windows of a token array; deterministic for a seed, different seeds read different offsets.

    ``next()`` returns (x, y) LongTensors [B, T] with y the next-token targets of x.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int) -> None:
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be positive, got {seq_len} and {batch_size}")
        if len(tokens) < seq_len + 2:
            raise DataError(f"{len(tokens)} tokens cannot fill one sequence of {seq_len}; use a larger corpus")
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.rng = np.random.default_rng(seed)
        self.batches = 0
        self.key = f"windows/{seed}"
        """Which stream a saved position belongs to (peer.pipeline.ledger)."""

    def position_dict(self) -> dict[str, object]:
        """The stream's position: the batches drawn and the generator's state (``resume`` continues from it)."""
        return {"batches": self.batches, "rng": self.rng.bit_generator.state}

    def resume(self, position: dict[str, Any]) -> None:
        """Continue from a ``position_dict`` of a stream of the same key; a malformed one raises DataError."""
        try:
            self.rng.bit_generator.state = position["rng"]
            self.batches = int(position["batches"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"a saved data position is malformed ({e!r})") from e

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = self.rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch_size)
        self.batches += 1
        return _windows(self.tokens, offsets, self.seq_len)

    __next__ = next

    def __iter__(self) -> BatchStream:
        return self


def _windows(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([np.asarray(tokens[o : o + seq_len + 1], dtype=np.int64) for o in offsets])  # [B, T+1]
    xy = torch.from_numpy(rows)
    return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()  # x, y: [B, T]


def val_batches(corpus: Corpus, seq_len: int, batch_size: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed validation set: n batches at evenly spaced offsets of the val split, the same for every peer."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    tokens = corpus.val
    if len(tokens) < seq_len + 2:
        raise DataError(f"validation split has {len(tokens)} tokens, too few for one sequence of {seq_len}")
    offsets = np.linspace(0, len(tokens) - seq_len - 1, n * batch_size).astype(np.int64)
    return [_windows(tokens, offsets[i * batch_size : (i + 1) * batch_size], seq_len) for i in range(n)]
