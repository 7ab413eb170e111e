"""Tokenizers: `asyncmesh-peer tokenizer` trains a byte-level BPE file on local data; a run names it, its digest is
part of the run id, the model's vocabulary must cover it, and byte level stays the default (same run id)."""

from __future__ import annotations

import json
import sys

import pytest

from peer.cli import main
from trainer.config import DataConfig, RunConfig
from trainer.tokenizer import ByteTokenizer, FileTokenizer, MissingExtra, load_tokenizer, tokenizer_path

DEFAULT_RUN_ID = "4dfccd67a9e6726b"  # the embedded default run's id before tokenizers and streamed data existed


def _parquet(path, n=200):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"def function_{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(n)]
    pq.write_table(pa.table({"text": texts}), path)
    return path


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    assert main(["tokenizer", "--data", str(_parquet(d / "code.parquet")), "--vocab-size", "300",
                 "--out", str(d / "tokenizer.json")]) == 0
    return d / "tokenizer.json"


def test_the_default_run_keeps_its_id_and_byte_level():
    run = RunConfig.default()
    assert run.run_id == DEFAULT_RUN_ID
    assert tokenizer_path(run) is None and isinstance(load_tokenizer(run.data), ByteTokenizer)


def test_a_trained_tokenizer_round_trips_and_ends_documents(tok_file):
    tok = FileTokenizer(tok_file)
    assert tok.vocab_size == 300 and tok.eot_id == 0
    ids = tok.encode_batch(["def function_3(x):"])[0]
    assert len(ids) < len("def function_3(x):") and tok.decode(ids) == "def function_3(x):"
    assert tok.encode_batch(["ünïcödé 漢字"])[0]  # byte level: any text encodes


def test_the_tokenizer_file_is_part_of_the_run_id_not_its_path(tok_file, tmp_path):
    docs = str(tok_file.parent / "code.parquet")
    run = RunConfig.default().replace(model={"vocab_size": 320}, data={"tokenizer": str(tok_file), "source": docs})
    assert run.run_id != DEFAULT_RUN_ID and run.data.tokenizer_sha256
    copy = tmp_path / "elsewhere.json"
    copy.write_bytes(tok_file.read_bytes())
    assert run.replace(data={"tokenizer": str(copy), "tokenizer_sha256": ""}).run_id == run.run_id
    other = tmp_path / "other.json"
    spec = json.loads(tok_file.read_text())
    spec["model"]["vocab"]["zzz_extra"] = 299  # a different file of the same size
    other.write_text(json.dumps(spec))
    assert run.replace(data={"tokenizer": str(other), "tokenizer_sha256": ""}).run_id != run.run_id
    with pytest.raises(ValueError, match="pins"):  # a run that pins a digest refuses another file
        run.replace(data={"tokenizer": str(other)})


def test_a_run_file_names_its_tokenizer_relative_to_itself(tok_file, tmp_path):
    (tmp_path / "run.toml").write_text(RunConfig.default().to_toml().replace("vocab_size = 256", "vocab_size = 300")
                                       + '\n')
    text = (tmp_path / "run.toml").read_text().replace("[data]", f'[data]\ntokenizer = "{tok_file.name}"').replace(
        'source = "stdlib"', f'source = "{tok_file.parent / "code.parquet"}"')
    (tok_file.parent / "run.toml").write_text(text)
    run = RunConfig.from_toml(tok_file.parent / "run.toml")
    assert tokenizer_path(run) == tok_file.resolve()
    (tmp_path / "again.toml").write_text(run.to_toml())  # written back: absolute path, same run id
    assert RunConfig.from_toml(tmp_path / "again.toml").run_id == run.run_id


def test_the_model_vocabulary_must_cover_the_tokenizer(tok_file):
    docs = str(tok_file.parent / "code.parquet")
    with pytest.raises(ValueError, match=r"set model.vocab_size = 300"):
        RunConfig.default().replace(data={"tokenizer": str(tok_file), "source": docs})
    # a token array (the embedded stdlib sources, .bin shards) takes no tokenizer: said when the run is read
    for source in ("stdlib", "data/tokens/shard0.bin"):
        with pytest.raises(ValueError, match="remove data.tokenizer"):
            RunConfig.default().replace(model={"vocab_size": 300}, data={"tokenizer": str(tok_file), "source": source})
    with pytest.raises(ValueError, match="asyncmesh-peer tokenizer"):
        DataConfig(tokenizer="/nonexistent/tokenizer.json")


def test_a_missing_package_says_which_extra_to_install(tok_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # what an install without the hf extra looks like
    with pytest.raises(MissingExtra, match=r"pip install 'asyncmesh\[hf\]'"):
        FileTokenizer(tok_file)


def test_the_cli_refuses_a_vocabulary_below_the_bytes(tmp_path, capsys):
    assert main(["tokenizer", "--data", str(_parquet(tmp_path / "c.parquet", 10)), "--vocab-size", "100",
                 "--out", str(tmp_path / "t.json")]) == 2
    assert "at least 257" in capsys.readouterr().err
