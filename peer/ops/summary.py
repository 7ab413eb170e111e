"""What a peer reports when it stops: the figures of ``--summary-json`` (read by the benchmarks, the tests and
operators' scripts), from its metrics, its stage-0 driver if it had one, and its sample ledger."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from peer.ops.metrics import PeerMetrics
    from peer.pipeline.driver import Stage0Driver
    from peer.pipeline.ledger import SampleLedger

logger = logging.getLogger(__name__)

COUNTED = ("microbatches_dropped", "microbatches_requeued", "retries", "averaging_rounds_ok",
           "averaging_rounds_failed", "avg_pull_clipped", "avg_below_quorum", "avg_self_outlier", "samples_refused",
           "microbatches_refused", "stage_moves", "spotcheck_sent", "spotcheck_failed", "recheck_passed",
           "recheck_failed", "fwdcheck_passed", "fwdcheck_failed", "avg_exchange_refused", "avg_exchange_failed",
           "avg_slots_missed")
"""Counters copied into the summary as they are (``spotcheck_sent``: micro-batches this stage also sent to a second
replica of the next stage, which trains them too, so that stage counts their tokens twice; ``recheck_*``: the next
stage's gradients re-computed from the held copy of it, and how many disagreed; ``fwdcheck_*``: the same of the
forwards the last stage of a 2-stage run received)."""


def peer_summary(metrics: PeerMetrics, *, head: dict[str, Any], elapsed_s: float, steps: int,
                 driver: Stage0Driver | None, ledger: SampleLedger, final_val_loss: float | None) -> dict[str, Any]:
    """The summary: ``head`` (who: peer id, stage, run, mode, exit reason) first, then the figures."""
    counters = metrics.snapshot().get("counters", {})
    losses = driver.losses if driver is not None else []
    val = final_val_loss if final_val_loss is not None else (driver.val_losses[-1] if driver and driver.val_losses
                                                             else None)
    return {
        **head, "elapsed_s": round(elapsed_s, 3), "steps": int(steps),
        "tokens": int(driver.tokens) if driver is not None else int(counters.get("tokens", 0)),
        "tokens_per_s": driver.tokens_per_s() if driver is not None else counters.get("tokens", 0) / max(elapsed_s,
                                                                                                         1e-9),
        "initial_loss": sum(losses[:5]) / len(losses[:5]) if losses else None,
        "final_loss": sum(losses[-5:]) / len(losses[-5:]) if losses else metrics.train_loss,
        "final_val_loss": val,
        # where final_val_loss comes from: a periodic evaluation stands in when the final one failed
        "final_val_loss_from": ("final evaluation" if final_val_loss is not None else
                                "latest periodic evaluation" if val is not None else None),
        "val_losses": list(driver.val_losses) if driver is not None else [],
        # the tokens counted on each stage this peer served (a stage move splits them): stage 0 counts a micro-batch
        # when its gradient is back, a later stage when its own backward is done
        "tokens_by_stage": {str(s): n for s, n in sorted(metrics.tokens_by_stage.items())},
        "samples_lost": ledger.lost, "samples_owed": len(ledger), "samples_handed_back": ledger.handed_back,
        **{k: int(counters.get(k, 0)) for k in COUNTED},
        **metrics.averaging_cadence(),
        "rejected_avg": {k: int(v) for k, v in counters.items() if k.startswith("rejected:avg_")},
        # every other refusal this peer counted (replayed micro-batch ids, norms out of bounds, unannounced senders)
        "rejected": {k: int(v) for k, v in counters.items()
                     if k.startswith(("rejected:", "flagged:")) and not k.startswith("rejected:avg_")},
    }


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    """Write ``summary`` to ``path`` atomically (a reader never sees half a file); a failure is logged, not raised."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(summary, indent=1))
        tmp.replace(path)
    except OSError as e:
        logger.error("could not write the summary to %s: %s", path, e)
