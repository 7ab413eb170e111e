#!/usr/bin/env python3
"""Activation/gradient codecs where the link is the bottleneck: one fresh swarm per codec, same wall-clock budget.

``python tools/bench_links.py --json OUT --plot PNG`` (as root, for the emulated WAN of tools/wan.py). For each network
(by default 20 and 100 Mbit/s uplinks per peer, 101 ms RTT) and each codec it writes the run (``--run``, by default
trainer/runs/links.toml, a wide and shallow GPT whose activations dominate the link) with that codec's compression
section, starts a fresh ``n_stages x replicas`` swarm of ``asyncmesh-peer join`` processes on it
(tools/bench_ttl.py's ``train_case``) and trains it for ``--budget-s`` seconds from the moment every peer trains. The
stage-0 replicas evaluate the run's fixed validation batches every ``--eval-every-s``.

Codecs: ``int8`` (the default: blockwise int8 activations and gradients), ``subspace`` (k fp32 coefficients per token
and the token ids, trainer/subspace.py), ``subspace-int8``, ``subspace-int4`` and ``subspace-int3`` (the coefficients
quantised), ``subspace-ecq`` (quantised on a uniform grid and Huffman-coded, protocol/codecs/quant.py).

Figures (``--json OUT``), under ``networks`` -> network (``20mbit-101ms``) -> codec:

* ``bytes_per_token``: what the peers' emulated links sent over the budget, all peers of a stage together:
  ``activations`` (stages before the last: training and evaluation forwards with their TCP/IP headers and the DHT's
  traffic, per token forwarded) and ``gradients`` (stages after the first, per training token), their ``total``, and
  ``payload`` (the envelopes' bytes alone per token, from the codec: a forward's with its targets or token window);
  ``rpc_activations``, ``rpc_gradients`` and ``rpc_total``: the same for the RPC messages alone (each peer's
  ``bytes_out``), and ``overhead_bytes_per_s``: what the links carried beyond the messages (libp2p and TCP/IP
  framing, the DHT) per second.
* ``tokens_per_s`` (stage 0's training tokens over the budget), ``curve`` (validation loss against seconds and
  tokens), ``final_val_loss`` (mean of the last three evaluations).
* ``time_to_loss_speedup_vs_int8``: the seconds int8 needs to reach its own final loss over the seconds this codec
  needs to reach it (interpolated first crossing; None if it never does within the budget).
* ``equal_tokens_loss_ratio_vs_int8``: this codec's validation loss / int8's, both at the smaller of the two final
  token counts (interpolated along each curve). ``equal_tokens_at_evaluation``: the same ratio where the curve with
  fewer evaluations in the common token range was last evaluated, the other interpolated there (bench_ttl's
  ``at_sparser_evaluation``: a faster codec, evaluated on the same clock, is sparser in tokens, and a straight line
  between its evaluations overstates its loss).
* ``costs`` (per codec, measured in this process, not on the wire): encode+decode seconds of one micro-batch's
  activations and of its gradient, the projection's seconds per optimiser step (subspace), and the memory the codec
  keeps per stage (basis and fixed tables).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peer.ops.procs import unwind_on_sigterm  # noqa: E402
from tools.bench_swarm import REPO, BenchError, Case, repo_path  # noqa: E402
from tools.bench_ttl import at_sparser_evaluation, final_loss, interpolate, time_to_reach, train_case  # noqa: E402
from tools.swarm_case import add_swarm_arguments, command_line, swarm_overrides  # noqa: E402
from tools.wan import check_available  # noqa: E402

logger = logging.getLogger("bench_links")

CODECS = ("int8", "subspace", "subspace-int8", "subspace-int4", "subspace-int3", "subspace-ecq")
BASELINE = "int8"
_NETWORK = re.compile(r"^(?P<rate>[0-9.]+)mbit-(?P<rtt>[0-9.]+)ms$")


# ----- the runs -----------------------------------------------------------------------------------------------------
def codec_run(base: Any, codec: str, rank: int, table_std: float | None = None) -> Any:
    """The base run with one codec's compression section (averaging payloads as they were); ``table_std``: the
    subspace codecs' fixed embedding tables' std (None: the run's default)."""
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; known: {CODECS}")
    if not codec.startswith("subspace"):
        return base.replace(compression={"activations": codec, "gradients": codec, "subspace_rank": 0,
                                         "subspace_codec": "none"})
    coefficients = codec.partition("-")[2] or "none"
    extra = {} if table_std is None else {"subspace_table_std": table_std}
    return base.replace(compression={"activations": "subspace", "gradients": "subspace", "subspace_rank": rank,
                                     "subspace_codec": coefficients, **extra})


def parse_network(name: str) -> tuple[float, float]:
    """'20mbit-101ms' -> (uplink Mbit/s, one-way delay in ms: half the RTT)."""
    m = _NETWORK.match(name)
    if not m:
        raise ValueError(f"network {name!r} must look like 20mbit-101ms (uplink rate, round-trip time)")
    return float(m["rate"]), float(m["rtt"]) / 2


# ----- what a codec costs, in this process ------------------------------------------------------------------------
def payload_per_token(run: Any) -> dict[str, float]:
    """Envelope bytes per token of one micro-batch: activations (+ targets, or the subspace runs' token window)
    and gradients, as sent."""
    import torch

    from peer.pipeline.boundary import Boundary

    b, t, d = run.data.batch_size, run.model.block_size, run.model.n_embd
    g = torch.Generator().manual_seed(0)
    y, seq = torch.randn(b, t, d, generator=g), torch.randint(0, run.model.vocab_size, (b, t + 1), generator=g)
    boundary = Boundary(run, None)
    targets, window = boundary.first_hop(seq[:, :-1], seq[:, 1:])
    acts, tokens = boundary.encode_forward(y, window)
    grad = boundary.encode_gradient(y * 1e-3)
    act_bytes = len(acts.data) + sum(len(e.data) for e in (tokens, targets) if e is not None)
    return {"activations": act_bytes / (b * t), "gradients": len(grad.data) / (b * t),
            "fp32_activations": 4.0 * d}


def codec_costs(run: Any, repeats: int = 5) -> dict[str, Any]:
    """Seconds to encode+decode one micro-batch's activations and gradient, the subspace coordinates' way in and out
    of a constrained stage's optimiser step (``projection_s_per_step``), and
    the bytes a stage keeps for the codec (median of ``repeats``, one thread, on the CPU)."""
    import torch

    from peer.pipeline.boundary import Boundary
    from protocol.messages import Forward
    from trainer.subspace import Coordinates
    from trainer.worker import StageWorker

    torch.set_num_threads(1)
    b, t, d = run.data.batch_size, run.model.block_size, run.model.n_embd
    boundary = Boundary(run, None)
    g = torch.Generator().manual_seed(0)
    y, seq = torch.randn(b, t, d, generator=g), torch.randint(0, run.model.vocab_size, (b, t + 1), generator=g)
    targets, window = boundary.first_hop(seq[:, :-1], seq[:, 1:])

    def median(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    def forward() -> None:
        acts, tokens = boundary.encode_forward(y, window)
        boundary.decode_forward(Forward(run_id=run.run_id, mb_id=1, route=["p"], activations=acts, targets=targets,
                                        is_eval=False, sent_at=1.0, tokens=tokens), "p")

    out: dict[str, Any] = {"activations_s": median(forward),
                           "gradients_s": median(lambda: boundary.decode_gradient(boundary.encode_gradient(y), "p"))}
    ss = boundary.subspace
    if ss is not None:
        worker = StageWorker(run, 0)
        for p in worker.parameters():
            p.grad = torch.randn_like(p)
        coords = Coordinates(ss, worker.model, worker.parameters())  # a constrained stage's step: coordinates out, in
        out["projection_s_per_step"] = median(lambda: (coords.gather(), coords.scatter()))
        tables = [ss.u, ss.tok_table] + ([ss.pos_table] if ss.pos_table is not None else [])
        out["memory_bytes"] = sum(x.numel() * x.element_size() for x in tables)
    else:
        out["projection_s_per_step"], out["memory_bytes"] = 0.0, 0
    return out


def train_in_process(run: Any, steps: int, evals: int = 4, eval_batches: int = 2) -> list[dict[str, float]]:
    """The same micro-batches through a 2-stage pair of workers in this process, every activation and gradient
    through the codec's real encode and decode (peer/pipeline/boundary.py), no network and no delay: validation loss
    on ``eval_batches`` fixed micro-batches against tokens, with the wall clock and the machine's load taken out.
    Returns [{tokens, val_loss}]."""
    import torch

    from peer.pipeline.boundary import Boundary
    from protocol.messages import Forward
    from trainer.data import BatchStream, load_corpus, val_batches
    from trainer.worker import StageWorker

    if run.n_stages != 2:
        raise ValueError("the in-process comparison runs 2-stage runs")
    torch.set_num_threads(1)
    corpus = load_corpus(run.data, run.model.vocab_size)
    b, t = run.data.batch_size, run.model.block_size
    val = val_batches(corpus, t, b, eval_batches)
    stream = BatchStream(corpus.train, t, b, seed=1)
    w0, w1 = StageWorker(run, 0), StageWorker(run, 1)
    wire = Boundary(run, w0.subspace)
    curve = []
    for i in range(1, steps + 1):
        x, y = stream.next()
        targets, window = wire.first_hop(x, y)
        acts, tokens = wire.encode_forward(w0.forward(i, x), window)
        msg = Forward(run_id=run.run_id, mb_id=i, route=["p"], activations=acts, targets=targets, is_eval=False,
                      sent_at=1.0, tokens=tokens)
        _, grad = w1.forward_loss(i, wire.decode_forward(msg, "p")[0], y)
        w0.backward(i, wire.decode_gradient(wire.encode_gradient(grad), "p"))
        if i % max(1, steps // evals) == 0 or i == steps:
            loss = sum(float(w1.evaluate(w0.evaluate(vx), vy)) for vx, vy in val) / len(val)
            curve.append({"tokens": i * b * t, "val_loss": loss})
    return curve


# ----- figures ------------------------------------------------------------------------------------------------------
def wire_bytes_per_token(result: dict[str, Any], n_stages: int, eval_tokens: int = 0) -> dict[str, float | None]:
    """Link bytes sent per token: stages before the last send activations (per token forwarded: training and the
    ``eval_tokens`` of the evaluations), stages after the first gradients (per training token; an evaluation's
    answer is a loss). A 2-stage swarm splits them exactly."""
    tokens = result["tokens"]
    links = result.get("link_bytes")
    if not links or tokens <= 0:
        return {"activations": None, "gradients": None, "total": None}
    acts = sum(x["tx"] for x in links if x["stage"] < n_stages - 1) / (tokens + eval_tokens)
    grads = sum(x["tx"] for x in links if x["stage"] > 0) / tokens
    out: dict[str, float | None] = {"activations": acts, "gradients": grads, "total": acts + grads}
    if all(x.get("rpc_tx") is not None for x in links):  # the RPC messages alone (results from before: absent)
        out["rpc_activations"] = sum(x["rpc_tx"] for x in links if x["stage"] < n_stages - 1) / (tokens + eval_tokens)
        out["rpc_gradients"] = sum(x["rpc_tx"] for x in links if x["stage"] > 0) / tokens
        out["rpc_total"] = out["rpc_activations"] + out["rpc_gradients"]
        # what the links carried beyond the messages, per second of the budget (libp2p and TCP/IP framing, the DHT)
        out["overhead_bytes_per_s"] = sum(x["tx"] - x["rpc_tx"] for x in links) / result["budget_s"]
    return out


def refigure(doc: dict[str, Any]) -> None:
    """(Re)compute every case's bytes per token and its figures against int8 from the raw records (in place)."""
    meta = doc["meta"]
    if "tokens_per_microbatch" not in meta:  # results written before it was recorded: the run file says
        from trainer.config import RunConfig

        run = RunConfig.from_toml(REPO / meta["run"])
        meta["tokens_per_microbatch"] = run.data.batch_size * run.model.block_size
    tpm = meta["tokens_per_microbatch"]
    for cases in doc["networks"].values():
        for codec, rec in cases.items():
            evals = sum(int(n) for n in (rec.get("evals_per_replica") or {}).values())
            rec["eval_tokens"] = evals * meta["eval_batches"] * tpm
            rec["bytes_per_token"] = {**wire_bytes_per_token(rec, meta["n_stages"], rec["eval_tokens"]),
                                      "payload": doc["codecs"][codec]["payload_bytes_per_token"]}
        compare(cases)


def compare(cases: dict[str, dict[str, Any]]) -> None:
    """Fill each codec's figures against the baseline's curve (in place)."""
    base = cases.get(BASELINE)
    base_t = [(p["t"], p["val_loss"]) for p in base["curve"]] if base else []
    base_tok = [(p["tokens"], p["val_loss"]) for p in base["curve"]] if base else []
    target = final_loss(base_t)
    t_base = time_to_reach(base_t, target) if target is not None else None
    for rec in cases.values():
        by_t = [(p["t"], p["val_loss"]) for p in rec["curve"]]
        by_tok = [(p["tokens"], p["val_loss"]) for p in rec["curve"]]
        t_own = time_to_reach(by_t, target) if target is not None else None
        rec["time_to_loss"] = {"target_loss": target, "int8_s": t_base, "codec_s": t_own}
        rec["time_to_loss_speedup_vs_int8"] = t_base / t_own if t_base and t_own else None
        at = min(base_tok[-1][0], by_tok[-1][0]) if base_tok and by_tok else None
        mine = interpolate(by_tok, at) if at is not None else None
        theirs = interpolate(base_tok, at) if at is not None else None
        rec["equal_tokens"] = {"tokens": at, "codec_loss": mine, "int8_loss": theirs}
        rec["equal_tokens_loss_ratio_vs_int8"] = mine / theirs if mine and theirs else None
        sparse = at_sparser_evaluation(by_tok, base_tok)
        rec["equal_tokens_at_evaluation"] = (None if sparse is None else
                                             {"tokens": sparse[0], "codec_loss": sparse[1], "int8_loss": sparse[2],
                                              "ratio": sparse[1] / sparse[2] if sparse[2] else None})


def markdown(doc: dict[str, Any]) -> str:
    """The figures as the markdown table of docs/performance.md (``--table JSON`` prints it for a result file)."""
    rows = ["| network | codec | act B/token | grad B/token | total (x fp32) | messages act+grad | payload act+grad | "
            "other traffic B/s | tokens/s | final loss | loss vs int8, equal tokens | the same at an evaluation | "
            "time-to-loss vs int8 |",
            "|---|---|" + "---:|" * 11]

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    for name, cases in doc["networks"].items():
        for codec, r in cases.items():
            b = r["bytes_per_token"]
            fp32 = 2 * b["payload"]["fp32_activations"]
            share = f"{num(b['total'], '.0f')} ({num(b['total'] / fp32 if b['total'] else None, '.4f')})"
            rows.append(f"| {name} | {codec} | {num(b['activations'], '.0f')} | {num(b['gradients'], '.0f')} | "
                        f"{share} | {num(b.get('rpc_total'), '.0f')} | "
                        f"{b['payload']['activations'] + b['payload']['gradients']:.0f} | "
                        f"{num(b.get('overhead_bytes_per_s'), '.0f')} | "
                        f"{r['tokens_per_s']:.0f} | {num(r.get('final_val_loss'), '.3f')} | "
                        f"{num(r.get('equal_tokens_loss_ratio_vs_int8'), '.3f')} | "
                        f"{num((r.get('equal_tokens_at_evaluation') or {}).get('ratio'), '.3f')} | "
                        f"{num(r.get('time_to_loss_speedup_vs_int8'), '.2f')} |")
    inproc = {c: r for c, r in doc.get("codecs", {}).items() if r.get("in_process_curve")}
    if inproc:
        rows += ["", "| codec (in process, same micro-batches) | tokens | validation loss | vs int8 |",
                 "|---|---:|---:|---:|"]
        for codec, r in inproc.items():
            last = r["in_process_curve"][-1]
            rows.append(f"| {codec} | {last['tokens']} | {last['val_loss']:.3f} | "
                        f"{num(r.get('in_process_loss_ratio_vs_int8'), '.3f')} |")
    return "\n".join(rows)


def plot(networks: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(networks), 2, figsize=(12, 4 * len(networks)), squeeze=False)
    for (name, cases), (a, b) in zip(networks.items(), axes, strict=True):
        for codec, c in cases.items():
            a.plot([p["t"] for p in c["curve"]], [p["val_loss"] for p in c["curve"]], label=codec)
            b.plot([p["tokens"] / 1e3 for p in c["curve"]], [p["val_loss"] for p in c["curve"]], label=codec)
        a.set(xlabel="wall-clock since all peers train (s)", ylabel="validation loss (nats)",
              title=f"{name}: vs time")
        b.set(xlabel="training tokens (thousands)", ylabel="validation loss (nats)", title=f"{name}: vs tokens")
        for ax in (a, b):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----- command line -------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_links.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--run", type=Path, default=REPO / "trainer" / "runs" / "links.toml", help="base run TOML")
    p.add_argument("--codecs", nargs="+", choices=CODECS, default=["int8", "subspace", "subspace-int4"])
    p.add_argument("--rank", type=int, default=32, help="subspace rank k for the subspace codecs")
    p.add_argument("--seed", type=int, default=None, help="the run's seed (init, basis, fixed tables; default: the "
                   "run file's)")
    p.add_argument("--table-std", type=float, default=None,
                   help="the subspace codecs' fixed embedding tables' std (default: the run's "
                   "compression.subspace_table_std)")
    p.add_argument("--networks", nargs="+", default=["20mbit-101ms", "100mbit-101ms"],
                   help="emulated WANs as RATEmbit-RTTms (per-peer uplink, round trip), or 'loopback'")
    add_swarm_arguments(p, replicas=1, budget_s=90.0, eval_every_s=10.0, subnet="100.64.9")
    p.add_argument("--in-process-steps", type=int, default=0,
                   help="also train each codec this many micro-batches in one process, without network (0: skip)")
    p.add_argument("--lr", type=float, default=None,
                   help="every codec's peak learning rate (default: the run file's), to tune each side")
    p.add_argument("--in-process-evals", type=int, default=4,
                   help="evaluations along the in-process run, evenly spaced in micro-batches")
    p.add_argument("--table", type=Path, default=None, metavar="JSON",
                   help="only recompute an earlier result's figures from its raw records, rewrite it, print the table")
    args = p.parse_args(argv)
    if args.rank < 1:
        p.error("--rank must be >= 1")
    for name in args.networks:
        if name not in ("loopback", "none"):
            try:
                parse_network(name)
            except ValueError as e:
                p.error(str(e))
    # no copy of the neighbour stage's state (peer/state/backup.py): its transfer is not pipeline traffic and would
    # land in one case's window and not another's
    args.overrides = [*swarm_overrides(p, args), "backup_every_s=0", *args.overrides]
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    if args.table is not None:
        doc = json.loads(args.table.read_text())
        refigure(doc)
        args.table.write_text(json.dumps(doc, indent=1, default=str))
        if args.plot:
            plot(doc["networks"], args.plot)
        print(markdown(doc))
        return 0
    from trainer.config import RunConfig

    base = RunConfig.from_toml(args.run)
    if args.seed is not None:
        base = base.replace(seed=args.seed)
    if args.lr is not None:
        base = base.replace(optim={"lr": args.lr})
    args.networks = [n for n in args.networks if n != "none"]  # 'none': the in-process comparison only
    if any(n != "loopback" for n in args.networks) and (why := check_available(args.emulator)):
        print(f"bench_links: error: the emulated WAN is not available here: {why}", file=sys.stderr)
        return 2
    unwind_on_sigterm()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="asyncmesh-links-"))
    root.mkdir(parents=True, exist_ok=True)
    runs = {c: codec_run(base, c, args.rank, args.table_std) for c in args.codecs}
    paths = {}
    for codec, run in runs.items():
        paths[codec] = root / f"run-{codec}.toml"
        paths[codec].write_text(run.to_toml())
    codecs = {c: {"run_id": run.run_id, "compression": run.to_dict()["compression"],
                  "payload_bytes_per_token": payload_per_token(run), "costs": codec_costs(run)}
              for c, run in runs.items()}
    load_start = os.getloadavg()
    for codec, run in runs.items():
        if args.in_process_steps:
            logger.info("%s: %d micro-batches in process", codec, args.in_process_steps)
            codecs[codec]["in_process_curve"] = train_in_process(run, args.in_process_steps, args.in_process_evals,
                                                                   args.eval_batches)
    if args.in_process_steps and BASELINE in codecs:
        base_loss = codecs[BASELINE]["in_process_curve"][-1]["val_loss"]
        for rec in codecs.values():
            rec["in_process_loss_ratio_vs_int8"] = rec["in_process_curve"][-1]["val_loss"] / base_loss
    networks: dict[str, dict[str, dict[str, Any]]] = {}

    def document(partial: bool = False) -> dict[str, Any]:
        doc = {"networks": networks, "codecs": codecs,
               "meta": {"run": repo_path(args.run), "rank": args.rank, "table_std": args.table_std,
                        "seed": base.seed, "lr": base.optim.lr, "n_stages": base.n_stages,
                        "tokens_per_microbatch": base.data.batch_size * base.model.block_size,
                        "replicas": args.replicas, "budget_s": args.budget_s, "eval_every_s": args.eval_every_s,
                        "eval_batches": args.eval_batches, "torch_threads": args.torch_threads,
                        "device": args.device, "nproc": os.cpu_count(), "loadavg_start": load_start,
                        "loadavg_end": os.getloadavg(), "python": platform.python_version(),
                        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                        "command": command_line("python tools/bench_links.py", argv)}}
        if partial:
            doc["meta"]["partial"] = "written before every swarm had run"
        refigure(doc)
        return doc

    def write(doc: dict[str, Any]) -> None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1, default=str))

    for name in args.networks:
        rate, delay = (0.0, 0.0) if name == "loopback" else parse_network(name)
        case = Case("async", "loopback" if name == "loopback" else "wan", delay, rate)
        networks[name] = {}
        for codec in args.codecs:
            workdir = root / name / codec
            workdir.mkdir(parents=True, exist_ok=True)
            logger.info("%s / %s: starting a fresh swarm", name, codec)
            try:
                rec = train_case(case, argparse.Namespace(**{**vars(args), "run": paths[codec]}), workdir,
                                 base.n_stages)
            except BenchError as e:
                logger.error("%s / %s failed: %s", name, codec, e)
                rec = {"error": str(e), "curve": [], "tokens": 0, "tokens_per_s": 0.0}
            rec.pop("summaries", None)
            networks[name][codec] = rec
            logger.info("%s / %s: %.0f tokens/s, final loss %s", name, codec, rec["tokens_per_s"],
                        rec.get("final_val_loss"))
            if args.json:  # a run cut short (a lease, a timeout) keeps the swarms it finished
                write(document(partial=True))
    doc = document()
    if args.json:
        write(doc)
    if args.plot:
        plot(networks, args.plot)
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
