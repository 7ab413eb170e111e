"""How much memory one replica of one stage needs: weights, gradients, optimiser state, stashed weights, averaging
state, the inputs kept for micro-batches in flight, and the peak of one micro-batch's backward.

Nothing here is a formula of one architecture. The stage is built by ``trainer.model.build_stage`` on the ``meta``
device (shapes, no storage), and the backward is *measured*: the worker's recompute-and-backward of one micro-batch
(forward with autograd, the loss on the last stage, ``torch.autograd.grad`` to the weights and the input) runs once
on fake tensors (``torch._subclasses.FakeTensorMode``: the real kernels' shape and dtype logic, no storage, a few
ms) under a dispatch mode that counts the bytes of every tensor alive and keeps their peak. It runs under the same
``torch.autocast`` the worker uses, so the bf16 column counts the bf16 copies of weights and activations autocast
makes. The fake tensors are CPU tensors: attention is measured with the CPU flash kernel of
``scaled_dot_product_attention``, which keeps its output and a log-sum-exp per row as the CUDA flash kernel does
(no T x T matrix), and CPU autocast casts matrix products to bf16 as CUDA's does (its op lists differ in details).

The worker recomputes a stage's forward at its backward (trainer/worker.py), so a micro-batch in flight costs only
its stage input; the autograd graph exists for one micro-batch at a time. Weight stashing keeps at most one copy of
the weights per micro-batch in flight (a copy exists only while a micro-batch forwarded at those weights waits for
its gradient; the last stage forwards and backwards at once and stashes nothing). Averaging ('ema') keeps an EMA
buffer per weight, and every round in flight a snapshot of its partition (indices and values) on the device and the
partition cache (two cycles, one small integer per coordinate) in host memory; what a rule keeps is what it declares
(trainer/rules.py). The optimiser's state per weight is measured by stepping the run's optimiser once on a tiny
tensor.

Mixed precision (``precision="bf16"``) keeps fp32 master weights, fp32 gradients and fp32 optimiser state; only
what the backward keeps changes. Not counted: the CUDA context and allocator slack (``HEADROOM`` covers them when
deciding what fits), torch's own workspaces, and what the peer process holds besides the model (Python, torch and
hivemind themselves, the compute queue).
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from trainer.config import RunConfig
from trainer.optim import build_optimizer
from trainer.rules import rule_of

PRECISIONS = ("fp32", "bf16")
HEADROOM = 1.15
"""A stage fits when HEADROOM x its estimate is at most the memory a peer may use (allocator slack, CUDA context)."""
GiB = 1024**3


@dataclass(frozen=True, kw_only=True)
class StageMemory:
    """Bytes one replica of ``stage`` needs at ``precision`` with ``inflight`` micro-batches in flight."""

    stage: int
    precision: str
    inflight: int
    params: int
    """Parameters of the stage (a count, not bytes)."""
    weights: int
    """fp32 weights (and buffers)."""
    grads: int
    """fp32 gradients summed into the weights' ``.grad`` (the backward's own gradients are in ``backward``)."""
    optimizer: int
    """The optimiser's per-weight state (Adam-family: two fp32 moments; of a subspace run's constrained weights,
    two per coordinate in the subspace)."""
    stash: int
    """Weight copies kept for micro-batches forwarded at older weights (weight stashing)."""
    averaging: int
    """The EMA drift buffer and the snapshots of the averaging rounds in flight, on the compute device."""
    inputs: int
    """Stage inputs kept for the micro-batches in flight (the backward recomputes from them)."""
    backward: int
    """Peak of one micro-batch's recomputed forward and backward (activations saved, the loss, the gradients of
    activations, weights and input, the output gradient received)."""
    host: int
    """Host memory only: the averaging partition cache (two cycles of one small integer per coordinate); in a
    subspace run also the wire side's basis and fixed tables (a CPU peer's stage 0 shares its worker's, counted
    twice here)."""
    subspace: int = 0
    """A subspace run's basis U and, on the stage that trains the embeddings, the fixed tables F (vocab x n_embd),
    and a constrained stage's coordinates the optimiser steps with their gradients, on the compute device."""

    @property
    def device_bytes(self) -> int:
        """What the compute device holds."""
        return (self.weights + self.grads + self.optimizer + self.stash + self.averaging + self.inputs
                + self.backward + self.subspace)

    @property
    def total_bytes(self) -> int:
        """Device plus host-only bytes (what a CPU peer needs)."""
        return self.device_bytes + self.host

    def needs(self, device_type: str) -> int:
        """Bytes that must fit in the memory of a ``device_type`` ('cuda': the GPU's, 'cpu': the machine's)."""
        return self.device_bytes if device_type == "cuda" else self.total_bytes

    def as_dict(self) -> dict[str, int | str]:
        d: dict[str, int | str] = {f.name: getattr(self, f.name) for f in fields(self)}
        d["device_bytes"], d["total_bytes"] = self.device_bytes, self.total_bytes
        return d


