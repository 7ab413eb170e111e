"""Streamed documents: a hub dataset or local .txt/.jsonl/.parquet files, read through ``datasets`` in streaming mode,
tokenized, joined with the end-of-text id and cut into fixed-length training sequences of ``block_size + 1`` tokens.

**Where documents go.** Document ``i`` of the stream (its index in the source's order) goes by a hash of ``i`` alone
(``doc_role``): a ``val_fraction`` of them is held out as the validation set, and each other one belongs to exactly one
of ``data.shards`` training shards. The validation set is the first sequences of the held-out documents, the same for
every peer. A stage-0 peer reads one shard (which one: ``peer.pipeline.shards``), so two peers on different shards
never read the same document; a shard is read in order and starts again at its end (the next epoch).

**Shuffled windows.** Read in order, a long document fills dozens of consecutive micro-batches: the model chases
that one file and its validation loss rises while its training loss falls. So the sequences of a shard are taken in
windows of ``data.shuffle_window`` consecutive ones and handed out in a random order within each window, seeded by
the window's start (``shuffled``); the validation set is the start of the held-out documents' first window, drawn
the same way, so it spans many documents.

**The data position** (``DataPosition``) says exactly how far a shard was read: the document and token where the
current window starts, how many of its sequences were handed out, the sequences handed out in all and the epoch (a
few integers: a window is read and tokenized again on resume). ``ShardStream`` resumes from one, so a restarted peer
continues its shard where its checkpoint says it stopped. A background thread reads and tokenizes ahead; the
position returned is that of the last batch handed out, not of the read-ahead.
"""

from __future__ import annotations

import glob
import hashlib
import queue
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.config import DataConfig
from trainer.data import DataError
from trainer.sources import DOCUMENT_FILES, HUB_PREFIX
from trainer.tokenizer import Tokenizer, import_hf

READ_AHEAD = 8  # batches the reading thread keeps ready
CLOSE_TIMEOUT_S = 2.0  # how long close() waits for the reading thread to notice
VAL = -1


