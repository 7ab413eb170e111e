"""Writes a simulation's outputs: results.json, curves.csv, curves.png (matplotlib, Agg) and table.md.

Outputs are rewritten after every finished method, so a long run that is stopped early still leaves the methods it
finished on disk.
"""

from __future__ import annotations

import csv
import json
import logging
import math
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

BASELINE = "fullsync"


def _ratio(value: float, base: float | None) -> float | None:
    if base is None or not math.isfinite(value) or not math.isfinite(base) or base == 0:
        return None
    return value / base


def results_document(config: dict[str, Any], results: list[dict[str, Any]],
                     wallclock: dict[str, Any] | None = None) -> dict[str, Any]:
    """The results.json document: config, one record per method (with its curve), and the wall-clock model."""
    base = next((r["final_val_loss"] for r in results if r["name"] == BASELINE), None)
    methods = {}
    for r in results:
        rec = {k: v for k, v in r.items() if k != "name"}
        rec["ratio_to_fullsync"] = _ratio(r["final_val_loss"], base)
        if wallclock and r["name"] in wallclock.get("methods", {}):
            rec["wallclock_s"] = wallclock["methods"][r["name"]]
        methods[r["name"]] = rec
    doc: dict[str, Any] = {"config": config, "methods": methods}
    if wallclock:
        doc["wallclock"] = wallclock
    return doc


def load_results(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Read a results.json back into (config, result records) for re-rendering; ValueError if it is not one."""
    try:
        doc = json.loads(path.read_text())
        config, methods = doc["config"], doc["methods"]
        records = []
        for name, rec in methods.items():
            rec = {k: v for k, v in rec.items() if k not in ("ratio_to_fullsync", "wallclock_s")}
            if "curve" not in rec:
                raise KeyError("curve")
            records.append({"name": name, **rec})
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a simulator results.json with curves ({e}); run simulate first") from e
    return config, records


def write_outputs(out: Path, config: dict[str, Any], results: list[dict[str, Any]],
                  wallclock: dict[str, Any] | None = None) -> None:
    """Write all four files into ``out`` (created if missing)."""
    out.mkdir(parents=True, exist_ok=True)
    doc = results_document(config, results, wallclock)
    (out / "results.json").write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    with open(out / "curves.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["method", "samples", "train_loss", "val_loss"])
        for r in results:
            for p in r["curve"]:
                writer.writerow([r["name"], p["samples"], f"{p['train_loss']:.5f}", f"{p['val_loss']:.5f}"])
    (out / "table.md").write_text(table_markdown(doc))
    try:
        import matplotlib  # noqa: F401  (the optional 'sim' extra: the runtime image ships without it)
    except ImportError:
        logger.warning("curves.png not drawn: matplotlib is not installed (pip install 'asyncmesh[sim]'); "
                       "results.json, curves.csv and table.md hold every figure")
        return
    _plot(out / "curves.png", results, doc)


def table_markdown(doc: dict[str, Any]) -> str:
    """A markdown table of the methods: final validation loss, ratio to fullsync, updates, samples, times."""
    has_wc = any("wallclock_s" in m for m in doc["methods"].values())
    head = "| method | final val loss | / fullsync | updates per stage | samples | elapsed (s) |"
    sep = "|---|---:|---:|---:|---:|---:|"
    if has_wc:
        head += " modelled wall-clock (s) |"
        sep += "---:|"
    lines = [head, sep]
    for name, m in doc["methods"].items():
        ratio = "—" if m["ratio_to_fullsync"] is None else f"{m['ratio_to_fullsync']:.3f}"
        row = (f"| {name} | {m['final_val_loss']:.4f} | {ratio} | {m['updates']} | {m['samples']} | "
               f"{m['compute_s']:.0f} |")
        if has_wc:
            wc = m.get("wallclock_s")
            row += " — |" if wc is None else f" {wc:.0f} |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def _plot(path: Path, results: list[dict[str, Any]], doc: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wc = doc.get("wallclock", {}).get("methods", {})
    panels = 2 if wc else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.5), squeeze=False)
    # a diverged method must not squash the others: cap the axis a little above the median method's first value
    firsts = sorted(r["curve"][0]["val_loss"] for r in results if r["curve"])
    top = 1.15 * firsts[len(firsts) // 2] if firsts else None
    for r in results:
        xs = [p["samples"] for p in r["curve"]]
        ys = [p["val_loss"] for p in r["curve"]]
        style = "k-" if r["name"] == BASELINE else "-"
        clipped = top is not None and any(y > top for y in ys)
        label = f"{r['name']} (off the chart: {ys[-1]:.2f})" if clipped and ys[-1] > top else r["name"]
        axes[0][0].plot(xs, ys, style, label=label, linewidth=1.2)
        if wc and r["name"] in wc and xs:
            per_sample = wc[r["name"]] / xs[-1]
            axes[0][1].plot([x * per_sample for x in xs], ys, style, label=r["name"], linewidth=1.2)
    axes[0][0].set_xlabel("samples (sequences, all replicas)")
    axes[0][0].set_ylabel("validation loss")
    axes[0][0].set_title(f"{doc['config'].get('preset', '')}: equal samples")
    if wc:
        axes[0][1].set_xlabel("modelled wall-clock (s)")
        axes[0][1].set_title("equal wall-clock (wall-clock model)")
    for ax in axes[0]:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        if top is not None:
            ax.set_ylim(top=top)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
