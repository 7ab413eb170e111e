"""StageWorker: one replica of one pipeline stage, driven by the simulator or by the daemon.

It knows nothing of networks: it takes a micro-batch's input, returns the output, takes the output gradient, returns
the input gradient, steps its optimiser, and keeps its data-parallel averaging state (trainer/averaging.py).

**Backward recomputes the forward.** ``forward`` runs without autograd and keeps only the micro-batch's input (and,
with weight stashing, the weight version it used); ``backward`` recomputes the stage's forward with autograd from
that input and backpropagates. Keeping the autograd graph instead is not an option in an asynchronous pipeline: the
optimiser and the averaging modify the weights in place between a micro-batch's forward and its backward, which
invalidates the saved tensors, and holding graphs for every in-flight micro-batch costs far more memory than their
inputs. This is PipeDream's (and the AsyncPP code's) mandatory ``--recompute``; it costs one extra forward on every
stage but the last (``forward_loss`` does forward and backward at once). Dropout masks are reproduced by saving the
RNG state at the forward.

**Weight stashing** (``optim.weight_stashing``): the recompute runs at exactly the weights the forward used, then
the step applies to the latest weights (w_{t+1} = step(w_t, grad f(w_{t-tau}))). Anything that changes the live
weights in place -- an optimiser step, an averaging finish, a state load -- first calls ``_weights_will_change``:
while micro-batches forwarded at the current weights are still pending (refcounted per weight *epoch*, which every
such change advances), it copies those weights, and frees the copy when the last of them is backwarded or dropped.
In the daemon the averaging loop's ``averaging_finish`` runs on the compute thread between a micro-batch's forward and
its backward, so the averaged weights must not leak into that backward. ``version`` stays the optimiser step count
(the delay a backward reports is counted in steps); the epoch only names the weights. Without stashing, backward
uses the latest weights.

**Flat parameters.** In a run that averages, the stage's parameters are views into one flat buffer that the
averaging state owns (trainer/flat.py), so a round gathers and writes back its slice of every tensor in one operator
each, and a weight stash is one copy. The optimiser, the model and ``load_state_dict`` work on the views in place;
anything that rebinds a parameter's ``.data`` is undone at the next round (the parameters are moved back).

**Subspace runs** (``compression.activations = "subspace"``, trainer/subspace.py): the worker keeps its residual
writers and embeddings in the run's subspace: projected at construction and after every averaging finish and state
load, and stepped as their coordinates in the subspace (``Coordinates``: the optimiser's moments are per direction
of the subspace), so a step leaves them in it. Its inputs and outputs stay full vectors; the
peer's wire side turns them into coefficients and back with ``subspace``. The last stage's residual stream never
crosses a boundary, so its weights are not constrained (it receives a residual stream in the subspace and may write
anywhere after that).

**Mixed precision** (``precision="bf16"``): forwards and recomputes run under ``torch.autocast`` with bfloat16; the
weights, their gradients and the optimiser state stay fp32 (the master copy), so a step, the averaging and a state
sync see exactly what an fp32 worker has. What leaves the worker (a stage's output, an input gradient, logits) is
fp32, so peers of both precisions can serve one swarm.

**Not thread-safe.** The daemon calls one worker from one dedicated compute thread; the simulator from its loop.
"""

from __future__ import annotations

import copy
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch
from torch.func import functional_call

from trainer.averaging import Placed, SparseAveragingState, place
from trainer.config import OptimConfig, RunConfig
from trainer.model import build_stage
from trainer.optim import build_optimizer, clip_grad_norm, lr_at, moments_refused, set_lr
from trainer.rules import rule_of
from trainer.subspace import Coordinates, Subspace, constrained, holds_tables

logger = logging.getLogger(__name__)

STATE_FORMAT = 1
_Head = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]  # output -> (backprop target, its gradient)


class LossRefused(Exception):
    """The last stage would not train on a micro-batch: its loss is above the bound it was given."""

    def __init__(self, loss: float, max_loss: float) -> None:
        super().__init__(f"loss {loss:.3f} is above {max_loss:.3f}: not trained on")
        self.loss, self.max_loss = loss, max_loss