@dataclass
class DataPosition:
    """How far a shard was read (see the module docstring); saved with the checkpoints (peer.pipeline.ledger)."""

    shard: int
    doc: int = 0
    """Index in the source's order of the document holding the first token of the current window (in order: of the
    next sequence)."""
    offset: int = 0
    """That token's index in the document's tokens (its end-of-text id counted last)."""
    sequences: int = 0
    """Sequences handed out from this shard since its first epoch."""
    epoch: int = 0
    """The epoch of the window's first sequence."""
    taken: int = 0
    """Sequences of the current window already handed out."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataPosition:
        try:
            pos = cls(shard=int(d["shard"]), doc=int(d["doc"]), offset=int(d["offset"]),
                      sequences=int(d["sequences"]), epoch=int(d["epoch"]), taken=int(d.get("taken", 0)))
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"a saved data position is malformed ({e!r})") from e
        if min(pos.shard, pos.doc, pos.offset, pos.sequences, pos.epoch, pos.taken) < 0:
            raise DataError(f"a saved data position has negative fields: {d}")
        return pos


def doc_role(index: int, cfg: DataConfig) -> int:
    """VAL (-1) for a held-out document, else its training shard in [0, cfg.shards)."""
    u = int.from_bytes(hashlib.sha256(f"asyncmesh-doc/{index}".encode()).digest()[:8], "little") / 2**64
    if u < cfg.val_fraction:
        return VAL
    return min(cfg.shards - 1, int((u - cfg.val_fraction) / (1 - cfg.val_fraction) * cfg.shards))


def local_files(source: str) -> tuple[str, list[str]]:
    """(datasets builder, sorted files) of a local source: a file, a folder (recursively) or a glob, all of one kind
    (.txt, .jsonl or .parquet)."""
    root = Path(source).expanduser()
    if any(c in source for c in "*?["):
        files = sorted(glob.glob(str(root), recursive=True))
    elif root.is_dir():
        files = sorted(str(p) for p in root.rglob("*") if p.suffix in DOCUMENT_FILES)
    elif root.is_file():
        files = [str(root)]
    else:
        raise DataError(f"data source {source} does not exist; pass a file, a folder or a glob of .txt, .jsonl or "
                        ".parquet files, or hf:NAME for a Hugging Face dataset")
    kinds = {Path(f).suffix for f in files}
    if not files:
        raise DataError(f"data source {source} holds no .txt, .jsonl or .parquet file; a source read as documents "
                        "(one with data.tokenizer set, or of .jsonl/.parquet files) must: other files (.py, .bin) are "
                        "read as bytes or token ids, without data.tokenizer")
    if not kinds <= set(DOCUMENT_FILES):
        raise DataError(f"data source {source} must hold .txt, .jsonl or .parquet files (found {sorted(kinds)})")
    if len(kinds) > 1:
        raise DataError(f"data source {source} mixes {sorted(kinds)} files; put each kind in its own folder")
    return DOCUMENT_FILES[kinds.pop()], files


def open_dataset(cfg: DataConfig) -> Any:
    """The source as a ``datasets`` streaming IterableDataset, in its fixed order."""
    datasets = import_hf("datasets", f"data.source {cfg.source!r}")
    if cfg.source.startswith(HUB_PREFIX):
        name = cfg.source.removeprefix(HUB_PREFIX)
        try:
            return datasets.load_dataset(name, cfg.hf_config or None, split=cfg.split, streaming=True)
        except Exception as e:  # the hub client raises many types (missing dataset, no network, bad config)
            raise DataError(f"cannot stream the Hugging Face dataset {name!r} (config {cfg.hf_config or 'default'}, "
                            f"split {cfg.split}): {e}") from e
    builder, files = local_files(cfg.source)
    kwargs = {"sample_by": "document"} if builder == "text" else {}  # a .txt file is one document, not one per line
    return datasets.load_dataset(builder, data_files=files, split="train", streaming=True, **kwargs)


def documents(cfg: DataConfig, start: int = 0) -> Iterator[tuple[int, str]]:
    """(index, text) of every document of the source from index ``start`` on."""
    ds = open_dataset(cfg)
    if start:
        ds = ds.skip(start)
    rows = iter(enumerate(ds, start))
    i = start
    while True:
        try:
            i, row = next(rows)
        except StopIteration:
            return
        except DataError:
            raise
        except (UnicodeDecodeError, ValueError) as e:  # the readers' own errors name neither the run nor a fix
            raise DataError(f"cannot read the documents of data.source {cfg.source} (from document {i} on): "
                            f"{type(e).__name__}: {e}. .txt files must be UTF-8 text, .jsonl files one JSON object "
                            "per line") from e
        text = row.get(cfg.text_field) if isinstance(row, dict) else None
        if text is None:
            raise DataError(f"document {i} of {cfg.source} has no field {cfg.text_field!r} (fields: "
                            f"{sorted(row) if isinstance(row, dict) else type(row).__name__}); set data.text_field")
        yield i, str(text)


def _rows(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    xy = torch.from_numpy(np.asarray(rows, dtype=np.int64))  # [B, T+1]
    return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()


def sequences(cfg: DataConfig, tok: Tokenizer, seq_len: int, pos: DataPosition, role: int,
              ) -> Iterator[tuple[list[int], DataPosition]]:
    """Sequences of ``seq_len + 1`` tokens of the documents of ``role`` (a shard, or VAL) joined with the end-of-text
    id, in order, each with the position right after it; endless for a shard (epochs), one pass for VAL. The tokens
    left at the end of a pass (fewer than one sequence) are dropped. ``pos.taken`` is ignored."""
    pos, n = DataPosition(**{**pos.to_dict(), "taken": 0}), seq_len + 1
    while True:
        found, yielded, pass_start = False, False, (pos.doc, pos.offset)
        segments: deque[tuple[int, int, list[int]]] = deque()  # (doc, offset of its first token, tokens) not cut yet
        held = 0
        for i, text in documents(cfg, pos.doc):
            if doc_role(i, cfg) != role:
                continue
            found = True
            skip = pos.offset if i == pos.doc else 0
            tokens = (tok.encode_batch([text])[0] + [tok.eot_id])[skip:]
            if not tokens:
                continue
            segments.append((i, skip, tokens))
            held += len(tokens)
            while held >= n:
                seq: list[int] = []
                while len(seq) < n:
                    doc, off, toks = segments.popleft()
                    take = toks[: n - len(seq)]
                    seq += take
                    if len(take) < len(toks):
                        segments.appendleft((doc, off + len(take), toks[len(take):]))
                held -= n
                pos.doc, pos.offset = (segments[0][0], segments[0][1]) if segments else (i + 1, 0)
                pos.sequences += 1
                yielded = True
                yield seq, DataPosition(**pos.to_dict())
        if role == VAL:
            return
        if not found and pass_start == (0, 0):
            raise DataError(f"shard {role} of {cfg.source} holds no document: use fewer data.shards or more data")
        if not yielded and pass_start == (0, 0):  # else every epoch re-reads the source and never yields
            raise DataError(f"shard {role} of {cfg.source} holds {held} tokens, fewer than one sequence of {n} "
                            "(block_size + 1): use fewer data.shards, a smaller model.block_size or more data")
        pos.doc, pos.offset, pos.epoch = 0, 0, pos.epoch + 1


def _window_order(role: int, start: DataPosition, size: int) -> np.ndarray:
    """The order in which a window of ``size`` sequences starting at ``start`` is handed out (the same everywhere)."""
    key = f"asyncmesh-window/{role}/{start.epoch}/{start.doc}/{start.offset}".encode()
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
    return np.random.default_rng(seed).permutation(size)


def shuffled(cfg: DataConfig, tok: Tokenizer, seq_len: int, pos: DataPosition, role: int, window: int | None = None,
             ) -> Iterator[tuple[list[int], DataPosition]]:
    """``sequences`` in windows of ``window`` (default ``cfg.shuffle_window``), each handed out in its seeded order,
    with the position after each sequence (``taken`` of the window handed out; a full window moves the start on)."""
    size = window or cfg.shuffle_window
    skip = pos.taken
    start = DataPosition(**{**pos.to_dict(), "sequences": pos.sequences - skip, "taken": 0})  # the window's start
    inner = sequences(cfg, tok, seq_len, start, role)
    while True:
        seqs: list[list[int]] = []  # this window's sequences, in reading order
        after = start  # the position after the window's last sequence
        for seq, pos_after in inner:
            seqs.append(seq)
            after = pos_after
            if len(seqs) == size:
                break
        if not seqs:
            return
        if skip > len(seqs):
            raise DataError(f"a saved data position is past the end of its window ({skip} of {len(seqs)} "
                            "sequences taken): it belongs to another source or shuffle_window; delete the peer's "
                            "checkpoint folder's data position to start the shard afresh")
        order = _window_order(role, start, len(seqs))
        for k in range(skip, len(seqs)):
            full = k + 1 == len(seqs)
            here = DataPosition(shard=start.shard, doc=after.doc if full else start.doc,
                                offset=after.offset if full else start.offset,
                                sequences=start.sequences + k + 1, epoch=after.epoch if full else start.epoch,
                                taken=0 if full else k + 1)
            yield seqs[order[k]], here
        if len(seqs) < size:  # a one-pass source (VAL) ended
            return
        start, skip = DataPosition(**{**after.to_dict(), "sequences": start.sequences + len(seqs)}), 0


def val_set(cfg: DataConfig, tok: Tokenizer, seq_len: int, batch_size: int, n: int,
            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed validation set: n batches drawn (``shuffled``) from the first 16 x as many sequences of the held-out
    documents, so from many documents; the same everywhere."""
    need = n * batch_size
    rows = []
    for seq, _ in shuffled(cfg, tok, seq_len, DataPosition(shard=VAL), VAL, min(cfg.shuffle_window, 16 * need)):
        rows.append(seq)
        if len(rows) >= need:
            break
    if len(rows) < need:
        raise DataError(f"the held-out documents of {cfg.source} make {len(rows)} sequences of {seq_len + 1} tokens, "
                        f"fewer than the {need} of the validation set: raise data.val_fraction or add data (documents "
                        "are held out whole, and a .txt file is one document: split it into several files, or use "
                        ".jsonl, a document per line)")
    return [_rows(rows[i * batch_size : (i + 1) * batch_size]) for i in range(n)]


