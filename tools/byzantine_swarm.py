#!/usr/bin/env python3
"""Robust averaging measured on a real swarm: honest validation loss of ``join`` swarms with Byzantine replicas.

The simulator (tools/robust_sweep.py) measures the aggregator alone; this tool measures the daemon: real
``asyncmesh-peer join`` processes on loopback, every check of an averaging round (membership, distance, outliers,
aggregate), real timing. The run is a 1-stage variant of ``tests/runs/tiny.toml`` (``--run``) with the chosen
``--aggregator``, so every peer is a replica of the one stage: it trains on its own batches, evaluates the fixed
validation set every 3 s and averages with all the others.

For each N of ``--grid N:B,...`` (grouped by N, in order of first appearance) it runs ``--controls`` swarms of N
honest peers back to back, then, for every B given with that N and every attack, the same swarm with the last B peers
started through ``tools/byzantine_peer.py --attack ATTACK join ...`` (the same join with an attacking averaging
behaviour handed in: how a real peer realises each attack). A swarm: the first peer starts it, the others join through
its multiaddr at once, every peer runs with ``--torch-threads 1``; once all N train, they train together for
``--train-s`` seconds, then all are stopped with SIGTERM and their ``--summary-json`` read. Per swarm it records the
honest peers' mean last validation loss, their local steps (in the window and in all), averaging rounds ok/failed, the
``rejected:avg_*`` counters they kept, the start-up time, and the 1-minute load average sampled through the window.
Per cell it reports the ratio of the honest loss to the mean of the controls of the same N, with the range against
each control, and per N the controls' spread ((max - min) / mean): a ratio inside that spread is not an effect. Every
peer is reaped by PID, pass or fail; a swarm that fails is recorded with its error and the tool goes on. The JSON is
rewritten after every swarm, so an interrupted measurement keeps what it measured.

    python tools/byzantine_swarm.py --grid 4:1,4:2,8:2,8:3 --attacks zeros,scale,signflip,noise,alie \\
        --aggregator trimmed --train-s 60 --json byzantine_swarm.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peer.ops.procs import (  # noqa: E402
    FAST_SETTINGS,
    PeerProcess,
    PeerProcessError,
    free_port,
    join_command,
    p2p_maddrs,
    terminate,
    unwind_on_sigterm,
)
from trainer.attacks import ATTACKS  # noqa: E402
from trainer.robust import AGGREGATORS  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "tests" / "runs" / "tiny.toml"
SAMPLE_EVERY_S = 5.0  # load average and liveness during the training window


@dataclass(frozen=True)
class Swarm:
    """One swarm to run: N peers, the last ``byzantine`` of them sending ``attack`` (a control: 0 and None)."""

    n: int
    byzantine: int = 0
    attack: str | None = None
    control_no: int = 0  # 1, 2, ... for the controls of an N

    @property
    def label(self) -> str:
        return f"{self.n}:0 control {self.control_no}" if self.attack is None else \
            f"{self.n}:{self.byzantine} {self.attack}"


def parse_grid(text: str) -> list[tuple[int, int]]:
    """'4:1,8:2' -> [(4, 1), (8, 2)]; N >= 2 and 0 <= B < N (the first peer, which starts the swarm, is honest;
    B = 0: the N's controls only, e.g. to measure honest averaging at N replicas)."""
    out = []
    for item in text.split(","):
        n, b = (int(x) for x in item.strip().split(":"))
        if n < 2 or not 0 <= b < n:
            raise ValueError(f"grid item {item!r}: need N >= 2 and 0 <= B < N")
        out.append((n, b))
    return out


def plan(grid: list[tuple[int, int]], attacks: list[str], controls: int) -> list[Swarm]:
    """The swarms in the order they run: per N (first appearance), its controls, then each B of it x each attack."""
    out: list[Swarm] = []
    for n in dict.fromkeys(n for n, _ in grid):
        out += [Swarm(n, control_no=i + 1) for i in range(controls)]
        out += [Swarm(n, b, a) for nn, b in grid if nn == n and b > 0 for a in attacks]
    return out


def one_stage_run(base: Path, aggregator: str, out_dir: Path, averaging: tuple[str, ...] = ()) -> Path:
    """``base`` with ``n_stages = 1``, ``[averaging] aggregator`` and the ``averaging`` overrides ('KEY=TOML value'),
    under its own run name, written to out_dir (a key is replaced wherever it occurs: the tiny run's are unique)."""
    items = {"aggregator": f'"{aggregator}"'} | {k.strip(): v.strip() for k, v in (a.split("=", 1) for a in averaging)}
    text = re.sub(r"^n_stages = \d+$", "n_stages = 1", base.read_text(), flags=re.M)
    text = re.sub(r'^name = "([^"]*)"$', rf'name = "\1-1stage-{aggregator}"', text, count=1, flags=re.M)
    for key in items:
        text = re.sub(rf"^{re.escape(key)} = .*\n", "", text, flags=re.M)
    lines = "".join(f"{k} = {v}\n" for k, v in items.items())
    text, found = re.subn(r"^\[averaging\]\n", f"[averaging]\n{lines}", text, count=1, flags=re.M)
    if not found:
        text += f"\n[averaging]\n{lines}"
    path = out_dir / f"{base.stem}-1stage-{aggregator}.toml"
    path.write_text(text)
    return path


def _wait_all_training(peers: list[PeerProcess], deadline: float) -> None:
    for p in peers:
        p.wait_status(lambda s: s.get("state") == "training" and int(s.get("local_step") or 0) > 0,
                      max(1.0, deadline - time.monotonic()), "training state")


def run_swarm(sw: Swarm, run: Path, workdir: Path, *, train_s: float, start_timeout_s: float,
              settings: tuple[str, ...] = ()) -> dict[str, Any]:
    """Start ``sw`` on loopback, train ``train_s`` seconds with every peer up, stop it; its record (see the module
    docstring). Every peer is reaped by PID, pass or fail."""
    peers: list[PeerProcess] = []
    rec: dict[str, Any] = {"label": sw.label, "n": sw.n, "byzantine": sw.byzantine, "attack": sw.attack,
                           "control_no": sw.control_no or None, "train_s": train_s,
                           "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}

    def spawn(i: int, initial: list[str]) -> PeerProcess:
        byz = i >= sw.n - sw.byzantine
        d, port = workdir / f"peer{i}", free_port()
        cmd = join_command(d, port=port, run=run, stage=0, settings=(*FAST_SETTINGS, *settings),
                           initial=initial, checkpoints=False)
        if byz:  # the same join, with the attacking averaging behaviour handed in (tools/byzantine_peer.py)
            cmd = [sys.executable, str(REPO / "tools" / "byzantine_peer.py"), "--attack", str(sw.attack),
                   *cmd[cmd.index("join"):]]
        p = PeerProcess.spawn(f"peer{i}", cmd, d, port, cwd=REPO, byzantine=byz)
        peers.append(p)
        return p

    t0 = time.monotonic()
    try:
        deadline = t0 + start_timeout_s
        first = spawn(0, [])
        maddrs = first.wait_maddrs(start_timeout_s)
        initial = (p2p_maddrs(maddrs, "127.0.0.1") or maddrs)[:1]
        for i in range(1, sw.n):
            spawn(i, initial)
        _wait_all_training(peers, deadline)
        rec["startup_s"] = round(time.monotonic() - t0, 1)
        honest = [p for p in peers if not p.info["byzantine"]]
        at_start = [p.status() or {} for p in honest]
        rec["settle"] = {"honest_val_loss_at_start": [s.get("val_loss") for s in at_start],
                         "honest_steps_at_start": [s.get("local_step") for s in at_start]}
        loads, end = [os.getloadavg()[0]], time.monotonic() + train_s
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(SAMPLE_EVERY_S, left))
            loads.append(os.getloadavg()[0])
            for p in peers:
                if not p.alive():
                    raise p.fail(f"exited with code {p.proc.returncode} while training")
        rec["loadavg_1min"] = {"min": min(loads), "max": max(loads), "mean": round(statistics.mean(loads), 2)}
        rec["attackers"] = [{k: (s or {}).get("counters", {}).get(k, 0) for k in ("byzantine_parts",
                             "byzantine_parts_read", "averaging_rounds_ok", "averaging_rounds_failed")}
                            for s in (p.status() for p in peers if p.info["byzantine"])]
        for p in peers:
            p.signal(signal.SIGTERM)
        for p in peers:
            p.wait_exit(60)
        rec.update(_figures(peers, at_start))
    except (PeerProcessError, OSError) as e:
        rec["error"] = str(e)[-4000:]
    finally:
        terminate([p.proc for p in peers], 15.0)
    rec["wall_s"] = round(time.monotonic() - t0, 1)
    return rec


def _figures(peers: list[PeerProcess], at_start: list[dict[str, Any]]) -> dict[str, Any]:
    """The honest peers' figures from their summaries (and their /status when every peer trained)."""
    per_peer, rejected = [], {}
    for p in peers:
        s = p.summary()
        per_peer.append({"name": p.name, "byzantine": p.info["byzantine"], "exit_code": s.get("exit_code"),
                         "steps": s.get("steps"), "val_losses": (s.get("val_losses") or [])[-5:],
                         "rounds_ok": s.get("averaging_rounds_ok"), "rounds_failed": s.get("averaging_rounds_failed"),
                         "avg_fraction_per_step": s.get("avg_fraction_per_step"),
                         "avg_window_s": s.get("avg_window_s"), "avg_delay_steps": s.get("avg_delay_steps"),
                         "exchanges_refused_failed": [s.get("avg_exchange_refused"), s.get("avg_exchange_failed")],
                         "round_rules": {k: s.get(k) for k in ("avg_below_quorum", "avg_pull_clipped",
                                                               "avg_self_outlier")},
                         "rejected_avg": s.get("rejected_avg", {}), "error": s.get("error")})
    honest = [q for q in per_peer if not q["byzantine"]]
    for q in honest:
        for k, v in (q["rejected_avg"] or {}).items():
            rejected[k] = rejected.get(k, 0) + v
    vals = [q["val_losses"][-1] for q in honest if q["val_losses"]]
    window = [(q["steps"] or 0) - int(s.get("local_step") or 0) for q, s in zip(honest, at_start, strict=True)]
    return {
        "honest_val_loss": statistics.mean(vals) if len(vals) == len(honest) else None,
        "honest_val_losses": vals,
        "honest_steps_mean": statistics.mean(q["steps"] or 0 for q in honest),
        "honest_window_steps_mean": statistics.mean(window),
        "honest_rounds_ok": sum(q["rounds_ok"] or 0 for q in honest),
        "honest_rounds_failed": sum(q["rounds_failed"] or 0 for q in honest),
        "honest_avg_fraction_per_step": statistics.mean(q["avg_fraction_per_step"] or 0.0 for q in honest),
        "honest_avg_fraction_per_step_min": min(q["avg_fraction_per_step"] or 0.0 for q in honest),
        "honest_rejected": dict(sorted(rejected.items())),
        "peers": per_peer,
    }


def summarise(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per swarm: controls with their N's spread, attacked swarms with the ratio to their N's controls."""
    controls: dict[int, list[float]] = {}
    for r in records:
        if r["attack"] is None and r.get("honest_val_loss") is not None:
            controls.setdefault(r["n"], []).append(r["honest_val_loss"])
    rows = []
    for r in records:
        ctl = controls.get(r["n"], [])
        base = statistics.mean(ctl) if ctl else None
        row = {k: r.get(k) for k in ("label", "n", "byzantine", "attack", "honest_val_loss",
                                     "honest_window_steps_mean", "honest_rounds_ok", "honest_rounds_failed",
                                     "honest_avg_fraction_per_step", "honest_avg_fraction_per_step_min",
                                     "honest_rejected", "attackers",
                                     "loadavg_1min", "error")}
        row["control_mean"] = base
        row["control_spread"] = (max(ctl) - min(ctl)) / base if len(ctl) > 1 and base else None
        loss = r.get("honest_val_loss")
        if r["attack"] is not None and loss is not None and ctl:
            row["ratio"] = loss / base
            row["ratio_range"] = [loss / max(ctl), loss / min(ctl)]
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table (rounds per honest peer; rejections summed over the honest peers; the attackers'
    own rounds summed over them, and for 'alie' the others' parts read per attacked part)."""
    lines = ["| N:B | attack | honest val loss | ratio (vs each control) | honest steps in window | rounds ok / "
             "failed per honest peer | averaged per step | rejected by the honest peers | attackers' rounds ok / "
             "failed | load avg (1 min) |",
             "|---|---|---:|---|---:|---|---:|---|---|---|"]
    for r in rows:
        load = r.get("loadavg_1min") or {}
        what = "control" if r["attack"] is None else r["attack"]
        if r.get("error") or r.get("honest_val_loss") is None:
            lines.append(f"| {r['n']}:{r['byzantine']} | {what} | failed: {(r.get('error') or 'no val loss')[:60]!r}"
                         " | | | | | | | |")
            continue
        if r["attack"] is None:
            spread = r.get("control_spread")
            ratio = f"spread {spread:.3f}" if spread is not None else ""
        elif r.get("ratio") is not None:
            lo, hi = r["ratio_range"]
            ratio = f"{r['ratio']:.3f} ({lo:.3f}-{hi:.3f})"
        else:
            ratio = "no control"
        honest = r["n"] - r["byzantine"]
        rej = ", ".join(f"{k.removeprefix('rejected:avg_')} {v}" for k, v in (r["honest_rejected"] or {}).items())
        lines.append(f"| {r['n']}:{r['byzantine']} | {what} | {r['honest_val_loss']:.3f} | {ratio} | "
                     f"{r['honest_window_steps_mean']:.0f} | {r['honest_rounds_ok'] / honest:.0f} / "
                     f"{r['honest_rounds_failed'] / honest:.0f} | {_fraction(r)} | "
                     f"{rej or 'none'} | {_attackers(r.get('attackers') or [])} | "
                     f"{load.get('min', 0):.1f}-{load.get('max', 0):.1f} |")
    return "\n".join(lines)


def _fraction(r: dict[str, Any]) -> str:
    """The honest peers' mean fraction averaged per local step, and the least of them when recorded."""
    text = f"{r.get('honest_avg_fraction_per_step') or 0:.4f}"
    low = r.get("honest_avg_fraction_per_step_min")
    return text if low is None else f"{text} (min {low:.4f})"


def _attackers(attackers: list[dict[str, int]]) -> str:
    if not attackers:
        return ""
    parts, read = sum(a["byzantine_parts"] for a in attackers), sum(a["byzantine_parts_read"] for a in attackers)
    text = (f"{sum(a['averaging_rounds_ok'] for a in attackers)} / "
            f"{sum(a['averaging_rounds_failed'] for a in attackers)}")
    return text + (f" (read {read / parts:.1f} parts per part)" if read and parts else "")


def machine() -> dict[str, Any]:
    return {"nproc": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "python": platform.python_version(),
            "loadavg_at_start": os.getloadavg()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", default="4:1,4:2,8:2,8:3", help="N:B pairs (peers : Byzantine peers), comma-separated")
    ap.add_argument("--attacks", default=",".join(ATTACKS), help=f"comma-separated, of {', '.join(ATTACKS)}")
    ap.add_argument("--aggregator", default="trimmed", choices=AGGREGATORS)
    ap.add_argument("--train-s", type=float, default=60.0, help="seconds all N peers train together per swarm")
    ap.add_argument("--controls", type=int, default=2, help="control swarms per N, run right before its attacks")
    ap.add_argument("--start-timeout-s", type=float, default=300.0, help="for all N peers of a swarm to train")
    ap.add_argument("--run", type=Path, default=TINY, help="base run file (made 1-stage; default: the tiny run)")
    ap.add_argument("--set", dest="settings", action="append", default=[], metavar="FIELD=VALUE",
                    help="a further peer setting for every peer (repeatable)")
    ap.add_argument("--averaging", action="append", default=[], metavar="KEY=VALUE",
                    help="override a key of the run's [averaging] (TOML value, e.g. rounds_per_tick=4; repeatable)")
    ap.add_argument("--json", type=Path, default=None, help="write every swarm's record and the table here")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the peers' folders here (default: a temp dir)")
    args = ap.parse_args(argv)
    args.grid = parse_grid(args.grid)
    args.attacks = [a for a in args.attacks.split(",") if a]
    bad = [a for a in args.attacks if a not in ATTACKS]
    if bad or not args.attacks or args.controls < 1 or args.train_s <= 0:
        ap.error(f"attacks must be of {ATTACKS} (got {bad or 'none'}); --controls >= 1; --train-s > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    unwind_on_sigterm()  # SIGTERM unwinds through run_swarm's finally: every peer is reaped
    swarms = plan(args.grid, args.attacks, args.controls)
    out: dict[str, Any] = {"tool": "tools/byzantine_swarm.py", "argv": sys.argv[1:] if argv is None else argv,
                           "aggregator": args.aggregator, "train_s": args.train_s, "machine": machine(),
                           "settings": [*FAST_SETTINGS, *args.settings], "records": []}
    with tempfile.TemporaryDirectory(prefix="byzswarm-") as tmp:
        root = args.workdir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        run = one_stage_run(args.run, args.aggregator, root, tuple(args.averaging))
        out["run"] = run.read_text()
        for i, sw in enumerate(swarms):
            print(f"[{i + 1}/{len(swarms)}] {sw.label}: starting (load average {os.getloadavg()[0]:.1f})", flush=True)
            rec = run_swarm(sw, run, root / f"swarm{i:02d}", train_s=args.train_s,
                            start_timeout_s=args.start_timeout_s, settings=tuple(args.settings))
            out["records"].append(rec)
            print(f"    {json.dumps({k: v for k, v in rec.items() if k != 'peers'})}", flush=True)
            out["cells"] = summarise(out["records"])
            if args.json:
                args.json.write_text(json.dumps(out, indent=1))
    out["machine"]["loadavg_at_end"] = os.getloadavg()
    table = format_table(out["cells"])
    out["table"] = table
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    print(table)
    print(f"nproc {out['machine']['nproc']}, load average at start {out['machine']['loadavg_at_start']}, "
          f"at end {out['machine']['loadavg_at_end']}")
    return 0 if all("error" not in r for r in out["records"]) else 1


if __name__ == "__main__":
    sys.exit(main())
