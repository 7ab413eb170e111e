"""The figures of tools/bench_swarm.py, from its samples: swarm tokens/s over a window, stalls, bytes per token,
speedup and latency hiding, and the text and Markdown tables. Pure functions (no processes, no network)."""

from __future__ import annotations

import itertools
from typing import Any


def window_tokens_per_s(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> float:
    """Swarm tokens/s between two sets of samples ``{"stage", "tokens_total", "t"}`` (same peers, same order).

    Only stage-0 peers count: each token enters the pipeline there once. Each peer's rate uses its own timestamps.
    """
    if len(before) != len(after):
        raise ValueError(f"samples differ in length ({len(before)} != {len(after)}); take both from the same peers")
    total = 0.0
    for b, a in zip(before, after, strict=True):
        if b.get("stage") != 0 or a.get("stage") != 0:
            continue
        dt = a["t"] - b["t"]
        if dt <= 0:
            raise ValueError(f"the second sample must be later than the first (dt = {dt})")
        total += (a["tokens_total"] - b["tokens_total"]) / dt
    return total


def ratios(results: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Speedup (async / sync, same network) and latency hiding (same mode: delay / 0 ms) from case results.

    ``speedup_vs_active_sync`` divides by sync's rate over the intervals in which it made progress (its stalls
    removed): a lower bound on the speedup when the synchronous baseline stalls.
    """
    rate = {(r["mode"], r["net"], r["delay_ms"]): r for r in results}
    speedup: dict[str, float | None] = {}
    conservative: dict[str, float | None] = {}
    hiding: dict[str, float | None] = {}
    for (mode, net, delay), r in sorted(rate.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        key = "loopback" if net == "loopback" else f"wan-{delay:g}ms"
        value = r["tokens_per_s"]
        if mode == "async":
            sync = rate.get(("sync", net, delay))
            speedup[key] = value / sync["tokens_per_s"] if sync and sync["tokens_per_s"] else None
            active = sync.get("active_tokens_per_s") if sync else None
            conservative[key] = value / active if active else None
        if net == "wan":
            base = rate.get((mode, "wan", 0.0))
            hiding[f"{mode}/{key}"] = value / base["tokens_per_s"] if base and base["tokens_per_s"] else None
    return {"speedup": speedup, "speedup_vs_active_sync": conservative, "latency_hiding": hiding}


def bytes_per_token(before: list[dict[str, int] | None], after: list[dict[str, int] | None], stages: list[int],
                    tokens: float) -> dict[str, float] | None:
    """Wire bytes sent per swarm token, in all and by the sender's stage; None without link counters or tokens."""
    if tokens <= 0 or any(x is None for x in (*before, *after)):
        return None
    out: dict[str, float] = {"total": 0.0}
    for b, a, stage in zip(before, after, stages, strict=True):
        sent = (a["tx"] - b["tx"]) / tokens  # type: ignore[index]
        out["total"] += sent
        out[f"stage{stage}_tx"] = out.get(f"stage{stage}_tx", 0.0) + sent
    return out


def stalled_seconds(timeline: list[tuple[float, int]]) -> float:
    """Seconds of the window in which no stage-0 token completed (sum of poll intervals without progress)."""
    return sum(t1 - t0 for (t0, n0), (t1, n1) in itertools.pairwise(timeline) if n1 <= n0)


def active_rate(timeline: list[tuple[float, int]]) -> float | None:
    """Stage-0 tokens/s over the poll intervals with progress only (None when nothing moved)."""
    moving = [(t1 - t0, n1 - n0) for (t0, n0), (t1, n1) in itertools.pairwise(timeline) if n1 > n0]
    seconds = sum(dt for dt, _ in moving)
    return sum(dn for _, dn in moving) / seconds if seconds > 0 else None


def format_table(results: list[dict[str, Any]], figures: dict[str, dict[str, float | None]]) -> str:
    """The results as a fixed-width text table (also pasted into docs/performance.md)."""
    head = (f"{'case':<22} {'tokens/s':>9} {'rtt ms':>7} {'B/token':>8} {'dropped':>7} {'stalled s':>9} "
            f"{'cpu %':>6} {'steps':>6}")
    lines = [head, "-" * len(head)]
    for r in results:
        bpt = r.get("bytes_per_token") or {}
        rtt = "-" if r.get("rtt_ms") is None else f"{r['rtt_ms']:.1f}"
        per_token = f"{bpt['total']:.0f}" if bpt else "-"
        lines.append(f"{r['label']:<22} {r['tokens_per_s']:>9.0f} {rtt:>7} {per_token:>8} {r['dropped']:>7d} "
                     f"{r.get('stalled_s', 0.0):>9.0f} {r['cpu_util'] * 100:>6.0f} {r['stage0_steps']:>6d}")
    lines.append("")
    for name, table in figures.items():
        for key, value in table.items():
            lines.append(f"{name:<23} {key:<22} {('-' if value is None else f'{value:.2f}')}")
    return "\n".join(lines)


def markdown_tables(results: list[dict[str, Any]], figures: dict[str, dict[str, float | None]]) -> str:
    """The results and ratios as Markdown tables (what docs/performance.md shows)."""
    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)
    lines = ["| case | RTT ms | tokens/s | tokens/s while moving | stalled s | wire B/token (sent, all peers) | "
             "CPU used (of all cores) | stage-0 steps |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        bpt = (r.get("bytes_per_token") or {}).get("total")
        lines.append(f"| {r['label']} | {num(r.get('rtt_ms'), '.1f')} | {r['tokens_per_s']:.0f} | "
                     f"{num(r.get('active_tokens_per_s'), '.0f')} | {r.get('stalled_s', 0.0):.0f} | "
                     f"{num(bpt, '.0f')} | {r['cpu_util'] * 100:.0f} % | {r['stage0_steps']} |")
    lines += ["", "| ratio | network | value |", "|---|---|---:|"]
    for name, table in figures.items():
        lines += [f"| {name} | {key} | {num(value, '.2f')} |" for key, value in table.items()]
    return "\n".join(lines)
