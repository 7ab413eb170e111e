"""The daemon's use of the round aggregation (trainer/aggregate.py, shared with the simulator): one contribution per
authenticated peer id, our own keyed by our peer id; ``AveragingLoop`` passes its ``NetAveragingConfig``'s outlier
factor, floor and lone bound, and the partners it asked (docs/security.md, "Robust averaging"); the sync barrier
its outlier factor and floor (``barrier_mean``)."""

from __future__ import annotations

from trainer.aggregate import LONE_FLOOR_RMS, barrier_mean, full_quorum, quorum_of, robust_combine

__all__ = ["LONE_FLOOR_RMS", "barrier_mean", "full_quorum", "quorum_of", "robust_combine"]
