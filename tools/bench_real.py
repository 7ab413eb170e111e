#!/usr/bin/env python3
"""Real model, real data: a 2-stage x 2-replica swarm of ``llama-small`` with a trained BPE tokenizer on local
parquet files, measured, exported for transformers and checked against the swarm's own validation loss.

1. **Data.** The standard library's ``.py`` sources of this interpreter (the embedded default run's text), one row
   per file, written to ``--parquet-files`` parquet files (pyarrow) under ``WORKDIR/data``.
2. **Tokenizer.** ``asyncmesh-peer tokenizer`` (the project's own code) trains a byte-level BPE on them.
3. **Run file.** ``--run`` (``trainer/runs/llama-small.toml``) with ``[data] source`` = the parquet files,
   ``tokenizer`` = that file and ``[model] vocab_size`` = its vocabulary; nothing else changes.
4. **Swarm.** ``n_stages x --replicas`` ``join`` children on loopback (later stages first), trained for ``--budget-s``
   seconds of wall clock while every peer's ``/status`` is polled: tokens/s, memory (the process tree's RSS), the
   validation loss of the stage-0 peers (they evaluate the fixed validation batches every ``--eval-every-s``).
5. **Same weights.** Every peer is stopped with SIGTERM (drain, final checkpoint). For each stage the most advanced
   checkpoint is copied to a fresh folder, and a 2-peer swarm (one peer per stage) starts from those two
   checkpoints; its stage-0 peer runs with ``--max-steps`` = its checkpoint's step, so it trains nothing and does
   its final evaluation straight away: the swarm's reported validation loss at exactly those weights (the tool
   checks that neither peer's step moved).
6. **transformers.** ``asyncmesh-peer export --format hf`` from those checkpoints; ``AutoModelForCausalLM`` and
   ``AutoTokenizer`` load the folder; the loss on the same validation batches (``trainer.stream.val_set``) is
   compared with the swarm's.

Writes ``--json`` (command, machine, per-peer figures, the curve, both losses and their ratio) and ``--plot``
(validation loss against time). Every child is reaped on any exit, SIGTERM included.

Example (the figures of docs/performance.md, "Real model")::

    python tools/bench_real.py --budget-s 480 --json docs/bench/real.json --plot docs/bench/real.png
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if __package__ in (None, ""):  # run as a script: make the packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peer.ops.procs import (  # noqa: E402
    PeerProcess,
    PeerProcessError,
    descendants,
    free_port,
    join_command,
    terminate,
    unwind_on_sigterm,
)

if TYPE_CHECKING:
    from trainer.config import RunConfig

logger = logging.getLogger("bench_real")
REPO = Path(__file__).resolve().parent.parent
SKIP = ("site-packages", "dist-packages", "__pycache__")
INTERRUPTED = 130  # what the CLI returns on Ctrl-C or SIGTERM: the tool stops too (no result file for a cut run)


# ----- data, tokenizer, run file ----------------------------------------------------------------------------------
def stdlib_sources(max_bytes: int) -> list[tuple[str, str]]:
    """(relative path, text) of the interpreter's standard-library .py files in sorted order, up to ``max_bytes``."""
    from trainer.data import stdlib_root

    root, out, total = stdlib_root(), [], 0
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP)
        for f in sorted(files):
            if f.endswith(".py"):
                p = Path(d) / f
                out.append((p.relative_to(root).as_posix(), p))
    docs = []
    for rel, p in sorted(out):
        text = p.read_text(encoding="utf-8", errors="replace")
        docs.append((rel, text))
        total += len(text.encode())
        if max_bytes and total >= max_bytes:
            break
    return docs


