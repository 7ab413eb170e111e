"""The data position survives a SIGKILL: a restarted stage-0 peer neither skips nor repeats its shard's samples
beyond what its last checkpoint could not know.

What "trained" means (peer.pipeline.ledger): a sample is trained once stage 0's driver got its loss back. The
checkpoint saves stage 0's state, the data position and the samples drawn but not trained at that moment; a restart
resumes all three. So: every batch of the shard up to the furthest drawn is trained (or still owed at the end), and
the only batches trained twice are those the killed run trained after its last checkpoint (the restored weights do
not hold them)."""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from swarm_utils import REPO, swarm  # noqa: F401  (fixture)

from peer.pipeline.driver import sample_digest
from peer.pipeline.ledger import SAMPLES_FILE, SampleLedger
from trainer.config import RunConfig
from trainer.stream import DataPosition, ShardStream, stream_key
from trainer.tokenizer import ByteTokenizer

B, T = 8, 32  # the tiny run's batch_size and block_size


def _dataset(path: Path, n: int = 600) -> Path:
    words = ["alpha", "beta", "gamma", "delta", "pipeline", "stage", "shard", "token", "replica", "swarm"]
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": f"doc {i}: " + " ".join(words[(i * k) % 10] for k in range(5 + i % 9))})
                    + "\n")
    return path


def _run_file(tmp: Path, source: Path) -> Path:
    text = (REPO / "tests" / "runs" / "tiny.toml").read_text()
    text = text.replace('source = "stdlib"', f'source = "{source}"\nshards = 2').replace("max_bytes = 400000\n", "")
    (tmp / "run.toml").write_text(text)
    return tmp / "run.toml"


def _shard_batches(run: RunConfig, shard: int, n: int) -> dict[str, int]:
    """Digest -> index of the first n batches of a shard, read the way stage 0 reads them."""
    stream = ShardStream(run.data, ByteTokenizer(), T, B, DataPosition(shard=shard))
    try:
        return {sample_digest(stream.next()): i for i in range(n)}
    finally:
        stream.close()


