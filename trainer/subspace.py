"""The subspace-confined residual stream (Protocol Models, Pluralis 2025): k coefficients per token cross a boundary.

Every weight that writes into the residual stream is kept in the column space of a fixed orthonormal basis U
[n_embd, k] (GPT: each block's ``attn.c_proj`` and ``mlp.c_proj``, weights and biases), and each embedding table is a
fixed table F (the seeded init's draw at the std ``compression.subspace_table_std``, never trained) plus a trainable
part whose rows lie in span(U). The residual stream
anywhere in the model is then ``x = F_tok[ids] + F_pos[pos] + U c``: a stage boundary needs only the k coefficients
``c = U^T (x - F)`` and the token ids, from which the receiver rebuilds ``x`` exactly (to float rounding).

Gradients: every trained weight sees the gradient ``g`` at a boundary only through ``U U^T g`` (the stage's outputs
move only inside span(U), and the out-of-subspace parts of the embeddings and writers are projected away), so the
backward sends ``U^T g``, losslessly. A constrained stage's optimiser steps each writer and table as its
coordinates in the subspace (``Coordinates``): the gradients computed locally enter as their coordinates, the same
projection, so a stage steps on the same gradient whichever side of a boundary its layers sit, and Adam scales each
direction of the subspace, not each coordinate of the full tensor.

Averaging (coordinate-wise robust aggregation, quantised payloads) and a state load move the weights out of the
subspace; ``project_`` puts them back after every averaging finish and state load. U and F derive from the run seed
alone and are never trained or sent, so every stage and replica agrees on them, and the weights stay an ordinary
GPT's (export needs nothing of this module).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainer.config import RunConfig
from trainer.model import seeded_normal

__all__ = ["Coordinates", "Layout", "LAYOUTS", "Subspace", "basis", "constrained", "fixed_tables", "holds_tables"]


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Where one architecture writes into its residual stream (parameter names as a stage module holds them).

    writers: name suffixes of the [n_embd, *] weights and [n_embd] biases whose output is added to the residual.
    token_table / position_table: the stage-0 embedding tables whose rows are residual vectors (None: no such
        table, e.g. rotary positions), and the names their seeded init (and so F) is drawn under.
    """

    writers: tuple[str, ...]
    token_table: str
    position_table: str | None

    def constrains(self, name: str) -> bool:
        """Whether a stage's parameter ``name`` is kept in the subspace (a writer or an embedding table)."""
        return name.endswith(self.writers) or name in (self.token_table, self.position_table)


#: per architecture (``model.arch``); a new stage model adds its own
LAYOUTS: dict[str, Layout] = {
    "gpt": Layout(writers=("attn.c_proj.weight", "attn.c_proj.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"),
                  token_table="wte.weight", position_table="wpe.weight"),
    "llama": Layout(writers=("self_attn.o_proj.weight", "mlp.down_proj.weight"),
                    token_table="model.embed_tokens.weight", position_table=None),  # rotary: no position table
}


def constrained(run: RunConfig, stage: int) -> bool:
    """Whether ``stage`` keeps its writers and tables in the subspace: every stage of a subspace run but the last,
    whose residual stream never crosses a boundary (its writers are free, as in Protocol Models' unconstrained final
    layers)."""
    return run.compression.subspace and stage != run.n_stages - 1


def basis(seed: int, n_embd: int, rank: int) -> torch.Tensor:
    """The run's orthonormal basis U [n_embd, rank] (fp32, CPU): QR of a Gaussian drawn from the run seed."""
    digest = hashlib.sha256(f"asyncmesh-subspace/{seed}/{n_embd}/{rank}".encode()).digest()
    gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    q, r = torch.linalg.qr(torch.randn(n_embd, rank, generator=gen, dtype=torch.float64))
    u: torch.Tensor = q * torch.sign(torch.diagonal(r))  # sign-fixed: unique for the draw
    return u.to(torch.float32).contiguous()


def _fixed_table(run: RunConfig, name: str, rows: int) -> torch.Tensor:
    """F of the embedding table ``name``: the init's draw of it at the std ``compression.subspace_table_std`` (so F
    is parallel to the table's init), [rows, n_embd] fp32 on the CPU."""
    return seeded_normal(run.seed, name, (rows, run.model.n_embd), run.compression.subspace_table_std)


def holds_tables(run: RunConfig, stage: int) -> bool:
    """Whether ``stage``'s weights include embedding tables kept in the subspace (F plus a trainable part): stage 0
    of a subspace run, unless it is also the last."""
    return stage == 0 and constrained(run, stage)


