"""What crosses a stage boundary for this run: activations and their gradients in the run's codec, or, in subspace
runs, their k coefficients in the run's subspace (trainer/subspace.py) plus the micro-batch's token window.

``Boundary`` is the servicer's one seam for it, so the servicer never asks which kind of run it serves. A subspace
forward's ``tokens`` is the window of ``block + 1`` ids each row was cut from: its first ``block`` are the inputs the
receiver rebuilds the residual stream from, its last ``block`` the targets the last stage needs, so no forward of a
subspace run carries ``targets`` (the same ids again). Decoding validates every received frame before anything
reaches the model: a coefficient frame has the shape ``[batch, block, rank]`` the run fixes and bounded values, the
window ``[batch, block + 1]`` in the smallest integer dtype that holds the vocabulary and ids inside it, and the
rebuilt activations pass the same bounds full activations do. A plain run's forward carries its ``targets`` and,
since they came to 1-2 bytes a token next to a hundred or more of activations, the same window: the last stage of a
2-stage run re-computes a sample of stage 0's forwards from the input ids (peer.pipeline.fwdcheck), and checks
that the targets are the window's. The methods are synchronous CPU work; the servicer runs them in an executor.
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
        subspace: the run's ``Subspace`` (any device; the wire keeps a CPU one with the fixed tables: this one when it
            is that), None in plain runs.
    """

    def __init__(self, run: RunConfig, subspace: Subspace | None) -> None:
        self.run = run
        b, t, d = run.data.batch_size, run.model.block_size, run.model.n_embd
        self.act_spec = TensorSpec((b, t, d), torch.float32, max_abs=MAX_ACT_ABS)
        self.ids_spec = TensorSpec((b, t + 1), ids_dtype(run.model.vocab_size))
        self.subspace = None
        if run.compression.subspace:
            reuse = subspace is not None and subspace.device.type == "cpu" and subspace.has_tables
            self.subspace = subspace if reuse and subspace is not None else Subspace(run)
            k = run.compression.subspace_rank
            # |c_i| <= |x - F|_2 <= sqrt(d) * (MAX_ACT_ABS + max |F|): a coefficient beyond it cannot rebuild into
            # activations the act_spec accepts
            self.coef_spec = TensorSpec((b, t, k), torch.float32, max_abs=math.sqrt(d) * 2 * MAX_ACT_ABS)
            self.grad_spec = TensorSpec((b, t, k), torch.float32)

    @property
    def coefficient_codec(self) -> str:
        return self.run.compression.subspace_codec

    # --- forward ----------------------------------------------------------------------------------------------------
    def first_hop(self, x: torch.Tensor, y: torch.Tensor) -> tuple[TensorEnvelope | None, torch.Tensor | None]:
        """What stage 0 sends with a micro-batch's activations, from its inputs x and targets y [B, T]:
        (the targets envelope, the window for ``encode_forward``). Plain runs: int64 targets, and the window
        ``[x | y[:, -1]]`` [B, T+1] when y is x shifted by one (data.BatchStream's always are); subspace runs: no
        targets, the window, which they must have."""
        shifted = torch.equal(x[:, 1:], y[:, :-1])
        if self.subspace is None:
            return encode(y.to(torch.int64), "none"), torch.cat([x, y[:, -1:]], dim=1) if shifted else None
        if not shifted:
            raise ValueError("a subspace run's targets must be its inputs shifted by one position (the window the "
                             "last stage rebuilds them from); this micro-batch's are not")
        return None, torch.cat([x, y[:, -1:]], dim=1)

    def encode_forward(self, y: torch.Tensor,
                       window: torch.Tensor | None) -> tuple[TensorEnvelope, TensorEnvelope | None]:
        """(activations envelope, window envelope or None) for an output [B, T, d] of the micro-batch whose token
        window [B, T+1] is ``window`` (None: a plain run's forward without one)."""
        if self.subspace is None:
            ids = None if window is None else encode(window.cpu().to(self.ids_spec.dtype), "none")
            return encode(y, self.run.compression.activations), ids
        if window is None:
            raise ValueError("a subspace run sends the token window with every forward; this micro-batch has none")
        c = self.subspace.coefficients(y.detach().cpu(), window[:, :-1].cpu())
        return encode(c, self.coefficient_codec), encode(window.cpu().to(self.ids_spec.dtype), "none")

    def decode_forward(self, msg: Forward, peer: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(activations [B, T, d] fp32, token window [B, T+1] int64 or None); ValidationError names what was
        wrong."""
        x, window, _ = self.decode_forward_sent(msg, peer)
        return x, window

    def decode_forward_sent(self, msg: Forward, peer: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``decode_forward`` and what the sender chose of the activations (``sent``: in a subspace run the
        coefficients as decoded, not computed again from the rebuilt activations)."""
        if self.subspace is None:
            x = decode(msg.activations, self.act_spec, peer=peer, field="activations")
            return x, None if msg.tokens is None else self._window(msg, peer), x
        if msg.tokens is None:
            raise ValidationError("tokens", peer, "a subspace run's forward must carry the token window")
        if msg.targets is not None:
            raise ValidationError("targets", peer, "a subspace run's forward carries its targets in `tokens`, "
                                  "not in `targets`")
        window = self._window(msg, peer)
        c = decode(msg.activations, self.coef_spec, peer=peer, field="activations")
        x = self.subspace.rebuild(c, window[:, :-1])
        return check_values(x, self.act_spec, peer=peer, field="activations"), window, c

    def sent(self, x: torch.Tensor, window: torch.Tensor | None) -> torch.Tensor:
        """What the sender chose of activations ``x`` [B, T, d] (rows of the micro-batch whose token ``window`` is
        [B, T+1]), for the checks that judge it (the norm bound, the forward re-checks): ``x`` itself in a plain run;
        in a subspace run its coefficients ``U^T (x - F)`` [B, T, k], which have the norm of ``x - F`` and agree with
        another frame's as ``x - F`` does. The fixed tables' rows F are the receiver's own, rebuilt from the ids, and
        dominate ``x``: judged whole, a frame of zero coefficients (F alone) read a cosine of 0.97 and a norm ratio
        of 1.03 against an honest one in the links run."""
        if self.subspace is None:
            return x
        if window is None:
            raise ValueError("a subspace run's activations are judged with their token window")
        return self.subspace.coefficients(x, window[:, :-1])

    def _window(self, msg: Forward, peer: str) -> torch.Tensor:
        assert msg.tokens is not None
        window = decode(msg.tokens, self.ids_spec, peer=peer, field="tokens").long()
        if int(window.min()) < 0 or int(window.max()) >= self.run.model.vocab_size:
            raise ValidationError("tokens", peer, f"token ids must be in [0, {self.run.model.vocab_size}), the "
                                  "vocabulary")
        return window

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
