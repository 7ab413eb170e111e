"""tools/bench_real.py: the parquet files, the tokenizer and the run file it prepares; transformers' loss on an
exported tiny llama equal to the stages' own loss on the run's validation batches; and, slow, the whole tool on a
llama-tiny swarm with a short budget."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from peer.state.checkpoint import save_checkpoint
from tools import bench_real
from trainer.config import RunConfig
from trainer.stream import val_set
from trainer.tokenizer import load_tokenizer
from trainer.worker import StageWorker

pytest.importorskip("transformers")
pytest.importorskip("pyarrow")
TINY = Path(__file__).resolve().parent.parent / "trainer" / "runs" / "llama-tiny.toml"


def _prepared(tmp_path: Path) -> tuple[Path, RunConfig]:
    """~150 small documents of standard-library text as 3 parquet files, a 300-token BPE, llama-tiny on them."""
    text = "".join(t for _, t in bench_real.stdlib_sources(300_000))
    docs = [(f"doc{k}", text[k : k + 2000]) for k in range(0, len(text), 2000)]
    source = bench_real.write_parquet(docs, tmp_path / "data", 3)
    vocab = bench_real.train_tokenizer(source, 300, tmp_path / "tokenizer.json")
    run_file = tmp_path / "run.toml"
    return run_file, bench_real.write_run(TINY, run_file, source=source, tokenizer=tmp_path / "tokenizer.json",
                                          vocab=vocab)


def test_the_run_file_is_the_base_run_on_the_parquet_files_with_the_tokenizer(tmp_path):
    run_file, run = _prepared(tmp_path)
    base = RunConfig.from_toml(TINY)
    assert len(list((tmp_path / "data").glob("*.parquet"))) == 3
    assert run.model.vocab_size == 300 and run.data.source == str(tmp_path / "data" / "*.parquet")
    assert Path(run.data.tokenizer).resolve() == (tmp_path / "tokenizer.json").resolve()
    assert run.data.tokenizer_sha256 and run.run_id != base.run_id
    # nothing else changed: the same model shape, optimiser, averaging and batch as the base run
    assert dataclasses.replace(run.model, vocab_size=base.model.vocab_size) == base.model
    assert (run.name, run.optim, run.averaging, run.compression, run.data.batch_size) == \
        (base.name, base.optim, base.averaging, base.compression, base.data.batch_size)
    (tmp_path / "bad.toml").write_text('name = "x"\n')
    with pytest.raises(ValueError, match="vocab_size"):
        bench_real.write_run(tmp_path / "bad.toml", tmp_path / "out.toml", source="x.parquet",
                             tokenizer=tmp_path / "tokenizer.json", vocab=300)


def test_transformers_loss_on_the_export_equals_the_stages_loss_on_the_same_batches(tmp_path):
    run_file, run = _prepared(tmp_path)
    workers = [StageWorker(run, s) for s in range(run.n_stages)]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights away from the init, so a wrong layer or name would show in the loss
        for p in (p for w in workers for p in w.parameters()):
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    for s, w in enumerate(workers):
        save_checkpoint(tmp_path / f"peer{s}", run, s, w.state_dict())
    bench_real.export_hf(run_file, [str(tmp_path / f"peer{s}") for s in range(run.n_stages)], tmp_path / "hf")
    got = bench_real.transformers_val_loss(tmp_path / "hf", run, 2)

    val = val_set(run.data, load_tokenizer(run.data), run.model.block_size, run.data.batch_size, 2)
    with torch.no_grad():
        ours = []
        for x, y in val:
            h = x
            for w in workers:
                h = w.model.eval()(h)
            ours.append(torch.nn.functional.cross_entropy(h.flatten(0, 1), y.flatten()).item())
    assert got["class"] == "LlamaForCausalLM" and got["tokenizer_agrees"]
    assert got["batch_losses"] == pytest.approx(ours, rel=1e-5)
    same = bench_real.compare(sum(ours) / 2, got["transformers_val_loss"])
    assert same["within_tolerance"] and same["ratio"] == pytest.approx(1.0, abs=1e-5)
    assert not bench_real.compare(4.0, 4.1)["within_tolerance"]
    pairs = bench_real.replica_pairs(run, [tmp_path / f"peer{s}" for s in range(run.n_stages)], 2)
    assert [p["chain"] for p in pairs] == [["peer0@0", "peer1@0"]]
    assert pairs[0]["val_loss"] == pytest.approx(sum(ours) / 2, rel=1e-6)  # 2.5 % apart is outside the 1 %


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_tool_end_to_end_on_a_llama_tiny_swarm(tmp_path):
    out, png = tmp_path / "real.json", tmp_path / "real.png"
    code = bench_real.main(["--run", str(TINY), "--budget-s", "20", "--vocab-size", "512", "--max-bytes",
                            "3000000", "--poll-s", "4", "--eval-every-s", "4", "--drain-timeout-s", "5",
                            "--workdir", str(tmp_path / "w"), "--json", str(out), "--plot", str(png)])
    result = json.loads(out.read_text())
    assert code == 0, result.get("error")
    c, tr = result["comparison"], result["training"]
    assert c["within_tolerance"] and c["tokenizer_agrees"] and c["class"] == "LlamaForCausalLM"
    assert len(tr["replica_pairs"]) == 4  # every stage-0 replica with every stage-1 replica
    assert tr["swarm_tokens_per_s"] > 0 and len(tr["peers"]) == 4 and tr["curve"]
    assert all(p["rss_mb_max"] > 0 and p["estimate_mb"] > 0 for p in tr["peers"])  # measured and estimated
    assert all(s["exit_code"] is not None for s in tr["summaries"])  # every peer reaped
    assert png.stat().st_size > 0