def _saved(path: Path) -> tuple[dict, list[str]]:
    payload = torch.load(path, weights_only=True)
    return payload["positions"], [sample_digest((x, y)) for x, y in payload["samples"]]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_killed_stage_0_peer_resumes_its_data_position(swarm, tmp_path):  # noqa: F811
    run_path = _run_file(tmp_path, _dataset(tmp_path / "docs.jsonl", 6000))  # ~600 batches a shard: one epoch
    run = RunConfig.from_toml(run_path)
    fast = ("checkpoint_every_s=2",)
    a = swarm.start("a", stage="0", run=run_path, extra=(*fast, f"samples_log={tmp_path / 'first.log'}"))
    b = swarm.start("b", stage="1", run=run_path, initial=a.wait_maddrs()[:1], extra=fast)
    a.wait_status(lambda s: s["local_step"] >= 40, 180, "40 steps")
    saved = a.dir / "ckpt" / SAMPLES_FILE
    seen = saved.stat().st_mtime_ns if saved.exists() else 0
    a.wait_for(lambda: saved.exists() and saved.stat().st_mtime_ns != seen, 30, "a checkpoint after step 40")
    time.sleep(1.0)  # killed between two checkpoints, with batches trained since the last one
    a.signal(signal.SIGKILL)
    a.wait_exit(30)
    shutil.copy(a.dir / "ckpt" / SAMPLES_FILE, tmp_path / "at-kill.pt")
    positions, owed_at_kill = _saved(tmp_path / "at-kill.pt")
    [(key, pos)] = positions.items()
    shard, ckpt_batches = pos["shard"], pos["sequences"] // B
    assert key == stream_key(run.data, shard) and ckpt_batches > 0
    first = (tmp_path / "first.log").read_text().split()
    (a.dir / "maddrs.txt").unlink()

    a2 = swarm.start("a", stage="0", run=run_path, initial=b.maddrs[:1], max_steps=len(first) + 30,
                     extra=(*fast, f"samples_log={tmp_path / 'second.log'}"))
    assert a2.wait_exit(240) == 0
    b.signal(signal.SIGTERM)
    b.wait_exit(30)
    assert f"reads data shard {shard} of 2 from document {pos['doc']} token {pos['offset']}" in a2.log()
    second = (tmp_path / "second.log").read_text().split()
    end_positions, owed_at_end = _saved(a2.dir / "ckpt" / SAMPLES_FILE)
    drawn = end_positions[key]["sequences"] // B
    assert end_positions[key]["epoch"] == 0  # within one epoch a batch's digest names it (epochs repeat batches)

    index = _shard_batches(run, shard, drawn)
    assert set(first) | set(second) | set(owed_at_end) <= set(index)  # nothing but this shard's batches
    assert len(set(first)) == len(first) and len(set(second)) == len(second)  # no repeat within one run
    trained = {index[d] for d in (*first, *second)}
    assert trained | {index[d] for d in owed_at_end} == set(range(drawn))  # none skipped
    twice = {index[d] for d in set(first) & set(second)}
    after_ckpt = set(range(ckpt_batches, drawn)) | {index[d] for d in owed_at_kill}
    assert twice <= after_ckpt, (sorted(twice - after_ckpt), ckpt_batches)  # repeats: only after the checkpoint
    assert {index[d] for d in second} >= {index[d] for d in owed_at_kill}  # owed at the kill: trained after it
    print(f"shard {shard}: {len(first)} batches trained before the kill (checkpoint at {ckpt_batches}, "
          f"{len(owed_at_kill)} owed), {len(second)} after, {len(twice)} twice, {drawn} drawn")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_stage_0_peers_read_different_shards(swarm, tmp_path):  # noqa: F811
    run_path = _run_file(tmp_path, _dataset(tmp_path / "docs.jsonl", 6000))
    a = swarm.start("a", stage="0", run=run_path, extra=(f"samples_log={tmp_path / 'a.log'}",))
    first = a.wait_maddrs()[:1]
    c = swarm.start("c", stage="1", run=run_path, initial=first)
    a.wait_status(lambda s: s["local_step"] >= 5, 180, "5 steps")
    b = swarm.start("b", stage="0", run=run_path, initial=first, extra=(f"samples_log={tmp_path / 'b.log'}",))
    b_log = tmp_path / "b.log"  # (its step comes from a's state: count what its own driver trained)
    b.wait_for(lambda: b_log.exists() and len(b_log.read_text().split()) >= 20, 180, "20 trained batches")
    for p in (a, b, c):
        p.signal(signal.SIGTERM)
    for p in (a, b, c):
        assert p.wait_exit(60) == 0
    shards = {}
    for p in (a, b):
        positions, _ = _saved(p.dir / "ckpt" / SAMPLES_FILE)
        [(key, pos)] = positions.items()
        shards[p.name] = pos["shard"]
    assert shards["a"] != shards["b"], shards
    trained = {n: set((tmp_path / f"{n}.log").read_text().split()) for n in ("a", "b")}
    assert len(trained["b"]) >= 20 and not trained["a"] & trained["b"]


def test_the_ledger_saves_and_resumes_a_shard_position_with_what_was_in_flight(tmp_path):
    """Fast: the save/resume logic without processes. A driver drew batches; some were trained, some were in flight
    at the checkpoint; a new ledger loads it and a stream resumed from its position continues the shard exactly."""
    docs = _dataset(tmp_path / "docs.jsonl", 200)
    run = RunConfig.from_toml(_run_file(tmp_path, docs))
    want = list(_shard_batches(run, 1, 12))
    ledger = SampleLedger()
    stream = ShardStream(run.data, ByteTokenizer(), T, B, DataPosition(shard=1))
    ledger.attach(stream)
    drawn = [stream.next() for _ in range(7)]
    trained, in_flight = drawn[:4], drawn[4:]
    ledger.save(tmp_path, ledger.snapshot(in_flight))  # the checkpoint
    stream.next()  # drawn after the checkpoint: the SIGKILL comes before the next one
    stream.close()

    again = SampleLedger()
    assert again.load(tmp_path) == 3 and again.last_key == stream.key
    resumed = ShardStream(run.data, ByteTokenizer(), T, B, DataPosition.from_dict(again.position(stream.key)))
    after = [again.take() for _ in range(3)] + [resumed.next() for _ in range(5)]
    resumed.close()
    assert [sample_digest(s) for s in (*trained, *after)] == want
