"""Measured compute times + stated network assumptions -> each method's modelled wall-clock and speedup tables.

Compute times are measured on this machine with the simulation's own StageWorkers (forward without grad; backward
with its recompute and the optimiser step) on the simulation's device, so they are CPU figures for the simulated
model unless the simulation runs on a GPU (``--device cuda``, e.g. the base preset); a GPU-like mesh is also given as
stated numbers (``GPU_LIKE``). The network is the same for every method: one-way latency and bandwidth per
link, activations and gradients in int8 (1 byte per value) on pipeline hops, fullsync's gradient all-reduce in fp32,
sparse averaging payloads in int8 (docs/design.md, "Compression").

How each method maps onto the two schedules of ``trainer.sim.wallclock``:
fullsync -> GPipe with M micro-batches; asyncmesh / async-sparta / delta -> 1F1B, p of the weights per step in int8
with at most tau rounds in flight; full-avg -> all weights per step (int8, tau 0); wagma -> all weights per step in
fp32, tau rounds in flight; naive-async / asyncpp / asyncpp-nows / accum -> 1F1B plus a blocking fp32 gradient
all-reduce per optimiser step (accum: every A micro-batches, amortised).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, TypedDict

import torch

from trainer.config import RunConfig
from trainer.rules import RULES
from trainer.sim.methods import METHODS, Combine
from trainer.sim.wallclock import MeshTiming, simulate_async, simulate_sync

logger = logging.getLogger(__name__)

LATENCIES_MS = (10, 50, 100)
DEFAULT_LATENCY_MS = 50.0
DEFAULT_BANDWIDTH = 100e6 / 8  # 100 Mbit/s in bytes/s


class _StatedMesh(TypedDict):
    """Stated numbers of a mesh: seconds per micro-batch on one stage of a 4-stage split, the whole model's
    parameters, activation bytes per hop, link bytes per second."""

    what: str
    fwd_s: float
    bwd_s: float
    params: int
    activation_bytes: int
    bandwidth: float


GPU_LIKE: _StatedMesh = {
    "what": "AsyncMesh base model (163M params, 8 x 1024 tokens per micro-batch) on A10G-class GPUs, stated",
    "fwd_s": 0.043, "bwd_s": 0.087, "params": 163_000_000, "activation_bytes": 8 * 1024 * 768,
    "bandwidth": 1e9 / 8,
}


def measure_stage_times(run: RunConfig, *, repeats: int = 12, warmup: int = 2,
                        device: str = "cpu") -> tuple[list[float], list[float]]:
    """Forward and backward(+step) seconds per micro-batch of every stage of ``run`` on ``device``.

    On the CPU: CPU time of this (single-threaded) process, so other processes sharing the machine do not inflate it.
    On a GPU: wall time with the device synchronised before and after each call. The minimum over ``repeats``.
    """
    from trainer.worker import StageWorker, is_gpu, use_tf32_on_gpu

    torch.set_num_threads(1)
    gpu = is_gpu(device)
    use_tf32_on_gpu(device)

    def clock() -> float:
        if gpu:
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return time.process_time()

    k, b, t = run.n_stages, run.data.batch_size, run.model.block_size
    workers = [StageWorker(run, s, device=device) for s in range(k)]
    fwd: list[list[float]] = [[] for _ in range(k)]
    bwd: list[list[float]] = [[] for _ in range(k)]
    gen = torch.Generator().manual_seed(0)
    for i in range(warmup + repeats):
        x = torch.randint(0, run.model.vocab_size, (b, t), generator=gen)
        y = torch.randint(0, run.model.vocab_size, (b, t), generator=gen)
        h, inputs = x, []
        for s in range(k - 1):
            inputs.append(h)
            t0 = clock()
            h = workers[s].forward(i, h)
            fwd[s].append(clock() - t0)
        t0 = clock()
        workers[-1].evaluate(h, y)
        f_last = clock() - t0
        t0 = clock()
        _, g = workers[-1].forward_loss(i, h, y)
        fwd[-1].append(f_last)
        bwd[-1].append(max(0.0, clock() - t0 - f_last))
        for s in range(k - 2, -1, -1):
            t0 = clock()
            assert g is not None  # stage 0, the only one to return None, is the last to run
            g = workers[s].backward(i, g)
            bwd[s].append(clock() - t0)

    return [min(v[warmup:]) for v in fwd], [min(v[warmup:]) for v in bwd]


def stage_param_counts(run: RunConfig) -> list[int]:
    from trainer.model import stage_parameter_counts

    return stage_parameter_counts(run)


def _on_gpu(sim: Any) -> bool:
    from trainer.worker import is_gpu

    return is_gpu(getattr(sim, "device", "cpu"))


@dataclass
class WallclockReport:
    """Compute times of the simulated model and the network assumptions; turns results into modelled seconds."""

    sim: Any
    fwd_s: list[float]
    bwd_s: list[float]
    params: list[int]
    bandwidth: float = DEFAULT_BANDWIDTH
    """Link bandwidth in bytes/s: 100 Mbit/s for CPU-measured compute, GPU_LIKE's 1 Gbit/s for GPU-measured."""

    @classmethod
    def measure(cls, sim: Any) -> WallclockReport:
        device = getattr(sim, "device", "cpu")
        fwd, bwd = measure_stage_times(sim.run, device=device)
        bandwidth = GPU_LIKE["bandwidth"] if _on_gpu(sim) else DEFAULT_BANDWIDTH
        return cls(sim, fwd, bwd, stage_param_counts(sim.run), bandwidth)

    @property
    def measured_on(self) -> str:
        return "GPU" if _on_gpu(self.sim) else "CPU"

    def mesh(self, latency_s: float, bandwidth: float | None = None) -> MeshTiming:
        run = self.sim.run
        act = run.data.batch_size * run.model.block_size * run.model.n_embd  # int8: one byte per value
        return MeshTiming(fwd_s=tuple(self.fwd_s), bwd_s=tuple(self.bwd_s), stage_params=tuple(self.params),
                          activation_bytes=float(act), n_replicas=self.sim.n_replicas, link_latency_s=latency_s,
                          link_bandwidth=self.bandwidth if bandwidth is None else bandwidth)

    def per_microbatch(self, method: str, tau: int, mesh: MeshTiming) -> float:
        """Modelled seconds per micro-batch (per replica) of ``method`` on ``mesh``."""
        spec, k = METHODS[method], mesh.n_stages
        if spec.schedule == "sync":
            return simulate_sync(mesh, micro_batches=self.sim.micro_batches).seconds_per_microbatch
        if spec.combine == Combine.GRADIENTS:
            every = self.sim.accumulate if method == "accum" else 1
            return simulate_async(mesh, inflight=k, avg_fraction=1.0, avg_bytes_per_param=4.0 / every,
                                  max_pending_rounds=0).seconds_per_microbatch
        if method == "full-avg":
            frac, nbytes, pending = 1.0, 1.0, 0
        elif RULES[spec.rule].whole:
            frac, nbytes, pending = 1.0, 4.0, tau
        else:
            frac, nbytes, pending = self.sim.fraction, 1.0, tau
        return simulate_async(mesh, inflight=k, avg_fraction=frac, avg_bytes_per_param=nbytes,
                              max_pending_rounds=pending).seconds_per_microbatch

    def for_results(self, results: list[dict[str, Any]]) -> dict[str, Any]:
        """The results.json 'wallclock' section: assumptions and each finished method's modelled seconds."""
        mesh = self.mesh(DEFAULT_LATENCY_MS / 1e3)
        methods = {r["name"]: self.per_microbatch(r["method"], r["tau"] or 0, mesh) * self.sim.steps for r in results}
        return {
            "assumptions": {
                "compute": (f"measured on this {self.measured_on}, "
                            + ("synchronised wall time" if self.measured_on == "GPU" else "process CPU time, 1 thread")
                            + ", minimum over 12 micro-batches"),
                "fwd_s": self.fwd_s, "bwd_s": self.bwd_s, "stage_params": self.params,
                "latency_s": DEFAULT_LATENCY_MS / 1e3, "bandwidth_bytes_per_s": self.bandwidth,
                "activations": "int8", "inflight": mesh.n_stages,
            },
            "methods": methods,
        }

    def speedup_rows(self, latencies_ms: tuple[int, ...] = LATENCIES_MS) -> list[dict[str, Any]]:
        """asyncmesh over fullsync at each latency, for this mesh (measured compute)."""
        rows = []
        for lat in latencies_ms:
            mesh = self.mesh(lat / 1e3)
            rows.append(speedup_row(f"{mesh.n_stages}x{mesh.n_replicas} sim model, {self.measured_on}-measured", mesh,
                                    self.sim.micro_batches, self.sim.fraction, self.sim.tau, lat))
        return rows

    def speedup_markdown(self) -> str:
        return speedup_markdown(self.speedup_rows())


