"""Streamed documents (trainer/stream.py): hub datasets and local .txt/.jsonl/.parquet through the same `datasets`
code, disjoint deterministic shards, a fixed held-out validation set, and a data position that resumes exactly."""

from __future__ import annotations

import itertools
import json
import sys

import pytest
import torch

from trainer.config import DataConfig
from trainer.data import DataError
from trainer.stream import (
    VAL,
    DataPosition,
    ShardStream,
    doc_role,
    documents,
    open_dataset,
    sequences,
    shuffled,
    val_set,
)
from trainer.tokenizer import ByteTokenizer, MissingExtra

N_DOCS = 120


def _texts(n=N_DOCS):
    return [f"doc{i:03d} " + "abc " * (i % 5 + 3) for i in range(n)]


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("jsonl") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(_texts())))
    return path


def test_local_kinds_read_the_same_documents(tmp_path, jsonl):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": _texts()[:60]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": _texts()[60:]}), tmp_path / "b.parquet")
    txt = tmp_path / "txt"
    txt.mkdir()
    for i, t in enumerate(_texts(20)):
        (txt / f"{i:03d}.txt").write_text(t + "\nsecond line")  # a .txt file is one document, lines and all
    want = _texts()
    assert [t for _, t in documents(DataConfig(source=str(jsonl)))] == want
    assert [t for _, t in documents(DataConfig(source=str(tmp_path / "*.parquet")))] == want
    assert [t for _, t in documents(DataConfig(source=str(txt)))] == [t + "\nsecond line" for t in want[:20]]
    assert [i for i, _ in documents(DataConfig(source=str(jsonl)), start=100)] == list(range(100, N_DOCS))


def test_shards_are_disjoint_cover_the_training_documents_and_hold_out_validation(jsonl):
    cfg = DataConfig(source=str(jsonl), shards=4, val_fraction=0.1)
    roles = [doc_role(i, cfg) for i in range(N_DOCS)]
    assert roles == [doc_role(i, cfg) for i in range(N_DOCS)]  # deterministic
    assert set(roles) == {VAL, 0, 1, 2, 3} and 4 <= roles.count(VAL) <= 25
    seen: dict[int, int] = {}
    for shard in range(4):  # one epoch of each shard: its sequences name the documents they came from
        for seq, pos in sequences(cfg, ByteTokenizer(), 15, DataPosition(shard=shard), shard):
            if pos.epoch:
                break
            words = bytes(t for t in seq if t).decode().split()
            for doc in {int(w[3:6]) for w in words if w.startswith("doc") and len(w) == 6}:
                assert seen.setdefault(doc, shard) == shard  # never in two shards
    assert set(seen) <= {i for i, r in enumerate(roles) if r != VAL}
    assert len(seen) >= 0.8 * (N_DOCS - roles.count(VAL))  # (a name cut in two by a sequence boundary is missed)
    val = val_set(cfg, ByteTokenizer(), 15, 2, 2)
    assert len(val) == 2 and val[0][0].shape == (2, 15) and torch.equal(val[0][1][:, :-1], val[0][0][:, 1:])
    val_docs = {int(w[3:6]) for x, _ in val for w in bytes(t for t in x.flatten().tolist() if t).decode().split()
                if w.startswith("doc") and len(w) == 6}
    assert val_docs and all(roles[d] == VAL for d in val_docs)


@pytest.mark.parametrize("window", [1, 7, 1024])
@pytest.mark.parametrize("stop_after", [5, 7])
def test_a_stream_resumed_from_its_position_continues_exactly(jsonl, window, stop_after):
    cfg = DataConfig(source=str(jsonl), shards=2, shuffle_window=window)
    whole = ShardStream(cfg, ByteTokenizer(), 31, 3, DataPosition(shard=1))
    batches = [whole.next() for _ in range(40)]  # more than one epoch of the shard (60 sequences)
    assert whole.position().sequences == 120 and (window == 1024 or whole.position().epoch >= 1)
    first = ShardStream(cfg, ByteTokenizer(), 31, 3, DataPosition(shard=1))
    for _ in range(stop_after):  # 15 sequences: inside a window of 7; 21: at a window's end
        first.next()
    saved = DataPosition.from_dict(first.position_dict())
    first.close()
    again = ShardStream(cfg, ByteTokenizer(), 31, 3, saved)
    for want in batches[stop_after:]:
        x, y = again.next()
        assert torch.equal(x, want[0]) and torch.equal(y, want[1])
    assert again.position() == whole.position()  # the count of sequences handed out too
    for s in (whole, again):
        s.close()
    with pytest.raises(DataError, match="malformed"):
        DataPosition.from_dict({"shard": 1})


def test_a_position_inside_a_long_document_is_a_few_integers(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({"text": f"{i} " + "xyz" * (300 + 50 * i)}) + "\n" for i in range(12)))
    cfg = DataConfig(source=str(path), shards=1, val_fraction=0.01)
    whole = ShardStream(cfg, ByteTokenizer(), 63, 2, DataPosition(shard=0))
    want = [whole.next() for _ in range(30)]
    whole.close()
    first = ShardStream(cfg, ByteTokenizer(), 63, 2, DataPosition(shard=0))
    for _ in range(7):
        first.next()
    saved = first.position_dict()
    first.close()
    assert set(saved) == {"shard", "doc", "offset", "sequences", "epoch", "taken"}
    again = ShardStream(cfg, ByteTokenizer(), 63, 2, DataPosition.from_dict(saved))
    assert all(torch.equal(again.next()[0], x) for x, _ in want[7:])
    again.close()


