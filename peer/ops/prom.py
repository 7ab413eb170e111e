"""``/metrics`` with prometheus_client: one peer's snapshot, its build, its process and its GPU as Prometheus metrics.

prometheus_client writes the exposition (names, escaping, counter suffixes, OpenMetrics negotiation are its job, not
ours); what is ours is the mapping from a ``PeerMetrics`` snapshot to metric families, done in ``SnapshotCollector``
at scrape time from one snapshot, so ``/metrics`` always agrees with ``/status`` and the dashboard. The HTTP server
stays the daemon's own small asyncio server (``status_server.py``): it runs on the event loop that mutates the metrics,
so a scrape never reads them from another thread.

Conventions: counters end in ``_total`` and start at 0 for every counter the daemon knows (``KNOWN_COUNTERS``), so a
rate or an alert sees a series before the first event; units are in names (``_seconds``, ``_bytes``); ``bytes_in`` and
``bytes_out`` are exposed as ``asyncmesh_bytes_received_total`` and ``asyncmesh_bytes_sent_total``. Besides the
snapshot: ``asyncmesh_build_info`` (version, run id and name, torch, device), prometheus_client's process metrics
(``process_cpu_seconds_total``, ``process_resident_memory_bytes``, ...) and, on a CUDA device, GPU memory and
utilisation (``asyncmesh_gpu_*``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from peer.lifecycle import PeerState
from peer.ops.metrics import KNOWN_COUNTERS, KNOWN_REJECTIONS

Snapshot = dict[str, Any]
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# snapshot key -> (metric name, help) for the plain gauges
GAUGES = (
    ("local_step", "asyncmesh_local_step", "Optimiser steps applied by this peer's stage."),
    ("tokens_per_s", "asyncmesh_tokens_per_second", "Training tokens processed per second over the rate window."),
    ("bytes_in_per_s", "asyncmesh_bytes_received_per_second", "Bytes received per second over the rate window."),
    ("bytes_out_per_s", "asyncmesh_bytes_sent_per_second", "Bytes sent per second over the rate window."),
    ("bytes_per_token", "asyncmesh_bytes_per_token", "Bytes on the wire (both directions) per training token."),
    ("train_loss", "asyncmesh_train_loss", "Latest training loss seen by this peer."),
    ("val_loss", "asyncmesh_val_loss", "Latest validation loss seen by this peer."),
    ("pipeline_delay", "asyncmesh_pipeline_delay_steps", "Observed staleness of gradients, in local steps."),
    ("avg_tau", "asyncmesh_averaging_tau_steps", "Local steps the last averaging round took."),
    ("avg_fraction_per_step", "asyncmesh_averaging_fraction_per_step",
     "Weights averaged per local step since averaging started (the run asks for averaging.fraction)."),
    ("avg_delay_steps", "asyncmesh_averaging_delay_steps", "Mean local steps between a round's begin and finish."),
    ("avg_group_size", "asyncmesh_averaging_group_size", "Peers in the last successful averaging round."),
    ("inflight", "asyncmesh_inflight_microbatches", "Micro-batches awaiting their backward pass."),
    ("queued", "asyncmesh_queued_microbatches", "Work items queued for the compute thread."),
    ("uptime_s", "asyncmesh_uptime_seconds", "Seconds since the peer process started."),
    ("drain_remaining_s", "asyncmesh_drain_remaining_seconds", "Seconds left of the graceful drain."),
    ("n_stages", "asyncmesh_stages", "Pipeline stages of the run."),
)
RENAMED = {"bytes_in": "bytes_received", "bytes_out": "bytes_sent"}


def metric_name(counter: str) -> str:
    """Prometheus name of a PeerMetrics counter: ``bytes_out`` -> ``asyncmesh_bytes_sent_total``."""
    base = re.sub(r"[^a-zA-Z0-9_]", "_", counter).strip("_") or "unnamed"
    base = RENAMED.get(base, base)
    return f"asyncmesh_{base.removesuffix('_total')}_total"


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


class SnapshotCollector(Collector):
    """The metric families of one snapshot, taken afresh at each scrape from ``source``."""

    def __init__(self, source: Callable[[], Snapshot], version: str = "", torch_version: str = "") -> None:
        self.source, self.version, self.torch_version = source, version, torch_version

    def collect(self) -> Iterator[Metric]:
        yield from families(self.source(), version=self.version, torch_version=self.torch_version)


MEMORY_GAUGES = (
    ("estimate_bytes", "asyncmesh_memory_estimate_bytes", "Estimated memory of the stage served (trainer/memory.py)."),
    ("limit_bytes", "asyncmesh_memory_limit_bytes", "Memory this peer may use (--memory-gb, free GPU memory or "
                                                    "available RAM at start)."),
)


def families(snap: Snapshot, *, version: str = "", torch_version: str = "") -> Iterator[Metric]:
    """Every asyncmesh metric family of ``snap``."""
    info = GaugeMetricFamily("asyncmesh_peer_info", "Identity of this peer (value always 1).",
                             labels=["peer_id", "run_id", "stage"])
    info.add_metric([snap.get("peer_id", ""), snap.get("run_id", ""),
                     "" if snap.get("stage") is None else str(snap["stage"])], 1)
    yield info
    yield InfoMetricFamily("asyncmesh_build", "Version of this peer, its run, torch and compute device.",
                           value={"version": version, "run_id": snap.get("run_id", ""),
                                  "run_name": snap.get("run_name", ""), "torch": torch_version,
                                  "device": snap.get("device", "")})
    state = GaugeMetricFamily("asyncmesh_state", "1 for the state the peer is in, 0 for the others.",
                              labels=["state"])
    for s in PeerState:
        state.add_metric([s.value], int(snap.get("state") == s))
    yield state
    yield GaugeMetricFamily("asyncmesh_healthy", "1 when the peer is healthy (what `asyncmesh-peer status` checks).",
                            value=int(bool(snap.get("healthy", False))))
    for key, name, help_text in GAUGES:
        if _finite(snap.get(key)):
            yield GaugeMetricFamily(name, help_text, value=snap[key])
    counters = {k: 0 for k in KNOWN_COUNTERS}
    counters.update(snap.get("counters", {}))
    counters["tokens"] = snap.get("tokens_total", counters.get("tokens", 0))
    for counter, value in sorted(counters.items()):
        if counter.startswith("rejected:"):
            continue
        yield CounterMetricFamily(metric_name(counter).removesuffix("_total"),
                                  f"Count of {RENAMED.get(counter, counter).replace('_', ' ')}.", value=value)
    rejected = CounterMetricFamily("asyncmesh_rejected", "Inputs from the network refused, by reason.",
                                   labels=["reason"])
    for reason, n in sorted({**{r: 0 for r in KNOWN_REJECTIONS}, **snap.get("rejected", {})}.items()):
        rejected.add_metric([reason], n)
    yield rejected
    peers = GaugeMetricFamily("asyncmesh_swarm_peers", "Peers the DHT shows per stage.", labels=["stage"])
    for s, n in snap.get("peers_per_stage", {}).items():
        peers.add_metric([str(s)], n)
    yield peers
    yield GaugeMetricFamily("asyncmesh_warnings", "Operator warnings currently shown.",
                            value=len(snap.get("warnings", [])))
    memory = snap.get("memory") or {}
    for key, name, help_text in MEMORY_GAUGES:
        if _finite(memory.get(key)):
            yield GaugeMetricFamily(name, help_text, value=memory[key])


class GpuCollector(Collector):
    """Memory and utilisation of the CUDA device this process computes on (nothing on a CPU peer)."""

    def __init__(self, device: Callable[[], str]) -> None:
        self.device = device

    def collect(self) -> Iterator[Metric]:
        device = self.device()
        if not device.startswith("cuda"):
            return
        import torch

        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return
        label = [device]
        for name, fn, help_text in (
                ("asyncmesh_gpu_memory_allocated_bytes", torch.cuda.memory_allocated, "Tensor memory allocated."),
                ("asyncmesh_gpu_memory_reserved_bytes", torch.cuda.memory_reserved, "Memory held by the allocator."),
                ("asyncmesh_gpu_memory_max_allocated_bytes", torch.cuda.max_memory_allocated,
                 "Peak tensor memory allocated.")):
            g = GaugeMetricFamily(name, help_text, labels=["device"])
            g.add_metric(label, fn(device))
            yield g
        free, total = torch.cuda.mem_get_info(device)
        g = GaugeMetricFamily("asyncmesh_gpu_memory_total_bytes", "Memory of the device.", labels=["device"])
        g.add_metric(label, total)
        yield g
        try:  # needs NVML (nvidia-ml-py); absent, the series is simply not there
            util = torch.cuda.utilization(device)
        except Exception:  # ModuleNotFoundError, or an NVML error on an unsupported device
            return
        g = GaugeMetricFamily("asyncmesh_gpu_utilization_ratio", "GPU busy fraction over the last sample period.",
                              labels=["device"])
        g.add_metric(label, util / 100.0)
        yield g


def versions() -> tuple[str, str]:
    """(this package's version, torch's version), '' when unknown."""
    from importlib import metadata

    try:
        ours = metadata.version("asyncmesh")
    except metadata.PackageNotFoundError:
        ours = ""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = ""
    return ours, torch_version


def peer_registry(source: Callable[[], Snapshot], *, process: bool = True) -> CollectorRegistry:
    """A registry with one peer's snapshot, build info, process metrics and (on CUDA) its GPU."""
    registry = CollectorRegistry(auto_describe=False)
    ours, torch_version = versions()
    registry.register(SnapshotCollector(source, ours, torch_version))
    if process:
        ProcessCollector(registry=registry)
    registry.register(GpuCollector(lambda: str(source().get("device", ""))))
    return registry


def prometheus_text(snap: Snapshot) -> str:
    """``snap`` alone in the Prometheus text format (no process or GPU metrics): for tests and tools."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snap))
    return generate_latest(registry).decode()


def render(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()