def resolve_device(name: str) -> str:
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'; 'cuda' without a GPU raises ValueError with advice."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but torch sees no CUDA GPU; install a CUDA build of torch "
                         "or use the CPU ('cpu')")
    return name


PRECISIONS = ("auto", "fp32", "bf16")


def resolve_precision(name: str, device: str | torch.device) -> str:
    """'auto' -> 'bf16' on a CUDA device (autocast, fp32 master weights), 'fp32' elsewhere; 'fp32'/'bf16' as given."""
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {name!r}")
    if name == "auto":
        return "bf16" if torch.device(device).type == "cuda" else "fp32"
    return name


def is_gpu(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda"


def use_tf32_on_gpu(device: str | torch.device) -> None:
    """The simulator's choice on a GPU: float32 matrix products in TF32 (no effect on the CPU)."""
    if is_gpu(device):
        torch.set_float32_matmul_precision("high")


@dataclass
class _Pending:
    x: torch.Tensor  # stage input: tokens [B, T] or activations [B, T, C]
    version: int  # local_step when the forward ran
    epoch: int  # weight epoch the forward ran at (advanced by every in-place change of the weights)
    rng: tuple[torch.Tensor, torch.Tensor | None] | None  # (cpu, cuda) RNG states for dropout, None if no dropout


class StageWorker:
    """One replica of pipeline stage ``stage`` of ``run``.

    Args:
        run: the run config every peer shares.
        stage: the pipeline stage, 0 <= stage < run.n_stages.
        device: torch device for weights and compute ('cpu', 'cuda', 'cuda:1', ...).
        seed: init seed override (default run.seed; replicas of a swarm must share it). Partitions always use
            run.seed so every replica agrees on them.
        replica: this replica's index (simulator) — informational, used in log messages.
        auto_step: True (asynchronous drivers): every backward/forward_loss adds its gradient and, after
            ``optim.accumulate`` of them, the worker steps. False (synchronous drivers): call ``optimizer_step``.
        precision: 'fp32', 'bf16' (autocast, fp32 master weights) or 'auto' (bf16 on CUDA, fp32 elsewhere).
        optim: the optimiser and schedule when they differ from the run's (the synchronous baseline's, see
            trainer.sim.methods.fullsync_optim); the run's id, model and averaging are unchanged.
    """

    def __init__(self, run: RunConfig, stage: int, *, device: str | torch.device = "cpu", seed: int | None = None,
                 replica: int = 0, auto_step: bool = True, precision: str = "fp32",
                 optim: OptimConfig | None = None) -> None:
        if not 0 <= stage < run.n_stages:
            raise ValueError(f"stage must be in [0, {run.n_stages}), got {stage}")
        self.run, self.stage, self.n_stages = run, stage, run.n_stages
        self.is_first, self.is_last = stage == 0, stage == run.n_stages - 1
        self.device = torch.device(device)
        self.replica, self.auto_step = replica, auto_step
        self.precision = resolve_precision(precision, self.device)
        self.model = build_stage(run, stage, seed).to(self.device)
        self.model.train()
        self.subspace = (Subspace(run, device=self.device, tables=holds_tables(run, stage))
                         if run.compression.subspace else None)
        self._keep_in_subspace()
        self._names = [n for n, _ in self.model.named_parameters()]
        self._params: list[torch.Tensor] = list(self.model.parameters())
        self.optim = optim if optim is not None else run.optim
        self._coords = (Coordinates(self.subspace, self.model, self._params)
                        if self.constrained and self.subspace is not None else None)
        self._stepped = self._params if self._coords is None else self._coords.params  # what the optimiser steps
        self.optimizer = build_optimizer(self._stepped, self.optim, stage, run.n_stages)
        self.local_step = 0
        self.accumulated = 0  # gradient contributions summed into .grad since the last step
        self.steps_skipped = 0  # steps refused because the gradient norm was not finite
        self.rewarm_from: int | None = None  # the local step a load without optimiser moments started a re-warm-up at
        self.last_delay = 0  # steps applied between the last backwarded micro-batch's forward and its backward
        self.last_grad_norm: float | None = None
        self._pending: dict[int, _Pending] = {}
        self._epoch = 0  # advanced by every in-place change of the live weights (step, averaging, load)
        self._stash: dict[int, list[torch.Tensor]] = {}  # epoch -> weight copies of a superseded epoch
        self._refs: Counter[int] = Counter()  # epoch -> pending micro-batches forwarded at it
        self.averaging = (SparseAveragingState(run.averaging, self.optim.total_steps, run.seed, stage, self._params)
                          if rule_of(run.averaging).averages else None)

    # --- properties -------------------------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """Weight version: the number of optimiser steps applied (== local_step)."""
        return self.local_step

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def pending(self) -> int:
        """Micro-batches forwarded and awaiting their backward."""
        return len(self._pending)

    def stashed_versions(self) -> list[int]:
        """Weight epochs currently held as copies (for metrics and tests); without averaging or loads an epoch is
        the version (optimiser steps), each in-place averaging or load adds one."""
        return sorted(self._stash)

    def _weights_will_change(self) -> None:
        """Called before any in-place change of the live weights: keep a copy for the pending micro-batches
        forwarded at the current ones (with stashing), and start a new epoch."""
        if self.optim.weight_stashing and self._refs.get(self._epoch, 0) > 0 and self._epoch not in self._stash:
            self._stash[self._epoch] = (self.averaging.copy_params(self._params) if self.averaging is not None
                                        else [p.detach().clone() for p in self._params])
        self._epoch += 1

    @property
    def constrained(self) -> bool:
        """Whether this stage keeps its weights in the subspace (``trainer.subspace.constrained``)."""
        return self.subspace is not None and constrained(self.run, self.stage)

    def _keep_in_subspace(self) -> None:
        if self.constrained and self.subspace is not None:
            self.subspace.project_(self.model)

    def _amp(self) -> torch.autocast:
        """bf16 autocast on this worker's device when its precision is 'bf16' (a no-op context otherwise)."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16")

    # --- input checks (programming-error guards; the daemon validated wire tensors already) ------------------------
    def _check_input(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.run.model
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"stage {self.stage} input must be a torch.Tensor, got {type(x).__name__}")
        if self.is_first:
            if x.dim() != 2 or x.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
                raise ValueError(f"stage 0 takes integer token ids [B, T], got {x.dtype} {tuple(x.shape)}")
            if x.numel() and (int(x.min()) < 0 or int(x.max()) >= cfg.vocab_size):  # CUDA would assert, not raise
                raise ValueError(f"token ids must be in [0, {cfg.vocab_size}), got [{int(x.min())}, {int(x.max())}]")
            x = x.to(self.device, torch.long)
        else:
            if x.dim() != 3 or x.shape[-1] != cfg.n_embd or not x.is_floating_point():
                raise ValueError(f"stage {self.stage} takes float activations [B, T, {cfg.n_embd}], "
                                 f"got {x.dtype} {tuple(x.shape)}")
            x = x.to(self.device, self._params[0].dtype)
        if x.shape[0] < 1 or not 1 <= x.shape[1] <= cfg.block_size:
            raise ValueError(f"batch must be non-empty and 1 <= T <= block_size ({cfg.block_size}), "
                             f"got shape {tuple(x.shape)}")
        return x

    def _check_targets(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if targets.shape != x.shape[:2] or targets.is_floating_point():
            raise ValueError(f"targets must be integer ids of shape {tuple(x.shape[:2])}, "
                             f"got {targets.dtype} {tuple(targets.shape)}")
        targets = targets.to(self.device, torch.long)
        if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= self.run.model.vocab_size):
            raise ValueError(f"targets must be in [0, {self.run.model.vocab_size})")
        return targets

    # --- pipeline ---------------------------------------------------------------------------------------------------
    def _save_rng(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        if self.run.model.dropout == 0.0:
            return None
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    def forward(self, mb_id: int, x: torch.Tensor) -> torch.Tensor:
        """Forward a micro-batch through this (non-last) stage; keeps its input until backward or drop."""
        if self.is_last:
            raise ValueError(f"stage {self.stage} is the last stage: call forward_loss with the targets")
        if mb_id in self._pending:
            raise ValueError(f"micro-batch {mb_id} is already pending on stage {self.stage}; ids must be unique")
        x = self._check_input(x)
        rng = self._save_rng()
        with torch.no_grad(), self._amp():
            y: torch.Tensor = self.model(x)  # [B, T, C]
        self._pending[mb_id] = _Pending(x, self.version, self._epoch, rng)
        self._refs[self._epoch] += 1
        return y.float()

    def backward(self, mb_id: int, grad_y: torch.Tensor) -> torch.Tensor | None:
        """Backward a pending micro-batch; returns the gradient wrt its input (None on stage 0)."""
        if self.is_last:
            raise ValueError(f"stage {self.stage} is the last stage: forward_loss already ran its backward")
        pend = self._pending.get(mb_id)
        if pend is None:
            raise ValueError(f"micro-batch {mb_id} is not pending on stage {self.stage} (dropped or never forwarded)")
        B, T = pend.x.shape[:2]
        expected = (B, T, self.run.model.n_embd)
        if tuple(grad_y.shape) != expected or not grad_y.is_floating_point():
            raise ValueError(f"gradient for micro-batch {mb_id} must be float {expected}, "
                             f"got {grad_y.dtype} {tuple(grad_y.shape)}")
        del self._pending[mb_id]
        self.last_delay = max(0, self.local_step - pend.version)  # a state load may set local_step back
        try:
            weights = self._stash.get(pend.epoch) if self.optim.weight_stashing else None
            x = pend.x if self.is_first else pend.x.detach().requires_grad_(True)
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else [],
                                       enabled=pend.rng is not None):
                if pend.rng is not None:
                    torch.set_rng_state(pend.rng[0])
                    if pend.rng[1] is not None:
                        torch.cuda.set_rng_state(pend.rng[1], self.device)
                grad_x = self._backprop(x, weights, lambda out: (out, grad_y.to(out.device, out.dtype)))
        finally:
            self._release(pend.epoch)
        self._contributed()
        return grad_x

    def forward_loss(self, mb_id: int, x: torch.Tensor, targets: torch.Tensor, *,
                     max_loss: float | None = None) -> tuple[float, torch.Tensor | None]:
        """Last stage: forward, loss, backward at once; returns (loss, grad wrt input or None if also stage 0).

        ``max_loss``: refuse to train on a micro-batch whose loss is higher (raises ``LossRefused`` before any
        backward: gradients, weights and the step count are untouched).
        """
        if not self.is_last:
            raise ValueError(f"stage {self.stage} is not the last stage: call forward, then backward")
        x = self._check_input(x)
        targets = self._check_targets(x, targets)
        if not self.is_first:
            x = x.detach().requires_grad_(True)
        box: list[float] = []

        def loss_fn(logits: torch.Tensor) -> tuple[torch.Tensor, None]:
            loss = self.model.loss(logits, targets)
            box.append(float(loss.detach()))
            if max_loss is not None and not box[0] <= max_loss:
                raise LossRefused(box[0], max_loss)
            return loss, None

        grad_x = self._backprop(x, None, loss_fn)
        self._contributed()
        return box[0], grad_x

    def _backprop(self, x: torch.Tensor, weights: list[torch.Tensor] | None, head: _Head) -> torch.Tensor | None:
        """Forward with autograd (at ``weights`` or the live ones), backprop, add into .grad; returns grad wrt x."""
        with self._amp():  # the forward only: autograd runs the backward in each op's forward dtype
            if weights is None:
                params = self._params
                out = self.model(x)
            else:
                params = [w.detach().requires_grad_(True) for w in weights]
                out = functional_call(self.model, dict(zip(self._names, params, strict=True)), (x,))
            target, grad_out = head(out)
        inputs = params + ([] if self.is_first else [x])
        grads = torch.autograd.grad(target, inputs, grad_out, allow_unused=True)
        for p, g in zip(self._params, grads[: len(params)], strict=True):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g.detach().clone()
            else:
                p.grad.add_(g)
        return None if self.is_first else grads[-1]

    def drop(self, mb_id: int) -> None:
        """Forget a pending micro-batch (timeout, broken route); unknown ids are ignored."""
        pend = self._pending.pop(mb_id, None)
        if pend is not None:
            self._release(pend.epoch)

    def _release(self, epoch: int) -> None:
        self._refs[epoch] -= 1
        if self._refs[epoch] <= 0:
            del self._refs[epoch]
            self._stash.pop(epoch, None)

    def _contributed(self) -> None:
        self.accumulated += 1
        if self.auto_step and self.accumulated >= self.optim.accumulate:
            self.optimizer_step()

    @overload
    def evaluate(self, x: torch.Tensor, targets: None = None, *, last_only: bool = False) -> torch.Tensor: ...
    @overload
    def evaluate(self, x: torch.Tensor, targets: torch.Tensor, *, last_only: bool = False) -> torch.Tensor | float: ...

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, targets: torch.Tensor | None = None, *,
                 last_only: bool = False) -> torch.Tensor | float:
        """No-grad forward at the latest weights: the output, or the mean loss on the last stage given targets;
        ``last_only`` (generation): on the last stage only the last position's logits, [B, vocab]. Touches no
        optimiser, stash or pending state."""
        x = self._check_input(x)
        self.model.eval()
        try:
            with self._amp():
                if last_only and self.is_last:
                    logits: torch.Tensor = self.model(x, last_only=True)
                    return logits[:, -1].float()
                out: torch.Tensor = self.model(x).float()
        finally:
            self.model.train()
        if self.is_last and targets is not None:
            return float(self.model.loss(out, self._check_targets(x, targets)))
        return out

    # --- optimiser --------------------------------------------------------------------------------------------------
    def optimizer_step(self) -> None:
        """Clip this stage's summed gradient, set the scheduled lr, step, version += 1.

        A non-finite gradient norm skips the step (counted in ``steps_skipped``) so the weights stay intact.
        """
        if self._coords is not None:
            self._coords.gather()  # the gradients' coordinates: what a boundary's U^T g would have given
        norm = clip_grad_norm(self._stepped, self.optim.grad_clip)
        self.last_grad_norm = norm
        if not torch.isfinite(torch.tensor(norm)):
            self.steps_skipped += 1
            logger.warning("stage %d replica %d: non-finite gradient norm, step skipped", self.stage, self.replica)
        else:
            self._weights_will_change()
            set_lr(self.optimizer, self.lr_now())
            self.optimizer.step()
            if self._coords is not None:
                self._coords.scatter()
            self.local_step += 1
        self._zero_grads()
        self.accumulated = 0

    def _zero_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self._coords is not None:
            self._coords.zero_grad()

    def lr_now(self) -> float:
        """The learning rate of the next step: the schedule's at ``local_step``, ramped up again over the run's
        warm-up steps after a load without optimiser moments (``rewarm_from``). Fresh Adam moments make every
        coordinate's first updates a full ``lr`` (m / sqrt(v) is +-1), where a trained replica's are a fraction of
        it: a replica that loaded a witnessed state (whose moments are dropped) would otherwise move away from the
        replicas it loaded from within a few dozen steps (docs/security.md, "Witnesses vote")."""
        lr = lr_at(self.optim, self.local_step)
        if self.rewarm_from is not None:
            done = self.local_step - self.rewarm_from
            if 0 <= done < self.optim.warmup_steps:
                return lr * (done + 1) / (self.optim.warmup_steps + 1)
            self.rewarm_from = None
        return lr

    def grads(self) -> list[torch.Tensor]:
        """Copies of the summed gradients (zeros where none has arrived), in parameters() order."""
        return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in self._params]

    def mean_grads(self) -> list[torch.Tensor]:
        """The summed gradients divided by the contributions summed into them (a synchronous flush's mean over its
        micro-batches, what the simulator's fullsync steps with, so clipping sees the same norm)."""
        return [g / max(1, self.accumulated) for g in self.grads()]

    def set_grads(self, grads: Sequence[torch.Tensor]) -> None:
        """Replace the summed gradients (e.g. by the mean over replicas of a synchronous step)."""
        if len(grads) != len(self._params):
            raise ValueError(f"set_grads got {len(grads)} tensors, stage {self.stage} has {len(self._params)}")
        for j, (p, g) in enumerate(zip(self._params, grads, strict=True)):
            if g.shape != p.shape:
                raise ValueError(f"gradient {j} ({self._names[j]}) has shape {tuple(g.shape)}, "
                                 f"expected {tuple(p.shape)}")
        for p, g in zip(self._params, grads, strict=True):
            p.grad = g.detach().to(p.device, p.dtype).clone()

    # --- data-parallel averaging ------------------------------------------------------------------------------------
    def _avg(self) -> SparseAveragingState:
        if self.averaging is None:
            raise ValueError("averaging.rule is 'none': this run does not average replicas")
        return self.averaging

    def averaging_prepare(self, round_no: int) -> None:
        """Draw round ``round_no``'s partition ahead; safe on any thread (it reads no weight), so the daemon does it
        off the compute thread and ``averaging_begin`` only gathers."""
        self._avg().prepare(round_no, self.device)

    def averaging_place(self, mean: list[torch.Tensor]) -> Placed:
        """A round's aggregate (decoded on the host) checked finite and moved onto this stage's device; safe on any
        thread (it reads no weight), so the daemon does it off the compute thread and ``averaging_finish`` pays
        neither the check nor the transfer. Raises AveragingError for NaN or Inf."""
        return place(mean, self.device)

    def averaging_begin(self, round_no: int) -> list[torch.Tensor]:
        """Values of round ``round_no``'s partition (one flat tensor per parameter); snapshots them for the drift."""
        return self._avg().begin(round_no, self._params)

    def averaging_finish(self, round_no: int, mean: list[torch.Tensor] | Placed, *, bounded: bool = False) -> None:
        """Apply the run's rule with the drift since begin; raises AveragingError (weights untouched) on bad input.

        Pending micro-batches keep the weights their forward used (stashed first when stashing is on). ``bounded``:
        the aggregate's pull was clipped, so the round moves the weights by that pull only (trainer/rules.py)."""
        avg = self._avg()
        self._weights_will_change()  # a rejected mean leaves an identical copy behind, freed with its micro-batches
        avg.finish(round_no, mean, self._params, self.local_step, bounded=bounded)
        self._keep_in_subspace()  # robust aggregation and quantised parts are not linear: back into the subspace

    def averaging_abort(self, round_no: int) -> None:
        """The round failed: forget its snapshot; weights untouched."""
        self._avg().abort(round_no)

    # --- state ------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Weights, optimiser state, averaging EMA state and counters (copies; pending micro-batches excluded)."""
        return {
            "format": STATE_FORMAT,
            "run_id": self.run.run_id,
            "stage": self.stage,
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "averaging": None if self.averaging is None else self.averaging.state_dict(),
            "local_step": self.local_step,
            "accumulated": self.accumulated,
            "grads": self.grads() if self.accumulated else None,
            "steps_skipped": self.steps_skipped,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore a state_dict of the same run and stage; pending micro-batches stay pending, and with stashing
        their backward runs at the weights their forward used (stashed here), then adds into the loaded state.

        The state may come from a stranger (state sync), so everything is checked before anything is touched: keys,
        shapes, dtypes, finite values, counters. The optimiser's hyper-parameters are this run's own; only its
        per-parameter state is taken from ``d``. Raises ValueError/TypeError and leaves the worker as it was.
        """
        self._check_state(d)
        self._weights_will_change()
        self.model.load_state_dict(d["model"])
        own_groups = self.optimizer.state_dict()["param_groups"]
        state = copy.deepcopy(d["optimizer"]["state"])
        if self._coords is not None and self._coords.legacy(state):
            logger.warning("stage %d: the state's optimiser moments were written by a version that stepped the "
                           "subspace's weights as full tensors; loading it without them (the learning rate warms up "
                           "again)", self.stage)
            state = {}
        self.optimizer.load_state_dict({"state": state, "param_groups": own_groups})
        if self.averaging is not None and d["averaging"] is not None:
            self.averaging.load_state_dict(d["averaging"])
        self.local_step, self.accumulated = int(d["local_step"]), int(d["accumulated"])
        self.steps_skipped = int(d["steps_skipped"])
        # a state without moments (a witnessed one from another peer: peer.state.witness.sanitize) warms up again
        fresh = not state and self.local_step > 0
        self.rewarm_from = self.local_step if fresh else None
        self._keep_in_subspace()  # a donor's weights are a stranger's: the invariant is ours to keep
        if d["grads"] is not None:
            self.set_grads(d["grads"])
        else:
            self._zero_grads()

    def _check_state(self, d: dict[str, Any]) -> None:
        if not isinstance(d, dict):
            raise TypeError(f"state must be a dict from StageWorker.state_dict(), got {type(d).__name__}")
        missing = {"format", "run_id", "stage", "model", "optimizer", "averaging", "local_step", "accumulated",
                   "grads", "steps_skipped"} - set(d)
        if missing:
            raise ValueError(f"state lacks {sorted(missing)}; it was not written by StageWorker.state_dict()")
        if d["format"] != STATE_FORMAT:
            raise ValueError(f"state format {d['format']!r} is not {STATE_FORMAT}; written by another version")
        if d["run_id"] != self.run.run_id or d["stage"] != self.stage:
            raise ValueError(f"state is for run {d['run_id']} stage {d['stage']}, "
                             f"this worker is run {self.run.run_id} stage {self.stage}")
        own = self.model.state_dict()
        model = d["model"]
        if not isinstance(model, dict) or set(model) != set(own):
            raise ValueError("state's model tensors do not match this stage's parameters")
        for k, ref in own.items():
            _check_tensor(f"model[{k}]", model[k], ref.shape)
        opt = d["optimizer"]
        if not isinstance(opt, dict) or not isinstance(opt.get("state"), dict):
            raise ValueError("state's optimizer entry must be a torch optimizer state_dict")
        coords = {} if self._coords is None else self._coords.shapes()
        beta1, beta2 = self.optimizer.param_groups[0]["betas"]
        for idx, entry in opt["state"].items():
            if not isinstance(idx, int) or not 0 <= idx < len(self._params) or not isinstance(entry, dict):
                raise ValueError(f"state's optimizer holds an entry for unknown parameter {idx!r}")
            for name, value in entry.items():
                if isinstance(value, torch.Tensor):
                    shape = self._params[idx].shape if value.dim() else torch.Size([])
                    if value.dim() and value.shape in coords.get(idx, ()):
                        shape = value.shape  # a constrained parameter's moments: its coordinates' (or its own)
                    _check_tensor(f"optimizer[{idx}][{name}]", value, shape)
            if (why := moments_refused(entry, float(beta1), float(beta2))) is not None:
                raise ValueError(f"state's optimizer[{idx}] {why}; refusing to load it")
        for name in ("local_step", "accumulated", "steps_skipped"):
            if not isinstance(d[name], int) or isinstance(d[name], bool) or d[name] < 0:
                raise ValueError(f"state's {name} must be a non-negative int, got {d[name]!r}")
        if d["accumulated"] >= self.optim.accumulate and self.auto_step:
            raise ValueError(f"state's accumulated ({d['accumulated']}) must be < optim.accumulate")
        if d["grads"] is not None:
            if not isinstance(d["grads"], list) or len(d["grads"]) != len(self._params):
                raise ValueError("state's grads do not match this stage's parameters")
            for j, (g, p) in enumerate(zip(d["grads"], self._params, strict=True)):
                _check_tensor(f"grads[{j}]", g, p.shape)
        if self.averaging is not None and d["averaging"] is not None:
            ema = d["averaging"].get("ema") if isinstance(d["averaging"], dict) else None
            if not isinstance(ema, list) or len(ema) != len(self.averaging.ema):
                raise ValueError("state's averaging EMA does not match this run's averaging rule and stage")
            for j, (e, ref) in enumerate(zip(ema, self.averaging.ema, strict=True)):
                _check_tensor(f"averaging.ema[{j}]", e, ref.shape)


def _check_tensor(name: str, t: object, shape: torch.Size) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"state's {name} must be a tensor, got {type(t).__name__}")
    if t.shape != shape:
        raise ValueError(f"state's {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if t.is_floating_point() and not torch.isfinite(t).all():
        raise ValueError(f"state's {name} holds NaN or Inf; refusing to load it")