def test_a_hub_dataset_is_streamed_with_its_name_config_and_split(jsonl, monkeypatch):
    import datasets

    calls = []
    real = datasets.load_dataset

    def fake(name, config=None, **kw):
        calls.append((name, config, kw))
        return real("json", data_files=[str(jsonl)], split="train", streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", fake)
    cfg = DataConfig(source="hf:someone/corpus", hf_config="small", split="validation", shards=3)
    assert cfg.streamed
    assert [t for _, t in documents(cfg)] == _texts()
    assert calls[0] == ("someone/corpus", "small", {"split": "validation", "streaming": True})
    stream = ShardStream(cfg, ByteTokenizer(), 15, 2, DataPosition(shard=2))
    assert stream.next()[0].shape == (2, 15)
    stream.close()


def test_missing_packages_and_fields_say_what_to_do(jsonl, monkeypatch, tmp_path):
    with pytest.raises(DataError, match="data.text_field"):
        next(documents(DataConfig(source=str(jsonl), text_field="body")))
    (tmp_path / "a.jsonl").write_text("{}\n")
    (tmp_path / "b.parquet").write_text("")
    with pytest.raises(DataError, match="mixes"):
        open_dataset(DataConfig(source=str(tmp_path)))
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(MissingExtra, match=r"pip install 'asyncmesh\[hf\]'"):
        open_dataset(DataConfig(source=str(jsonl)))


def test_a_shard_without_documents_fails_when_first_read(jsonl):
    stream = ShardStream(DataConfig(source=str(jsonl), shards=1000), ByteTokenizer(), 15, 2, DataPosition(shard=999))
    with pytest.raises(DataError, match="holds no document"):
        stream.wait_ready()
    stream.close()


@pytest.mark.timeout(30)
def test_a_shard_shorter_than_one_sequence_fails_when_first_read_instead_of_waiting_for_ever(tmp_path):
    """Documents, but fewer tokens than one sequence: before, every epoch re-read the source and never yielded, and
    stage 0 waited without a word."""
    small = tmp_path / "small.jsonl"
    small.write_text('{"text": "hi"}\n{"text": "there"}\n')
    stream = ShardStream(DataConfig(source=str(small), shards=1, val_fraction=0.01), ByteTokenizer(), 64, 2,
                         DataPosition(shard=0))
    with pytest.raises(DataError, match="fewer than one sequence of 65"):
        stream.wait_ready()
    stream.close()


def test_unreadable_documents_name_the_source_and_what_it_must_hold(tmp_path):
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9 au lait")
    (tmp_path / "broken.jsonl").write_text('{"text": "x"}\nnot json\n')
    for name in ("latin1.txt", "broken.jsonl"):
        with pytest.raises(DataError, match=rf"{name} \(from document 0 on\).*must be UTF-8 text"):
            list(documents(DataConfig(source=str(tmp_path / name))))


def test_legacy_sources_are_not_streamed():
    assert not DataConfig().streamed
    assert DataConfig(source="corpus.jsonl").streamed and DataConfig(source="hf:x/y").streamed


def test_join_checks_a_streamed_source_before_starting(tmp_path, jsonl):
    from peer.cli.checks import check_data
    from peer.errors import UserError
    from trainer.config import RunConfig

    run = RunConfig.default().replace(data={"source": str(jsonl)})
    check_data(run, None)
    with pytest.raises(UserError, match="does not exist"):
        check_data(run, str(tmp_path / "missing.jsonl"))


def test_a_window_hands_out_each_of_its_sequences_once_in_a_seeded_order(tmp_path):
    # long documents: read in order, each would fill many consecutive sequences
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc{i:03d} " * 40}) + "\n" for i in range(40)))
    cfg = DataConfig(source=str(path), shards=1, val_fraction=0.01, shuffle_window=32)
    in_order = [seq for seq, _ in itertools.islice(sequences(cfg, ByteTokenizer(), 31, DataPosition(shard=0), 0), 96)]
    mixed = [seq for seq, _ in itertools.islice(shuffled(cfg, ByteTokenizer(), 31, DataPosition(shard=0), 0), 96)]
    for w in range(3):  # each window is a permutation of the same stretch read in order
        got, want = mixed[32 * w : 32 * (w + 1)], in_order[32 * w : 32 * (w + 1)]
        assert sorted(got) == sorted(want) and got != want

    def docs(seqs):
        return [{w for w in bytes(t for t in s if t).decode().split() if len(w) == 6} for s in seqs]

    # four consecutive sequences (one micro-batch) come from more documents than read in order
    span = [len(set().union(*docs(seqs[i : i + 4]))) for seqs in (in_order, mixed) for i in range(0, 96, 4)]
    assert sum(span[24:]) > 1.5 * sum(span[:24])
    again = [seq for seq, _ in itertools.islice(shuffled(cfg, ByteTokenizer(), 31, DataPosition(shard=0), 0), 96)]
    assert again == mixed  # deterministic
