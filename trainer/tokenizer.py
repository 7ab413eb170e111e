"""Tokenizers: byte level (the embedded default, vocab 256) or a Hugging Face ``tokenizers`` file named by the run.

A run names its tokenizer with ``data.tokenizer`` (a ``tokenizer.json``); the file's sha256 is part of the run id, so
two runs with different tokenizers never mix. ``asyncmesh-peer tokenizer`` trains a byte-level BPE one from a run's
data (``train_bpe``). Documents are joined with the end-of-text id (``data.eot_token``; byte level uses byte 0, which
text does not hold). ``tokenizers`` and ``datasets`` are optional (``pip install 'asyncmesh[hf]'``) and imported only
when a run needs them (``import_hf``).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from trainer.config import DataConfig, RunConfig

BYTE_EOT_ID = 0
HF_EXTRA = "pip install 'asyncmesh[hf]'"
DEFAULT_EOT = "<|endoftext|>"


class MissingExtra(ImportError):
    """A run needs an optional package of the ``hf`` extra that is not installed."""


def import_hf(name: str, why: str) -> ModuleType:
    """Import an optional package of the ``hf`` extra, or raise MissingExtra saying how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise MissingExtra(f"{why} needs the '{name}' package: {HF_EXTRA}") from e


class Tokenizer(Protocol):
    vocab_size: int
    eot_id: int

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocab 256); byte 0 ends a document."""

    vocab_size = 256
    eot_id = BYTE_EOT_ID

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8", errors="replace")) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 < i < 256).decode("utf-8", errors="replace")


class FileTokenizer:
    """A Hugging Face ``tokenizers`` file (tokenizer.json)."""

    def __init__(self, path: str | Path, eot_token: str = DEFAULT_EOT) -> None:
        tokenizers = import_hf("tokenizers", f"data.tokenizer {path}")
        try:
            self.tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises its own exception types for unreadable files
            raise ValueError(f"data.tokenizer {path} cannot be loaded by the tokenizers library: {e}") from e
        eot = self.tok.token_to_id(eot_token)
        if eot is None:
            raise ValueError(f"data.tokenizer {path} has no token {eot_token!r} to end documents with; set "
                             "data.eot_token to its end-of-text token (e.g. '</s>' or '<|end_of_text|>')")
        self.eot_id = int(eot)
        self.vocab_size = int(self.tok.get_vocab_size(with_added_tokens=True))
        self.path = Path(path)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids))


def load_tokenizer(cfg: DataConfig) -> Tokenizer:
    """The run's tokenizer: the file of ``data.tokenizer``, else byte level."""
    return FileTokenizer(cfg.tokenizer, cfg.eot_token) if cfg.tokenizer else ByteTokenizer()


def tokenizer_path(run: RunConfig) -> Path | None:
    """The run's tokenizer.json (what an exported model ships with), or None for the byte-level default."""
    return Path(run.data.tokenizer) if run.data.tokenizer else None


def train_bpe(texts: Iterable[str], *, vocab_size: int, out: str | Path, eot_token: str = DEFAULT_EOT) -> Path:
    """Train a byte-level BPE tokenizer on ``texts`` and write it to ``out`` (tokenizer.json). Every byte has a
    token, so any text encodes; ``eot_token`` is its first special token (id 0)."""
    tokenizers = import_hf("tokenizers", "training a tokenizer")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + 1:
        raise ValueError(f"--vocab-size must be at least 257 (256 bytes and the end-of-text token), got {vocab_size}")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eot_token], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return out
