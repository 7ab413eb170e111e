"""The one registry of the names a peer counts under: counters, refusals and guard events.

A counter is a plain name (``tokens``); a refusal of network input is counted as ``rejected:<reason>``; an event of the
pipeline guard as ``relearnt:<bound>`` or ``flagged:<what>``. ``/metrics`` exports every name here from 0, so a rate
or an alert sees a series before the first event. A name must never be built from free text or from what a peer sent
(an error message, a round number): every distinct name is a counter kept for the peer's life and a Prometheus series.
``PeerMetrics.inc`` therefore folds an unregistered name into ``unregistered`` (or ``rejected:other``) and logs
it once; the tests make it an error (``STRICT``), and tests/test_ops_names.py checks every literal name in the code.
"""

from __future__ import annotations

COUNTERS = (
    # training progress
    "tokens", "samples", "evaluations", "eval_failed", "nonfinite_loss", "compute_errors",
    # the pipeline
    "microbatches_dropped", "microbatches_requeued", "microbatches_refused", "samples_refused", "retries",
    "late_backward", "busy_replies", "busy_received", "busy_next_down", "black_holes_banned",
    "microbatches_forfeited", "share_bans", "forwards_out_of_bounds", "backwards_out_of_bounds",
    "sync_late_forwards", "sync_barrier_failed", "sync_average_incomplete", "sync_fork_detected", "sync_resync_ok",
    "sync_resync_failed", "sync_resync_refused",
    # spot checks of the next stage (peer/pipeline/spotcheck.py)
    "spotcheck_sent", "spotcheck_passed", "spotcheck_failed", "spotcheck_unavailable", "spotcheck_void",
    "spotcheck_arbitrated", "spotcheck_banned", "spotcheck_unresolved",
    # re-checks of the last stage from the held copy of it (peer/pipeline/recheck.py)
    "recheck_sampled", "recheck_passed", "recheck_failed", "recheck_banned", "recheck_unavailable", "recheck_errors",
    "recheck_by_record",
    # stage 0's forwards re-computed by stage 1 (peer/pipeline/fwdcheck.py)
    "fwdcheck_passed", "fwdcheck_failed", "fwdcheck_unavailable", "fwdcheck_errors",
    # what a stage received and returned, told to the stage two before (peer/pipeline/testimony.py)
    "testimony_served", "testimony_not_found",
    # witnesses proven to lie about a hop by their own signatures (peer/pipeline/attest.py): at the stage that
    # re-checks (proven, shown to the hop, the hop refused the proof, a gradient named a liar), at the hop (banned)
    "liars_proven", "liars_shown", "liar_proof_refused", "liar_named", "liars_banned",
    # averaging
    "averaging_rounds_ok", "averaging_rounds_failed", "avg_exchange_failed", "avg_exchange_refused",
    "avg_exchange_busy", "avg_pull_clipped", "avg_below_quorum", "avg_self_outlier", "avg_slots_missed",
    # traffic
    "bytes_in", "bytes_out",
    # stage moves, state and backups
    "stage_moves", "stage_move_backoffs", "state_sync_ok", "state_sync_donor_failed", "state_sync_outvoted",
    "state_witness_dissent", "state_sync_unwitnessed", "state_step_capped", "state_digests_served",
    "state_chunks_served", "backups_taken", "backups_wanted", "backups_skipped_busy", "backups_served",
    "backups_failed", "backup_restores", "backup_bytes_in", "backup_bytes_out",
    # membership gossip (peer/membership/gossip.py)
    "records_served", "records_learnt", "gossip_failed",
    # the initial peers' vouches a joiner draws a state's witnesses from (peer/membership/vouches.py)
    "vouches_served", "vouches_failed",
    # generation through the swarm
    "infer_served", "infer_busy", "infer_compute_ms",
    # data shards of streamed datasets (peer/pipeline/shards.py)
    "data_shard_shared", "data_shard_moves",
    # what a red-team peer sent (tools/byzantine_swarm.py)
    "byzantine_parts", "byzantine_parts_read",
    # a name the code counted without registering it (a bug; see the module docstring)
    "unregistered",
)

_AVG_REASONS = ("not_a_part", "wrong_run", "wrong_stage", "wrong_round", "sender_mismatch", "tensor_count", "shape",
                "dtype", "payload", "nonfinite", "closed", "not_member", "not_in_group", "stopped", "stale_round",
                "future_round", "round_over", "step_over", "too_many_steps", "slot_closed", "too_far", "too_large",
                "outlier")
_STATE_REASONS = ("not_a_request", "wrong_run", "wrong_stage", "no_version", "bad_chunk", "rate_limited")
_INFER_REASONS = ("bad_request", "rate_limited", "wrong_run", "wrong_stage", "not_ready")

REJECTIONS = (
    # forward / backward requests
    "not_ready", "wrong_run", "wrong_stage", "bad_request", "bad_tensor", "duplicate", "mode_mismatch", "bad_loss",
    "unauthorized",
    # the pipeline guard
    "unannounced_sender", "replayed_microbatch", "activations_norm", "gradients_norm", "loss_above_ceiling",
    "share_exceeded", "share_banned",
    # neighbour backups
    "backup_shape",
    # membership gossip
    "records_rate_limited", "gossiped_record", "vouches_rate_limited",
    # middle-stage re-checks (peer/pipeline/testimony.py)
    "testimony_rate_limited", "bad_testimony",
    # signed frames (peer/pipeline/attest.py)
    "unsigned", "bad_fraud", "fraud_rate_limited",
    *(f"avg_{r}" for r in _AVG_REASONS),
    *(f"state_{r}" for r in _STATE_REASONS),
    *(f"infer_{r}" for r in _INFER_REASONS),
    # a reason the code used without registering it
    "other",
)

EVENTS = ("relearnt:activations_norm", "relearnt:gradients_norm", "relearnt:loss_ceiling", "flagged:loss_outlier",
          "flagged:loss_ceiling_held")

REJECTED_PREFIX = "rejected:"
_REGISTERED = frozenset((*COUNTERS, *(REJECTED_PREFIX + r for r in REJECTIONS), *EVENTS))

STRICT = False
"""Raise on an unregistered name instead of folding it (set by the tests)."""


def is_registered(name: str) -> bool:
    """Whether ``name`` (a counter, ``rejected:<reason>`` or an event) is in the registry."""
    return name in _REGISTERED


def registered(name: str) -> str:
    """``name`` itself when it is registered; else ``unregistered`` or ``rejected:other`` (ValueError when STRICT)."""
    if name in _REGISTERED:
        return name
    if STRICT:
        raise ValueError(f"counter name {name!r} is not registered in peer/ops/names.py: add it there")
    return REJECTED_PREFIX + "other" if name.startswith(REJECTED_PREFIX) else "unregistered"