def stream_key(cfg: DataConfig, shard: int) -> str:
    """Names a shard's stream (the saved position of another source or shard count never applies)."""
    return f"{cfg.source}#{shard}/{cfg.shards}"


class ShardStream:
    """Batches of one shard, read ahead by a thread; ``next()`` returns (x, y) LongTensors [B, T] like
    ``trainer.data.BatchStream``, and ``position()`` the data position after the last batch handed out."""

    def __init__(self, cfg: DataConfig, tok: Tokenizer, seq_len: int, batch_size: int, start: DataPosition) -> None:
        if not 0 <= start.shard < cfg.shards:
            raise DataError(f"shard {start.shard} is not one of the run's {cfg.shards} data shards")
        self.cfg, self.tok, self.seq_len, self.batch_size = cfg, tok, seq_len, batch_size
        self._pos = DataPosition(**start.to_dict())
        self.batches = 0
        self.shard = start.shard
        self.key = stream_key(cfg, start.shard)
        self._ready: queue.Queue[tuple[Any, DataPosition | None]] = queue.Queue(READ_AHEAD)
        self._peeked: tuple[Any, DataPosition | None] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name=f"data-shard-{start.shard}", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            rows: list[list[int]] = []
            for seq, pos in shuffled(self.cfg, self.tok, self.seq_len, self._pos, self._pos.shard):
                if self._stop.is_set():
                    return
                rows.append(seq)
                if len(rows) == self.batch_size:
                    item, rows = (_rows(rows), pos), []
                    if not self._offer(item):
                        return
        except BaseException as e:  # handed to the reader, which raises it where the batch was wanted
            self._offer((e, None))

    def _offer(self, item: tuple[Any, DataPosition | None]) -> bool:
        """Queue ``item`` unless the stream is closed meanwhile; False when closed."""
        while not self._stop.is_set():
            try:
                self._ready.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def ready(self) -> bool:
        """Whether ``next()`` returns at once (a batch was read ahead)."""
        return self._peeked is not None or not self._ready.empty()

    def wait_ready(self) -> None:
        """Block until a batch is read ahead (run it in an executor: the event loop must not wait on the source)."""
        if self._peeked is None:
            self._peeked = self._ready.get()
        item, pos = self._peeked
        if pos is None:  # the reader failed: say so here too (next() raises it again)
            raise DataError(f"reading shard {self._pos.shard} of {self.cfg.source} failed: {item}") from item

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._peeked is not None:
            (item, pos), self._peeked = self._peeked, None
        else:
            item, pos = self._ready.get()
        if pos is None:
            raise DataError(f"reading shard {self._pos.shard} of {self.cfg.source} failed: {item}") from item
        self._pos = pos
        self.batches += 1
        x, y = item
        return x, y

    __next__ = next

    def __iter__(self) -> ShardStream:
        return self

    def position(self) -> DataPosition:
        return DataPosition(**self._pos.to_dict())

    def position_dict(self) -> dict[str, Any]:
        return self._pos.to_dict()

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the reading thread and wait for it (bounded: a hub read may hang), so that no thread is left reading
        the source through native code while the interpreter exits."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