def write_parquet(docs: list[tuple[str, str]], folder: Path, n_files: int) -> str:
    """The documents as ``n_files`` parquet files (columns ``text``, ``path``); returns their glob."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    per = -(-len(docs) // n_files)
    for k in range(n_files):
        part = docs[k * per : (k + 1) * per]
        if part:
            table = pa.table({"text": [t for _, t in part], "path": [r for r, _ in part]})
            pq.write_table(table, folder / f"part-{k:03d}.parquet")
    return str(folder / "*.parquet")


def train_tokenizer(source: str, vocab_size: int, out: Path) -> int:
    """``asyncmesh-peer tokenizer`` on ``source``; returns the vocabulary size of the file written."""
    from peer.cli import main as cli
    from trainer.sources import tokenizer_vocab_size

    code = cli(["tokenizer", "--data", source, "--vocab-size", str(vocab_size), "--out", str(out)])
    if code == INTERRUPTED:
        raise KeyboardInterrupt("asyncmesh-peer tokenizer")
    if code != 0:
        raise RuntimeError(f"asyncmesh-peer tokenizer failed on {source}")
    return tokenizer_vocab_size(out)


def write_run(base: Path, out: Path, *, source: str, tokenizer: Path, vocab: int) -> RunConfig:
    """``base`` with the parquet source, the tokenizer (relative to the run file) and its vocabulary size; every
    other line as it is. Fails when ``base`` has no ``vocab_size`` or ``source`` line to replace."""
    from trainer.config import RunConfig

    text, n1 = re.subn(r"(?m)^vocab_size\s*=.*$", f"vocab_size = {vocab}     # the BPE tokenizer's", base.read_text())
    tok = os.path.relpath(tokenizer, out.parent)
    text, n2 = re.subn(r"(?m)^source\s*=.*$", lambda m: f"source = {json.dumps(source)}\ntokenizer = "
                       f"{json.dumps(tok)}", text)
    if n1 != 1 or n2 != 1:
        raise ValueError(f"{base} needs exactly one [model] vocab_size and one [data] source line (found {n1}, {n2})")
    out.write_text(f"# {base.name} on local parquet files with a BPE tokenizer (written by tools/bench_real.py)\n"
                   + text)
    return RunConfig.from_toml(out)


# ----- the swarm --------------------------------------------------------------------------------------------------
def tree_rss_mb(pid: int) -> tuple[float | None, float]:
    """(RSS of ``pid``, RSS of it and its descendants: DHT process, p2pd) in MiB, from /proc."""
    def rss(p: int) -> float:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0
    own = rss(pid)
    return (own or None), own + sum(rss(c) for c in descendants(pid))


class Swarm:
    """The join children of one swarm (``stages``: each child's fixed stage), reaped by ``close``."""

    def __init__(self, run_file: Path, workdir: Path, stages: list[int], args: argparse.Namespace) -> None:
        self.run_file, self.workdir, self.stages, self.args = run_file, workdir, stages, args
        self.peers: list[PeerProcess] = []

    def spawn(self, i: int, initial: list[str], *, max_steps: int = 0) -> PeerProcess:
        d = self.workdir / f"peer{i}"
        port = free_port()
        settings = [f"eval_every_s={self.args.eval_every_s:g}", f"drain_timeout_s={self.args.drain_timeout_s:g}",
                    "checkpoint_every_s=0", "rebalance_every_s=0", *self.args.overrides]
        cmd = join_command(d, port=port, run=self.run_file, stage=self.stages[i], max_steps=max_steps,
                           torch_threads=self.args.torch_threads, settings=settings, initial=initial)
        peer = PeerProcess.spawn(f"peer{i}", cmd, d, port, cwd=REPO, stage=self.stages[i], i=i)
        self.peers.append(peer)
        return peer

    def start(self, *, max_steps: dict[int, int] | None = None) -> None:
        """First peer, then the others through its multiaddr; stage-0 peers once every later stage trains."""
        max_steps = max_steps or {}
        first = self.spawn(0, [], max_steps=max_steps.get(self.stages[0], 0))
        initial = [m for m in first.wait_maddrs(self.args.start_timeout_s) if "/p2p/" in m][:1]
        for i in range(1, len(self.stages)):
            if self.stages[i] == 0 and self.stages[i - 1] != 0:
                self.wait_training(self.peers)
            self.spawn(i, initial, max_steps=max_steps.get(self.stages[i], 0))

    def wait_training(self, peers: list[PeerProcess]) -> None:
        """Every peer of ``peers`` training; a stage-0 peer also with a completed micro-batch."""
        for p in peers:
            def ready(s: dict[str, Any], p: PeerProcess = p) -> bool:
                return s.get("state") == "training" and (p.info["stage"] != 0 or s.get("tokens_total", 0) > 0)

            p.wait_status(ready, self.args.start_timeout_s, "training state")

    def sample(self, t0: float) -> dict[str, Any]:
        """Every peer's figures now (None for a peer that does not answer)."""
        rows = []
        for p in self.peers:
            s = p.status() or {}
            own, tree = tree_rss_mb(p.proc.pid)
            memory = s.get("memory") or {}  # the peer's own estimate (peer.budget), where its /status has one
            est = memory.get("estimate_bytes") if isinstance(memory, dict) else None
            rows.append({"peer": p.name, "stage": p.info["stage"], "state": s.get("state"),
                         "local_step": s.get("local_step"), "tokens_total": s.get("tokens_total"),
                         "tokens_per_s": s.get("tokens_per_s"), "val_loss": s.get("val_loss"),
                         "n_val": len(s.get("val_loss_history") or []), "rss_mb": own, "tree_rss_mb": tree,
                         "estimate_mb": est / 2**20 if isinstance(est, (int, float)) else None})
        return {"t": round(time.monotonic() - t0, 2), "loadavg": list(os.getloadavg()), "peers": rows}

    def close(self) -> None:
        terminate([p.proc for p in self.peers], self.args.drain_timeout_s + 30)


def best_checkpoints(dirs: list[Path], run: RunConfig) -> dict[int, tuple[Path, int]]:
    """For each stage, the folder holding its most advanced checkpoint and that step."""
    from peer.state.checkpoint import checkpoint_steps

    best: dict[int, tuple[Path, int]] = {}
    for d in dirs:
        for stage, step in checkpoint_steps(d, run).items():
            if stage not in best or step > best[stage][1]:
                best[stage] = (d, step)
    missing = [s for s in range(run.n_stages) if s not in best]
    if missing:
        raise RuntimeError(f"no checkpoint of stage(s) {missing} in {[str(d) for d in dirs]}")
    return best


def evaluate_at_checkpoints(run_file: Path, run: RunConfig, best: dict[int, tuple[Path, int]], workdir: Path,
                            args: argparse.Namespace) -> dict[str, Any]:
    """A one-peer-per-stage swarm from exactly these checkpoints: its stage-0 peer stops at once (``--max-steps`` =
    its step) and reports its final evaluation. Returns that loss and the steps each peer ended at."""
    from peer.state.checkpoint import checkpoint_path

    stages = sorted(range(run.n_stages), reverse=True)
    for i, stage in enumerate(stages):
        ckpt = workdir / f"peer{i}" / "ckpt"
        ckpt.mkdir(parents=True)
        shutil.copy2(checkpoint_path(best[stage][0], stage), checkpoint_path(ckpt, stage))
    swarm = Swarm(run_file, workdir, stages, args)
    try:
        swarm.start(max_steps={0: best[0][1]})
        head = swarm.peers[-1]
        head.wait_exit(args.start_timeout_s)
    finally:
        swarm.close()
    summaries = [p.summary() for p in swarm.peers]
    s0 = summaries[-1]
    ends = {p.info["stage"]: s.get("steps") for p, s in zip(swarm.peers, summaries, strict=True)}
    moved = {s: (best[s][1], ends[s]) for s in ends if ends[s] != best[s][1]}
    if moved:
        raise RuntimeError(f"the evaluation swarm trained (stage: checkpoint step, step at exit): {moved}")
    if s0.get("final_val_loss_from") != "final evaluation" or s0.get("final_val_loss") is None:
        raise RuntimeError(f"the evaluation swarm's stage-0 peer reported no final evaluation; see {head.dir}")
    return {"swarm_val_loss": float(s0["final_val_loss"]), "steps": {str(k): v for k, v in ends.items()},
            "ckpt_dirs": [str(p.dir / "ckpt") for p in swarm.peers]}


# ----- transformers -----------------------------------------------------------------------------------------------
def transformers_val_loss(hf_dir: Path, run: RunConfig, eval_batches: int) -> dict[str, Any]:
    """The exported folder loaded with ``AutoModelForCausalLM`` / ``AutoTokenizer``: its mean loss over the run's
    fixed validation batches (the peers' own ``val_set``), and whether ``AutoTokenizer`` encodes text as the
    swarm's tokenizer does."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.stream import VAL, doc_role, documents, val_set
    from trainer.tokenizer import load_tokenizer

    tok = load_tokenizer(run.data)
    val = val_set(run.data, tok, run.model.block_size, run.data.batch_size, eval_batches)
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    model.eval()
    hf_tok = AutoTokenizer.from_pretrained(hf_dir)
    text = next(t for i, t in documents(run.data) if doc_role(i, run.data) == VAL)[:4000]
    with torch.no_grad():
        losses = [F.cross_entropy(model(x).logits.flatten(0, 1).float(), y.flatten()).item() for x, y in val]
    return {"transformers_val_loss": sum(losses) / len(losses), "batch_losses": losses,
            "class": type(model).__name__,
            "tokenizer_agrees": hf_tok(text)["input_ids"] == tok.encode_batch([text])[0]}


def replica_pairs(run: RunConfig, ckpt_dirs: list[Path], eval_batches: int) -> list[dict[str, Any]]:
    """The validation loss of every chain of one checkpoint per stage (2 stages: every stage-0 replica with every
    stage-1 replica), computed here with the stages' own modules: the pipeline sends a micro-batch through any
    replica of each stage, so how far these differ shows how far apart averaging left the replicas."""
    import itertools

    import torch
    import torch.nn.functional as F

    from peer.state.checkpoint import load_checkpoint
    from trainer.stream import val_set
    from trainer.tokenizer import load_tokenizer
    from trainer.worker import StageWorker

    val = val_set(run.data, load_tokenizer(run.data), run.model.block_size, run.data.batch_size, eval_batches)
    per_stage: list[list[tuple[str, int, torch.nn.Module]]] = [[] for _ in range(run.n_stages)]
    for d in ckpt_dirs:
        for stage in range(run.n_stages):
            state = load_checkpoint(d, run, stage)
            if state is not None:
                worker = StageWorker(run, stage)
                worker.load_state_dict(state)
                name = d.parent.name if d.name == "ckpt" else d.name  # a swarm peer's folder holds ckpt/
                per_stage[stage].append((name, int(state.get("local_step", -1)), worker.model.eval()))
    out = []
    for chain in itertools.product(*per_stage):
        with torch.no_grad():
            losses = []
            for x, y in val:
                h = x
                for _, _, model in chain:
                    h = model(h)
                losses.append(F.cross_entropy(h.flatten(0, 1), y.flatten()).item())
        out.append({"chain": [f"{name}@{step}" for name, step, _ in chain], "val_loss": sum(losses) / len(losses)})
    return out


def export_hf(run_file: Path, ckpt_dirs: list[str], out: Path) -> None:
    from peer.cli import main as cli

    code = cli(["export", "--run", str(run_file), "--checkpoint-dir", *ckpt_dirs, "--format", "hf", "--out", str(out)])
    if code == INTERRUPTED:
        raise KeyboardInterrupt("asyncmesh-peer export")
    if code != 0:
        raise RuntimeError(f"asyncmesh-peer export --format hf failed ({ckpt_dirs})")


# ----- the measurement --------------------------------------------------------------------------------------------
def train(run_file: Path, run: RunConfig, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The swarm trained for ``--budget-s`` from the moment every peer trains; polled every ``--poll-s``."""
    stages = sorted((i % run.n_stages for i in range(run.n_stages * args.replicas)), reverse=True)
    swarm = Swarm(run_file, workdir, stages, args)
    samples: list[dict[str, Any]] = []
    t_launch = time.monotonic()
    try:
        swarm.start()
        swarm.wait_training(swarm.peers)
        startup_s = time.monotonic() - t_launch
        logger.info("all %d peers training after %.0f s; training for %.0f s", len(stages), startup_s, args.budget_s)
        t0 = time.monotonic()
        while (left := t0 + args.budget_s - time.monotonic()) > 0:
            samples.append(swarm.sample(t0))
            last = samples[-1]["peers"]
            logger.info("t=%4.0f s  steps %s  val %s  load %.1f", samples[-1]["t"],
                        [r["local_step"] for r in last], [r["val_loss"] for r in last if r["stage"] == 0],
                        samples[-1]["loadavg"][0])
            for p in swarm.peers:
                if not p.alive():
                    raise p.fail(f"exited with code {p.proc.returncode} during the training")
            time.sleep(min(args.poll_s, left))
        samples.append(swarm.sample(t0))
        logger.info("budget spent: stopping every peer (SIGTERM: drain, final checkpoint)")
    finally:
        swarm.close()
    return {"startup_s": startup_s, "samples": samples, "summaries": [p.summary() for p in swarm.peers],
            "ckpt_dirs": [p.dir / "ckpt" for p in swarm.peers], "stages": stages}


def figures(trained: dict[str, Any], budget_s: float) -> dict[str, Any]:
    """Per-peer figures and the validation curve from the samples of the training."""
    samples = trained["samples"]
    first, last = samples[0], samples[-1]
    window = last["t"] - first["t"]
    peers = []
    for k, row in enumerate(last["peers"]):
        rss = [s["peers"][k]["rss_mb"] or 0.0 for s in samples]
        tree = [s["peers"][k]["tree_rss_mb"] for s in samples]
        start = first["peers"][k]
        peers.append({"peer": row["peer"], "stage": row["stage"], "local_step": row["local_step"],
                      "steps_in_window": (row["local_step"] or 0) - (start["local_step"] or 0),
                      "tokens_per_s": (((row["tokens_total"] or 0) - (start["tokens_total"] or 0)) / window
                                       if window > 0 else None),
                      "rss_mb_max": max(rss), "rss_mb_last": rss[-1], "tree_rss_mb_max": max(tree),
                      "estimate_mb": row.get("estimate_mb")})
    curve: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    for s in samples:
        for r in s["peers"]:
            if r["stage"] == 0 and r["val_loss"] is not None and r["n_val"] != seen.get(r["peer"]):
                seen[r["peer"]] = r["n_val"]
                curve.append({"t": s["t"], "peer": r["peer"], "step": r["local_step"], "val_loss": r["val_loss"]})
    swarm_tps = sum(p["tokens_per_s"] or 0.0 for p in peers if p["stage"] == 0)
    loads = [s["loadavg"][0] for s in samples]
    return {"window_s": window, "budget_s": budget_s, "startup_s": trained["startup_s"],
            "swarm_tokens_per_s": swarm_tps, "peers": peers, "curve": curve,
            "loadavg_1min": {"min": min(loads), "max": max(loads), "mean": sum(loads) / len(loads)}}


def compare(swarm_loss: float, hf_loss: float, tolerance: float = 0.01) -> dict[str, Any]:
    ratio = hf_loss / swarm_loss
    return {"swarm_val_loss": swarm_loss, "transformers_val_loss": hf_loss, "ratio": ratio,
            "within_tolerance": abs(ratio - 1.0) <= tolerance, "tolerance": tolerance}


def plot(curve: list[dict[str, Any]], final: dict[str, Any] | None, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for peer in sorted({c["peer"] for c in curve}):
        pts = [c for c in curve if c["peer"] == peer]
        ax.plot([c["t"] for c in pts], [c["val_loss"] for c in pts], marker="o", label=f"{peer} (stage 0)")
    if final is not None:
        ax.axhline(final["transformers_val_loss"], color="gray", ls="--",
                   label=f"exported model, transformers: {final['transformers_val_loss']:.3f}")
    ax.set_xlabel("seconds of training (all peers training)")
    ax.set_ylabel("validation loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--run", type=Path, default=REPO / "trainer" / "runs" / "llama-small.toml",
                   help="the run file the parquet source and the tokenizer are put into")
    p.add_argument("--replicas", type=int, default=2, help="peers per stage")
    p.add_argument("--budget-s", type=float, default=480.0, help="seconds of training once every peer trains")
    p.add_argument("--vocab-size", type=int, default=4096, help="the BPE tokenizer's vocabulary")
    p.add_argument("--max-bytes", type=int, default=8_000_000, help="standard-library text written (0: all)")
    p.add_argument("--parquet-files", type=int, default=8, help="parquet files the documents are split into")
    p.add_argument("--poll-s", type=float, default=10.0, help="period of the /status polls")
    p.add_argument("--eval-every-s", type=float, default=30.0, help="the stage-0 peers' evaluation period")
    p.add_argument("--eval-batches", type=int, default=2, help="validation batches (the peers' eval_batches)")
    p.add_argument("--start-timeout-s", type=float, default=300.0, help="give up if a peer is not training by then")
    p.add_argument("--drain-timeout-s", type=float, default=30.0, help="peers' drain when stopped")
    p.add_argument("--torch-threads", type=int, default=1, help="compute threads per peer")
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="FIELD=VALUE",
                   help="extra peer setting for every peer")
    p.add_argument("--workdir", type=Path, default=None, help="data, run file, peers' files (default: a temp folder)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the results here")
    p.add_argument("--plot", type=Path, default=None, metavar="PNG", help="validation loss against time")
    args = p.parse_args(argv)
    if args.replicas < 1 or args.budget_s <= 0 or args.poll_s <= 0 or args.parquet_files < 1 or \
            args.eval_batches < 1 or args.eval_every_s <= 0:
        p.error("--replicas, --parquet-files and --eval-batches >= 1; --budget-s, --poll-s, --eval-every-s > 0")
    if not args.run.is_file():
        p.error(f"--run {args.run} does not exist")
    args.overrides = [*args.overrides, f"eval_batches={args.eval_batches}"]
    return args


def prepare(args: argparse.Namespace, workdir: Path) -> tuple[Path, RunConfig, dict[str, Any]]:
    """Parquet files, the tokenizer and the run file in ``workdir``."""
    t = time.monotonic()
    docs = stdlib_sources(args.max_bytes)
    source = write_parquet(docs, workdir / "data", args.parquet_files)
    vocab = train_tokenizer(source, args.vocab_size, workdir / "tokenizer.json")
    run_file = workdir / f"{args.run.stem}-parquet.toml"
    run = write_run(args.run, run_file, source=source, tokenizer=workdir / "tokenizer.json", vocab=vocab)
    info = {"documents": len(docs), "bytes": sum(len(t.encode()) for _, t in docs), "parquet_files":
            len(list((workdir / "data").glob("*.parquet"))), "vocab_size": vocab, "run_id": run.run_id,
            "prepare_s": round(time.monotonic() - t, 1)}
    logger.info("data: %(documents)d documents, %(bytes)d bytes in %(parquet_files)d parquet files; tokenizer "
                "%(vocab_size)d tokens; run %(run_id)s", info)
    return run_file, run, info


def machine() -> dict[str, Any]:
    import platform

    import torch

    return {"cpus": os.cpu_count(), "loadavg_at_start": list(os.getloadavg()), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform()}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    unwind_on_sigterm()
    result: dict[str, Any] = {"command": " ".join(["python tools/bench_real.py", *argv]), "machine": machine()}
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="asyncmesh-real-"))
    workdir.mkdir(parents=True, exist_ok=True)
    logger.info("data, run file, peers' logs and checkpoints, the export: %s", workdir)
    try:
        run_file, run, result["data"] = prepare(args, workdir)
        trained = train(run_file, run, workdir / "swarm", args)
        result["training"] = figures(trained, args.budget_s)
        result["training"]["summaries"] = trained["summaries"]
        best = best_checkpoints(trained["ckpt_dirs"], run)
        result["training"]["replica_pairs"] = replica_pairs(run, trained["ckpt_dirs"], args.eval_batches)
        logger.info("checkpoints (stage: step): %s; the swarm evaluates at them", {s: v[1] for s, v in best.items()})
        ev = evaluate_at_checkpoints(run_file, run, best, workdir / "eval", args)
        export_hf(run_file, ev["ckpt_dirs"], workdir / "hf")
        hf = transformers_val_loss(workdir / "hf", run, args.eval_batches)
        result["comparison"] = {**compare(ev["swarm_val_loss"], hf["transformers_val_loss"]),
                                "steps": ev["steps"], "batch_losses": hf["batch_losses"], "class": hf["class"],
                                "tokenizer_agrees": hf["tokenizer_agrees"]}
    except (PeerProcessError, RuntimeError, ValueError, OSError) as e:
        result["error"] = str(e)
        logger.error("%s", e)
    result["machine"]["loadavg_at_end"] = list(os.getloadavg())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str))
    if args.plot and "training" in result:
        plot(result["training"]["curve"], result.get("comparison"), args.plot,
             f"{args.run.stem}, {run.n_stages} stages x {args.replicas} replicas, BPE {run.model.vocab_size}")
    if "comparison" in result:
        c, tr = result["comparison"], result["training"]
        print(f"swarm: {tr['swarm_tokens_per_s']:.0f} tokens/s over {tr['window_s']:.0f} s (load "
              f"{tr['loadavg_1min']['mean']:.1f}); validation loss: swarm {c['swarm_val_loss']:.4f}, transformers "
              f"{c['transformers_val_loss']:.4f}, ratio {c['ratio']:.5f}")
    return 0 if "comparison" in result and result["comparison"]["within_tolerance"] else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("bench_real: interrupted; every peer this run started was stopped", file=sys.stderr)
        sys.exit(130)
