"""Corpora and batch streams: the stdlib default, text folders, .bin shards, determinism and clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.config import DataConfig
from trainer.data import BatchStream, Corpus, DataError, load_corpus, shard_seed, val_batches


def test_stdlib_default_is_capped_split_and_deterministic():
    cfg = DataConfig(max_bytes=200_000, val_fraction=0.1)
    a, b = load_corpus(cfg, 256), load_corpus(cfg, 256)
    assert a.train.dtype == np.uint8
    assert len(a.train) == 180_000 and len(a.val) == 20_000
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    assert not np.array_equal(a.train[:1000], a.val[:1000])
    assert b"def " in a.train.tobytes()


def test_text_folder_recursive_and_split(tmp_path):
    for i in range(40):
        d = tmp_path / f"sub{i % 3}"
        d.mkdir(exist_ok=True)
        (d / f"f{i}.txt").write_bytes(bytes([65 + i % 26]) * 500)
    (tmp_path / "ignored.bin.bak").write_bytes(b"x" * 10_000)
    corpus = load_corpus(DataConfig(source=str(tmp_path), max_bytes=0, val_fraction=0.2), 256)
    assert len(corpus.train) + len(corpus.val) == 40 * 500
    assert 0 < len(corpus.val) < len(corpus.train)


def test_single_text_file_tail_split(tmp_path):
    f = tmp_path / "book.txt"
    f.write_bytes(bytes(range(256)) * 40)
    corpus = load_corpus(DataConfig(source=str(f), max_bytes=0, val_fraction=0.25), 256)
    assert len(corpus.val) == 2560 and len(corpus.train) == 7680
    assert corpus.val.tobytes() == (bytes(range(256)) * 40)[-2560:]


def test_bin_shards_train_val_and_vocab_check(tmp_path):
    np.arange(5000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    (np.arange(2000, dtype=np.uint16) % 100).tofile(tmp_path / "val.bin")
    corpus = load_corpus(DataConfig(source=str(tmp_path), bin_vocab_size=5000), 5000)
    assert corpus.train.dtype == np.uint16 and len(corpus.train) == 5000 and len(corpus.val) == 2000
    with pytest.raises(DataError, match="token id 4999 >= vocab size 4000"):
        load_corpus(DataConfig(source=str(tmp_path), bin_vocab_size=4000), 4000)
    with pytest.raises(DataError, match="set data.bin_vocab_size"):
        load_corpus(DataConfig(source=str(tmp_path)), 256)


def test_clear_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_corpus(DataConfig(source=str(tmp_path / "nope")), 256)
    with pytest.raises(DataError, match="no usable files"):
        load_corpus(DataConfig(source=str(tmp_path)), 256)
    (tmp_path / "small.txt").write_text("hello world")
    with pytest.raises(DataError, match="fewer than"):
        load_corpus(DataConfig(source=str(tmp_path)), 256)
    with pytest.raises(DataError, match="vocab 256"):
        load_corpus(DataConfig(source=str(tmp_path)), 100)
    (tmp_path / "x.bin").write_bytes(b"\0" * 4000)
    with pytest.raises(DataError, match="mixes"):
        load_corpus(DataConfig(source=str(tmp_path), bin_vocab_size=256), 256)


def test_batch_stream_shapes_determinism_and_sharding():
    tokens = np.arange(10_000, dtype=np.uint16)
    a, b, c = (BatchStream(tokens, 32, 4, s) for s in (shard_seed(0, 1), shard_seed(0, 1), shard_seed(0, 2)))
    xa, ya = a.next()
    xb, _ = b.next()
    xc, _ = c.next()
    assert xa.shape == ya.shape == (4, 32) and xa.dtype == torch.long
    assert torch.equal(ya[:, :-1], xa[:, 1:]) and torch.equal(ya[:, -1], xa[:, -1] + 1)
    assert torch.equal(xa, xb) and not torch.equal(xa, xc)
    with pytest.raises(DataError, match="cannot fill"):
        BatchStream(tokens[:20], 32, 4, 0)


def test_val_batches_fixed_and_cover_the_split():
    corpus = Corpus(train=np.zeros(10, np.uint8), val=(np.arange(3000) % 256).astype(np.uint8))
    v1, v2 = val_batches(corpus, 64, 4, 3), val_batches(corpus, 64, 4, 3)
    assert len(v1) == 3 and all(torch.equal(a[0], b[0]) for a, b in zip(v1, v2, strict=True))
    assert v1[0][0][0, 0].item() == 0  # first window starts at the beginning
    assert v1[-1][1][-1, -1].item() == corpus.val[-1]  # last window ends at the end


def test_bin_shards_hash_split_capped_and_single_shard_memmapped(tmp_path, caplog):
    for i in range(30):
        np.full(1000, i, dtype=np.uint16).tofile(tmp_path / f"shard{i:02d}.bin")
    with caplog.at_level("WARNING", logger="trainer.data"):
        corpus = load_corpus(DataConfig(source=str(tmp_path), bin_vocab_size=256, max_bytes=40_000, val_fraction=0.2),
                             256)
    assert len(corpus.train) == 16_000 and len(corpus.val) == 4_000  # cap 20k tokens split 80/20
    assert "reads 20000 of the 30000 tokens" in caplog.text and "data.max_bytes = 0" in caplog.text  # said, not silent
    whole = load_corpus(DataConfig(source=str(tmp_path), bin_vocab_size=256, max_bytes=0, val_fraction=0.2), 256)
    assert len(whole.train) + len(whole.val) == 30_000
    assert set(np.unique(corpus.train)).isdisjoint(np.unique(corpus.val))  # whole shards on one side
    single = tmp_path / "one" / "big.bin"
    single.parent.mkdir()
    (np.arange(30_000) % 256).astype(np.uint16).tofile(single)
    one = load_corpus(DataConfig(source=str(single), bin_vocab_size=256, max_bytes=100, val_fraction=0.1), 256)
    assert isinstance(one.train, np.memmap) and len(one.train) == 27_000 and len(one.val) == 3_000  # no cap
    (tmp_path / "odd.bin").write_bytes(b"\0" * 3)
    with pytest.raises(DataError, match="odd number of bytes"):
        load_corpus(DataConfig(source=str(tmp_path / "odd.bin"), bin_vocab_size=256), 256)