def estimate_stage(run: RunConfig, stage: int, *, precision: str = "fp32", inflight: int | None = None,
                   ) -> StageMemory:
    """The memory of one replica of ``stage`` (pure: the same run, stage and arguments give the same figures).

    Args:
        run: the run (model, split, optimiser, averaging, batch size).
        stage: 0 <= stage < run.n_stages.
        precision: 'fp32' or 'bf16' (autocast with fp32 master weights and optimiser state).
        inflight: micro-batches in flight through the pipeline (default n_stages + 1, the peer's default).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if not 0 <= stage < run.n_stages:
        raise ValueError(f"stage must be in [0, {run.n_stages}), got {stage}")
    inflight = run.n_stages + 1 if inflight is None else inflight
    if inflight < 1:
        raise ValueError(f"inflight must be >= 1, got {inflight}")
    shape = _stage_shape(run, stage)
    params, weight_bytes = shape.params, shape.weight_bytes + shape.buffer_bytes
    is_last = stage == run.n_stages - 1
    b, t, c = run.data.batch_size, run.model.block_size, run.model.n_embd
    input_bytes = b * t * 8 if stage == 0 else b * t * c * 4  # token ids, or fp32 activations
    avg = run.averaging
    averaging = host = 0
    rule = rule_of(avg)
    if rule.averages:
        fraction = rule.round_fraction(avg)
        drift = rule.drift
        # kept per round in flight: int64 indices and, for the drift, the values at its start; for the round being
        # exchanged: the values sent and the mean received
        part = math.ceil(fraction * params)
        # the EMA drift buffer (rules with ``ema``), and the corrections applied so far (rules that re-apply their
        # own progress only: trainer/rules.py own_progress), each the size of the weights
        averaging = ((shape.weight_bytes if rule.ema else 0) + (shape.weight_bytes if rule.own_progress else 0)
                     + avg.rounds_per_tick * part * (8 + 4 * drift) + part * 8)
        n_parts = 1 if fraction >= 1.0 else math.ceil(1.0 / fraction - 1e-9)
        host = 0 if n_parts == 1 else 2 * params * (2 if n_parts <= 65535 else 4)
    return StageMemory(
        stage=stage, precision=precision, inflight=inflight, params=params, weights=weight_bytes,
        grads=shape.weight_bytes,
        optimizer=_optimizer_slots(run, stage) * 4 * _stepped_numel(run, stage),
        stash=0 if is_last or not run.optim.weight_stashing else inflight * shape.weight_bytes,
        averaging=averaging,
        inputs=0 if is_last else inflight * input_bytes,
        backward=_backward_peak(run, stage, precision),
        host=host + _subspace_bytes(run, stage, wire=True),
        subspace=_subspace_bytes(run, stage, wire=False))


def estimate_run(run: RunConfig, *, inflight: int | None = None) -> list[StageMemory]:
    """Every stage at every precision: [stage 0 fp32, stage 0 bf16, stage 1 fp32, ...]."""
    return [estimate_stage(run, s, precision=p, inflight=inflight) for s in range(run.n_stages) for p in PRECISIONS]


def fits(estimate: StageMemory, limit_bytes: int, device_type: str) -> bool:
    """Whether the stage fits in ``limit_bytes`` of a ``device_type`` device, with HEADROOM to spare."""
    return estimate.needs(device_type) * HEADROOM <= limit_bytes


# --- measurements (cached per run and stage: the run is frozen and hashable) -----------------------------------------
@dataclass(frozen=True)
class _Shape:
    params: int
    weight_bytes: int
    buffer_bytes: int


@functools.lru_cache(maxsize=64)
def _stage_shape(run: RunConfig, stage: int) -> _Shape:
    module = _meta_stage(run, stage)
    params = sum(p.numel() for p in module.parameters())
    weight_bytes = sum(p.numel() * 4 for p in module.parameters())  # fp32 master weights whatever the precision
    buffer_bytes = sum(b.numel() * b.element_size() for b in module.buffers())
    return _Shape(params, weight_bytes, buffer_bytes)


def _meta_stage(run: RunConfig, stage: int) -> torch.nn.Module:
    from trainer.model import build_stage  # trainer.model imports nothing of this module; kept local for start-up

    with torch.device("meta"):
        return build_stage(run, stage)


@functools.lru_cache(maxsize=64)
def _stepped_numel(run: RunConfig, stage: int) -> int:
    """Values the optimiser steps (and keeps state for): the stage's parameters, except that a subspace run's
    constrained stage steps each residual writer and embedding table as its coordinates, k per n_embd
    (trainer/subspace.py, ``Coordinates``)."""
    from trainer.subspace import LAYOUTS, constrained  # kept local for start-up, as build_stage

    if not constrained(run, stage):
        return _stage_shape(run, stage).params

    layout, d, k = LAYOUTS[run.model.arch], run.model.n_embd, run.compression.subspace_rank
    return sum(p.numel() // d * k if layout.constrains(n) else p.numel()
               for n, p in _meta_stage(run, stage).named_parameters())


def _unconstrained_numel(run: RunConfig, stage: int) -> int:
    """Parameters of the stage outside the subspace (all of them on a stage that is not constrained)."""
    from trainer.subspace import LAYOUTS, constrained  # kept local for start-up, as build_stage

    if not constrained(run, stage):
        return _stage_shape(run, stage).params
    layout = LAYOUTS[run.model.arch]
    return sum(p.numel() for n, p in _meta_stage(run, stage).named_parameters() if not layout.constrains(n))


@functools.lru_cache(maxsize=64)
def _subspace_bytes(run: RunConfig, stage: int, *, wire: bool) -> int:
    """fp32 bytes of a subspace run's tensors (0 in a plain run): the wire side's basis and fixed tables (``wire``),
    or the worker's basis, its tables where it holds them and its coordinates with their gradients."""
    from trainer.subspace import LAYOUTS, holds_tables  # kept local for start-up, as build_stage

    if not run.compression.subspace:
        return 0
    m, k = run.model, run.compression.subspace_rank
    basis = m.n_embd * k
    tables = (m.vocab_size + (m.block_size if LAYOUTS[m.arch].position_table is not None else 0)) * m.n_embd
    if wire:
        return 4 * (basis + tables)
    coordinates = _stepped_numel(run, stage) - _unconstrained_numel(run, stage)
    return 4 * (basis + (tables if holds_tables(run, stage) else 0) + 2 * coordinates)


