"""What crosses a stage boundary for this run: activations and their gradients in the run's codec, or, in subspace
runs, their k coefficients in the run's subspace (trainer/subspace.py) plus the micro-batch's token ids.

``Boundary`` is the servicer's one seam for it, so the servicer never asks which kind of run it serves. Decoding
validates every received frame before anything reaches the model: a coefficient frame has the shape
``[batch, block, rank]`` the run fixes and bounded values, the ids frame ``[batch, block]`` in the smallest integer
dtype that holds the vocabulary and ids inside it, and the rebuilt activations pass the same bounds full activations
do. The methods are synchronous CPU work; the servicer runs them in an executor.
"""

from __future__ import annotations

import math

import torch

from protocol.codecs.registry import decode, encode
from protocol.envelope import TensorEnvelope
from protocol.errors import ValidationError
from protocol.messages import Forward
from protocol.validation import TensorSpec, check_values
from trainer.config import RunConfig
from trainer.subspace import Subspace

MAX_ACT_ABS = 1e6


def ids_dtype(vocab_size: int) -> torch.dtype:
    """The smallest wire dtype that holds every token id of a vocabulary."""
    if vocab_size <= 256:
        return torch.uint8
    return torch.int16 if vocab_size <= 2**15 else torch.int32


class Boundary:
    """Encodes this stage's outputs and input gradients, decodes (and validates) what arrives from neighbours.

    Args:
        run: the run; its compression section picks the plain codecs or the subspace pair.
        subspace: the run's ``Subspace`` (any device; a CPU copy is kept for the wire), None in plain runs.
    """

    def __init__(self, run: RunConfig, subspace: Subspace | None) -> None:
        self.run = run
        b, t, d = run.data.batch_size, run.model.block_size, run.model.n_embd
        self.act_spec = TensorSpec((b, t, d), torch.float32, max_abs=MAX_ACT_ABS)
        self.subspace = None
        if run.compression.subspace:
            self.subspace = subspace if subspace is not None and subspace.device.type == "cpu" else Subspace(run)
            k = run.compression.subspace_rank
            # |c_i| <= |x - F|_2 <= sqrt(d) * (MAX_ACT_ABS + max |F|): a coefficient beyond it cannot rebuild into
            # activations the act_spec accepts
            self.coef_spec = TensorSpec((b, t, k), torch.float32, max_abs=math.sqrt(d) * 2 * MAX_ACT_ABS)
            self.grad_spec = TensorSpec((b, t, k), torch.float32)
            self.ids_spec = TensorSpec((b, t), ids_dtype(run.model.vocab_size))

    @property
    def targets_dtype(self) -> torch.dtype:
        """The targets' wire dtype: int64 in plain runs (as ever), the ids' compact dtype in subspace runs, where
        8 bytes per token would be a quarter of what a forward carries."""
        return self.ids_spec.dtype if self.subspace is not None else torch.int64

    @property
    def coefficient_codec(self) -> str:
        return self.run.compression.subspace_codec

    # --- forward ----------------------------------------------------------------------------------------------------
    def encode_forward(self, y: torch.Tensor,
                       ids: torch.Tensor | None) -> tuple[TensorEnvelope, TensorEnvelope | None]:
        """(activations envelope, token-ids envelope or None) for an output [B, T, d] of the micro-batch ``ids``."""
        if self.subspace is None:
            return encode(y, self.run.compression.activations), None
        if ids is None:
            raise ValueError("a subspace run sends the token ids with every forward; this micro-batch has none")
        c = self.subspace.coefficients(y.detach().cpu(), ids.cpu())
        return encode(c, self.coefficient_codec), encode(ids.to(self.ids_spec.dtype), "none")

    def decode_forward(self, msg: Forward, peer: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(activations [B, T, d] fp32, token ids [B, T] int64 or None); ValidationError names what was wrong."""
        if self.subspace is None:
            return decode(msg.activations, self.act_spec, peer=peer, field="activations"), None
        if msg.tokens is None:
            raise ValidationError("tokens", peer, "a subspace run's forward must carry the token ids")
        ids = decode(msg.tokens, self.ids_spec, peer=peer, field="tokens").long()
        if int(ids.max()) >= self.run.model.vocab_size:
            raise ValidationError("tokens", peer, f"token ids must be below the vocabulary size "
                                  f"({self.run.model.vocab_size})")
        c = decode(msg.activations, self.coef_spec, peer=peer, field="activations")
        x = self.subspace.rebuild(c, ids)
        return check_values(x, self.act_spec, peer=peer, field="activations"), ids

    # --- backward ---------------------------------------------------------------------------------------------------
    def encode_gradient(self, g: torch.Tensor) -> TensorEnvelope:
        if self.subspace is None:
            return encode(g, self.run.compression.gradients)
        return encode(self.subspace.grad_coefficients(g.detach().cpu()), self.coefficient_codec)

    def decode_gradient(self, env: TensorEnvelope, peer: str) -> torch.Tensor:
        """The gradient [B, T, d] fp32 w.r.t. this stage's output (U gc in subspace runs)."""
        if self.subspace is None:
            return decode(env, self.act_spec, peer=peer, field="gradient")
        gc = decode(env, self.grad_spec, peer=peer, field="gradient")
        return check_values(self.subspace.grad_rebuild(gc), self.act_spec, peer=peer, field="gradient")
