"""What a run's data settings name, read without heavy imports: whether a source is streamed as documents
(trainer/stream.py) or read as one token array (trainer/data.py), and a tokenizer file's digest and vocabulary (the run
id and the vocabulary check need them before any optional package is imported)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

HUB_PREFIX = "hf:"
"""``data.source = "hf:NAME"`` streams the Hugging Face dataset NAME."""
DOCUMENT_FILES = {".txt": "text", ".jsonl": "json", ".parquet": "parquet"}
"""Local files read as documents through ``datasets``: suffix -> the ``datasets`` builder that reads them."""
STREAM_SUFFIXES = tuple(suffix for suffix in DOCUMENT_FILES if suffix != ".txt")
"""Local files always streamed as documents (.txt too once the run names a tokenizer; else it is read as bytes)."""


def is_streamed_source(source: str) -> bool:
    """A hub dataset, a glob, or .jsonl/.parquet files (a file, or a folder holding some)."""
    if source == "stdlib":
        return False
    return source.startswith(HUB_PREFIX) or any(c in source for c in "*?[") or source.endswith(STREAM_SUFFIXES) or (
        Path(source).expanduser().is_dir() and any(
            p.suffix in STREAM_SUFFIXES for p in Path(source).expanduser().rglob("*")))


def file_sha256(path: str | Path, *, what: str) -> str:
    """sha256 of a file, or a ValueError naming the setting it came from."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path}: {e}; train one with `asyncmesh-peer tokenizer` or fix the "
                         "path (relative paths are taken from the run file's folder)") from e


def tokenizer_vocab_size(path: str | Path) -> int:
    """Token ids a tokenizer.json can produce (the largest id of its vocabulary and added tokens, plus one), read
    from the JSON so that validating a run does not need the ``tokenizers`` package."""
    try:
        spec = json.loads(Path(path).read_text())
        vocab = spec.get("model", {}).get("vocab", {})
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
        ids += [t["id"] for t in spec.get("added_tokens") or []]
        return max(int(i) for i in ids) + 1
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"data.tokenizer {path} is not a Hugging Face tokenizer.json ({e})") from e