def speedup_row(label: str, mesh: MeshTiming, micro_batches: int, fraction: float, tau: int,
                latency_ms: float) -> dict[str, Any]:
    """Seconds per sample of fullsync and asyncmesh on ``mesh`` (window K, and a window that hides the RTT)."""
    sync = simulate_sync(mesh, micro_batches=micro_batches).seconds_per_microbatch
    k = mesh.n_stages
    asy = simulate_async(mesh, inflight=k, avg_fraction=fraction, max_pending_rounds=tau).seconds_per_microbatch
    stage = max(f + b for f, b in zip(mesh.fwd_s, mesh.bwd_s, strict=True))
    rtt = sum(mesh.fwd_s) + sum(mesh.bwd_s) + 2 * (k - 1) * mesh.link_latency_s
    window = max(k, math.ceil(rtt / stage))
    wide = simulate_async(mesh, inflight=window, avg_fraction=fraction,
                          max_pending_rounds=tau).seconds_per_microbatch
    return {"mesh": label, "latency_ms": latency_ms, "fullsync_s_per_mb": sync, "asyncmesh_s_per_mb": asy,
            "speedup": sync / asy, "wide_window": window, "asyncmesh_wide_s_per_mb": wide, "speedup_wide": sync / wide}


def speedup_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| mesh | latency (ms) | fullsync s/micro-batch | asyncmesh W=K | speedup | W to hide RTT | "
             "asyncmesh | speedup |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mesh']} | {r['latency_ms']:.0f} | {r['fullsync_s_per_mb']:.4f} | "
                     f"{r['asyncmesh_s_per_mb']:.4f} | {r['speedup']:.2f}x | {r['wide_window']} | "
                     f"{r['asyncmesh_wide_s_per_mb']:.4f} | {r['speedup_wide']:.2f}x |")
    return "\n".join(lines) + "\n"


def gpu_like_rows(n_replicas: int, micro_batches: int, fraction: float, tau: int,
                  stages: tuple[int, ...] = (4, 8)) -> list[dict[str, Any]]:
    """Speedup rows of the stated GPU-like mesh (``GPU_LIKE``) for each depth and latency."""
    return [speedup_row(f"{k}x{n_replicas} GPU-like 163M (stated)", gpu_like_mesh(k, n_replicas, lat / 1e3),
                        micro_batches, fraction, tau, lat) for k in stages for lat in LATENCIES_MS]


def gpu_like_mesh(n_stages: int, n_replicas: int, latency_s: float) -> MeshTiming:
    """The stated GPU-like mesh: GPU_LIKE's model split evenly over ``n_stages``."""
    g = GPU_LIKE
    scale = 4 / n_stages  # GPU_LIKE times are per stage of a 4-stage split
    return MeshTiming(fwd_s=(g["fwd_s"] * scale,) * n_stages, bwd_s=(g["bwd_s"] * scale,) * n_stages,
                      stage_params=(g["params"] // n_stages,) * n_stages,
                      activation_bytes=float(g["activation_bytes"]), n_replicas=n_replicas,
                      link_latency_s=latency_s, link_bandwidth=g["bandwidth"])