def fixed_tables(run: RunConfig, stage: int) -> dict[str, torch.Tensor]:
    """The fixed part F of every embedding table ``stage`` holds in the subspace, by parameter name (empty for a
    stage without one, or outside the subspace): such a table is F plus a trainable part in span(U), and F is the
    same for every replica. What tells two replicas' tables apart, or a replica's from a forged one, is the trainable
    part alone; against the whole table (F's std 0.2 next to a trained part of a few hundredths) a replacement of
    the entire trainable part reads as a small relative change (``peer.state.witness``)."""
    if not holds_tables(run, stage):
        return {}
    layout = LAYOUTS[run.model.arch]
    out = {layout.token_table: _fixed_table(run, layout.token_table, run.model.vocab_size)}
    if layout.position_table is not None:
        out[layout.position_table] = _fixed_table(run, layout.position_table, run.model.block_size)
    return out


class Subspace:
    """The run's basis and fixed embedding tables, and the maps between full vectors and coefficients.

    Args:
        run: a run with ``compression.subspace``; its seed, width and rank fix everything here.
        arch: the architecture's ``Layout`` key (default: the run's ``model.arch``).
        device: where the tensors live (the worker's device; the peer's wire side keeps a CPU one).
        tables: whether to hold the fixed tables F (vocab_size x n_embd: 262 MB for a 1 B Llama): the wire side
            needs them on every stage, a worker only on a stage whose embeddings it trains (``holds_tables``).
    """

    def __init__(self, run: RunConfig, *, arch: str | None = None, device: str | torch.device = "cpu",
                 tables: bool = True) -> None:
        arch = run.model.arch if arch is None else arch
        if not run.compression.subspace:
            raise ValueError('this run does not use "subspace" compression (compression.activations)')
        if arch not in LAYOUTS:
            raise ValueError(f"no subspace layout for architecture {arch!r}; known: {sorted(LAYOUTS)}")
        cfg, self.arch, self.layout = run.model, arch, LAYOUTS[arch]
        self.n_embd, self.rank, self.vocab_size = cfg.n_embd, run.compression.subspace_rank, cfg.vocab_size
        self.device = torch.device(device)
        self.u = basis(run.seed, cfg.n_embd, self.rank).to(self.device)  # [d, k]
        self.has_tables = tables
        self.tok_table = (_fixed_table(run, self.layout.token_table, cfg.vocab_size).to(self.device) if tables
                          else torch.empty(0, cfg.n_embd, device=self.device))  # [V, d]
        self.pos_table = (None if self.layout.position_table is None else
                          _fixed_table(run, self.layout.position_table, cfg.block_size).to(self.device) if tables
                          else torch.empty(0, cfg.n_embd, device=self.device))  # [block, d]

    # --- the boundary: full vectors <-> coefficients --------------------------------------------------------------
    def fixed(self, ids: torch.Tensor) -> torch.Tensor:
        """F_tok[ids] + F_pos[positions]: the part of the residual stream that never leaves the fixed tables."""
        self._need_tables()
        ids = ids.to(self.device, torch.long)  # [B, T]
        x = self.tok_table[ids]  # [B, T, d]
        if self.pos_table is not None:
            x = x + self.pos_table[: ids.shape[1]]
        return x

    def coefficients(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """c = U^T (x - F): x [B, T, d] and its token ids [B, T] -> [B, T, k] (fp32, on this object's device)."""
        return (x.to(self.device, torch.float32) - self.fixed(ids)) @ self.u

    def rebuild(self, c: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x = F + U c: coefficients [B, T, k] and token ids [B, T] -> the residual stream [B, T, d]."""
        return torch.addmm(self.fixed(ids).reshape(-1, self.n_embd), c.to(self.device, torch.float32).reshape(
            -1, self.rank), self.u.T).view(*c.shape[:-1], self.n_embd)

    def grad_coefficients(self, g: torch.Tensor) -> torch.Tensor:
        """U^T g: a boundary gradient [B, T, d] -> [B, T, k]."""
        return g.to(self.device, torch.float32) @ self.u

    def grad_rebuild(self, gc: torch.Tensor) -> torch.Tensor:
        """U gc: [B, T, k] -> the gradient [B, T, d] every trained weight upstream sees."""
        return gc.to(self.device, torch.float32) @ self.u.T

    # --- the weights ------------------------------------------------------------------------------------------------
    def _targets(self, module: nn.Module) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in module.named_parameters() if self.layout.constrains(n)]

    def _need_tables(self) -> None:
        if not self.has_tables:
            raise RuntimeError("this Subspace was built without the fixed tables (tables=False): it maps the weights "
                               "of a stage without embeddings, not boundary frames or embedding tables")

    def _table(self, name: str) -> torch.Tensor | None:
        if name not in (self.layout.token_table, self.layout.position_table):
            return None
        self._need_tables()
        return self.tok_table if name == self.layout.token_table else self.pos_table

    def to_coords(self, name: str, t: torch.Tensor, *, fixed: bool) -> torch.Tensor:
        """A constrained parameter (or its gradient, ``fixed=False``) as its coordinates in the subspace: a table's
        rows ``(T - F) U`` [rows, k], a writer's columns or bias ``U^T w`` [k, ...]."""
        u = self.u.to(t.device, t.dtype)
        table = self._table(name)
        if table is not None:
            return ((t - table[: t.shape[0]].to(t.device, t.dtype)) if fixed else t) @ u
        return u.T @ t

    def from_coords(self, name: str, c: torch.Tensor, *, fixed: bool) -> torch.Tensor:
        """The inverse of ``to_coords`` on the subspace: ``F + C U^T`` for a table, ``U c`` for a writer."""
        u = self.u.to(c.device, c.dtype)
        table = self._table(name)
        if table is not None:
            rows = c @ u.T
            return rows + table[: c.shape[0]].to(c.device, c.dtype) if fixed else rows
        return u @ c

    def _project(self, name: str, t: torch.Tensor, *, fixed: bool) -> torch.Tensor:
        """U U^T applied to a writer, F + ((T - F) U) U^T to a table (``fixed=False``: without F, for gradients)."""
        return self.from_coords(name, self.to_coords(name, t, fixed=fixed), fixed=fixed)

    @torch.no_grad()
    def project_(self, module: nn.Module) -> None:
        """Put the module's residual writers and embedding tables back into the subspace (in place)."""
        for name, p in self._targets(module):
            p.copy_(self._project(name, p, fixed=True))

    @torch.no_grad()
    def distance(self, module: nn.Module) -> float:
        """Largest |value| by which any constrained parameter leaves the subspace (0 up to rounding when kept)."""
        return max((float((p - self._project(n, p, fixed=True)).abs().max()) for n, p in self._targets(module)),
                   default=0.0)


class Coordinates:
    """What the optimiser steps on a constrained stage: each subspace-confined parameter as its k coordinates.

    Adam scales every coordinate by its own second moment, so a step taken on the full [n_embd, *] tensor and then
    projected is not Adam's step in the subspace: the step spreads the gradient's k directions over all n_embd
    coordinates before scaling them, and the projection throws away what falls outside. Stepping the coordinates
    (``to_coords``) instead gives every direction of the subspace its own moments, as an unconstrained model's
    weight gets one per coordinate (docs/performance.md measures what it changes). The moments are [k, *] instead
    of [n_embd, *], and a state's optimiser entry holds them so.

    The parameters stay the model's (full tensors, in the subspace): ``gather`` reads their coordinates and those of
    their gradients before a step (an averaging finish or a state load may have moved them), ``scatter`` writes the
    stepped coordinates back in place. ``params`` is the stage's parameter list with each constrained one replaced by
    its coordinates, in the same order, so an optimiser state's indices are the stage's.

    Args:
        subspace: the run's ``Subspace``.
        module: the stage module (its constrained parameters are found by name).
        params: the stage's parameters, in the optimiser's order.
    """

    def __init__(self, subspace: Subspace, module: nn.Module, params: Sequence[torch.Tensor]) -> None:
        index = {id(p): i for i, p in enumerate(params)}
        self.subspace = subspace
        self.slots: list[tuple[int, str, torch.Tensor, torch.Tensor]] = []  # (index, name, parameter, coordinates)
        for name, p in subspace._targets(module):
            c = subspace.to_coords(name, p.detach(), fixed=True).clone().requires_grad_(True)
            self.slots.append((index[id(p)], name, p, c))
        self.params = list(params)
        for i, _, _, c in self.slots:
            self.params[i] = c

    @torch.no_grad()
    def gather(self) -> None:
        """Before a step: the coordinates of the live weights and of their gradients (a projection of each)."""
        for _, name, p, c in self.slots:
            c.copy_(self.subspace.to_coords(name, p, fixed=True))
            c.grad = None if p.grad is None else self.subspace.to_coords(name, p.grad, fixed=False)

    @torch.no_grad()
    def scatter(self) -> None:
        """After a step: the weights rebuilt, in place, from their stepped coordinates (exactly in the subspace)."""
        for _, name, p, c in self.slots:
            p.copy_(self.subspace.from_coords(name, c, fixed=True))

    def zero_grad(self) -> None:
        for _, _, p, c in self.slots:
            p.grad = c.grad = None

    def legacy(self, state: dict[Any, Any]) -> bool:
        """Whether an optimiser state (``state_dict()["state"]``, checked) holds moments of a constrained parameter
        shaped like the parameter: written by a stage that stepped full tensors. Its second moments are not the
        coordinates' (no map turns one into the other), so such a state is loaded without its moments."""
        return any(isinstance(v, torch.Tensor) and v.dim() and v.shape == p.shape != c.shape
                   for i, _, p, c in self.slots if isinstance(state.get(i), dict) for v in state[i].values())

    def shapes(self) -> dict[int, tuple[torch.Size, ...]]:
        """Per constrained parameter's index: the shapes its optimiser state's tensors may have (coordinates, or
        the parameter's own in a state written before, which ``legacy`` finds)."""
        return {i: (c.shape, p.shape) for i, _, p, c in self.slots}