@functools.lru_cache(maxsize=16)
def _optimizer_slots(run: RunConfig, stage: int) -> int:
    """Tensors of a weight's size the run's optimiser keeps per weight, measured by one step on a tiny tensor."""
    p = torch.nn.Parameter(torch.zeros(7))
    p.grad = torch.ones(7)
    opt = build_optimizer([p], run.optim, stage, run.n_stages)
    opt.step()
    return sum(1 for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.numel() == p.numel())


@functools.lru_cache(maxsize=64)
def _backward_peak(run: RunConfig, stage: int, precision: str) -> int:
    """Peak bytes allocated by one micro-batch's recomputed forward and backward, measured on fake tensors, plus
    the output gradient received (fp32)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    module = _meta_stage(run, stage)
    is_first, is_last = stage == 0, stage == run.n_stages - 1
    b, t, c = run.data.batch_size, run.model.block_size, run.model.n_embd
    with FakeTensorMode(allow_non_fake_inputs=True):
        tensors = {n: torch.empty(p.shape, dtype=p.dtype, requires_grad=True) for n, p in module.named_parameters()}
        tensors.update({n: torch.empty(x.shape, dtype=x.dtype) for n, x in module.named_buffers()})
        x = torch.zeros(b, t, dtype=torch.long) if is_first else torch.empty(b, t, c, requires_grad=True)
        targets = torch.zeros(b, t, dtype=torch.long) if is_last else None
        grad_out = None if is_last else torch.empty(b, t, c)
        peak = backward_peak(module, tensors, x, targets, grad_out, precision=precision)
    return peak + (0 if is_last else b * t * c * 4)


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of every storage made under it while any tensor holds it, and their peak."""

    def __init__(self) -> None:
        TorchDispatchMode.__init__(self)  # named, not super(): untyped_calls_exclude does not see through super()
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def _track(self, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key not in self.sizes:
            self.sizes[key], self.refs[key] = t.untyped_storage().nbytes(), 0
            self.live += self.sizes[key]
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        weakref.finalize(t, self._drop, key)

    def _drop(self, key: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            self.live -= self.sizes.pop(key)
            del self.refs[key]

    def __torch_dispatch__(self, func: Callable[..., Any], types: Sequence[type], args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._track, out)
        return out


def backward_peak(module: torch.nn.Module, tensors: dict[str, torch.Tensor], x: torch.Tensor,
                  targets: torch.Tensor | None, grad_out: torch.Tensor | None, *, precision: str) -> int:
    """Peak bytes allocated while ``module`` at ``tensors`` recomputes its forward on ``x`` (with the loss when
    ``targets`` is given, else backpropagating ``grad_out``) and backpropagates to its weights and input, as the
    worker's ``_backprop`` does. Works on real and on fake tensors (the estimate uses fake ones, the tests compare)."""
    from torch.func import functional_call

    params = [v for v in tensors.values() if v.requires_grad]
    live = _LiveBytes()
    with live:
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = functional_call(module, tensors, (x,))
            if targets is not None:
                from trainer.model import StageBase  # local as build_stage above

                assert isinstance(module, StageBase), "targets are given to a stage module only (its loss)"
                target, grad = module.loss(out, targets), None
            else:
                assert grad_out is not None
                target, grad = out, grad_out.to(out.dtype)
        grads = torch.autograd.grad(target, params + ([x] if x.requires_grad else []), grad)
        del out, target, grad, grads
    return live.peak


def _storage_key(t: torch.Tensor) -> int:
    """One storage, however many views of it there are."""
    return int(t.untyped_storage()._cdata)
