"""What each RPC handler may receive: its message kind, and its largest request computed from the run's shapes.

A forward carries ``batch x block x width`` activations in the run's activation codec and the token targets (in
subspace runs ``batch x block x rank`` coefficients and the ``batch x (block + 1)`` token window); a backward carries
a gradient of the same shape in the gradient codec; an ``infer`` request one sequence, ``1 x block x width``
activations in the widest codec it may use (none, fp32) or ``1 x block`` token ids. A ``state`` request is a few
small integers; an averaging part (``avg_part``, and ``sync``'s gradients) carries at most every parameter of the
largest stage once, in fp32 (the widest codec). These sizes are known before the first byte arrives, so a frame
announcing more is refused before it is read (instead of reading up to the server's generic 256 MiB). The limit is
the packed size of the largest such message, with the longest route and run id the schema allows, plus a fixed
slack for msgpack headers.
``infer_message_bytes`` also bounds the replies a generating client reads.
"""

from __future__ import annotations

import math

import torch

from peer.averaging.loop import AVG_RPC
from peer.averaging.sync import SYNC_RPC
from peer.membership.gossip import RECORDS_RPC
from peer.membership.reachability import REACH_RPC
from peer.membership.vouches import VOUCHES_RPC
from peer.pipeline.attest import FRAUD_RPC
from peer.pipeline.boundary import Boundary
from peer.pipeline.hops import BACKWARD_RPC, FORWARD_RPC
from peer.pipeline.infer import INFER_RPC
from peer.pipeline.testimony import TESTIMONY_RPC
from peer.state.sync import STATE_RPC
from protocol.codecs.registry import encode, largest
from protocol.messages import (
    MAX_DOWNSTREAM,
    MAX_KEY_BYTES,
    MAX_SIGNATURE_BYTES,
    AveragingPart,
    Backward,
    Forward,
    Fraud,
    Hello,
    Infer,
    InferResult,
    RecordsRequest,
    StateDigestRequest,
    StateRequest,
    Testimony,
    TestimonyRequest,
    VouchesRequest,
    pack,
)
from protocol.rpc import RpcServer
from trainer.config import RunConfig
from trainer.model import build_stage

SLACK_BYTES = 16 * 1024
#: the longest route a message may carry (protocol/messages.py: 64 peer ids) with generously long ids
_ROUTE = ["Q" * 64] * 64
#: a reachability request: a Hello with a few addresses
REACH_BYTES = 16 * 1024


def stage_parameters(run: RunConfig) -> list[list[tuple[int, ...]]]:
    """The parameter shapes of every stage (built on the meta device: no memory, no init)."""
    with torch.device("meta"):
        return [[tuple(p.shape) for p in build_stage(run, s).parameters()] for s in range(run.n_stages)]


def averaging_request_bytes(run: RunConfig) -> int:
    """Largest ``avg_part`` or ``sync`` request: an ``AveragingPart`` holding every parameter of the largest stage in
    fp32 (real parts hold a fraction of each tensor, in the run's codec)."""
    largest = 0
    for shapes in stage_parameters(run):
        part = AveragingPart(run_id=run.run_id, stage=1023, round_no=2**63 - 1, sender="Q" * 64,
                             tensors=[encode(torch.zeros(1), "none") for _ in shapes], weight=1e6)
        numel = sum(math.prod(s) for s in shapes)
        largest = max(largest, len(pack(part)) + 4 * numel + 64 * len(shapes))
    return largest + SLACK_BYTES


def pipeline_request_bytes(run: RunConfig) -> dict[str, int]:
    """Largest request of every handler (bytes, framing excluded) for this run: ``forward``, ``backward``, ``reach``,
    ``infer``, ``state``, ``avg_part``, ``sync``, ``records``, ``vouches``, ``testimony`` and ``fraud``."""
    b, t, d = run.data.batch_size, run.model.block_size, run.model.n_embd
    x, ids = torch.zeros(b, t, d), torch.zeros(b, t, dtype=torch.int64)
    boundary = Boundary(run, None)
    targets, window = boundary.first_hop(ids, ids)
    acts, tokens = boundary.encode_forward(x, window)
    acts = largest(acts)
    key, signature = b"k" * MAX_KEY_BYTES, b"s" * MAX_SIGNATURE_BYTES  # signed frames (peer/pipeline/attest.py)
    relayed = [b"r" * max(MAX_KEY_BYTES, MAX_SIGNATURE_BYTES)] * 3
    forward = Forward(run_id=run.run_id, mb_id=2**63 - 1, route=_ROUTE, targets=targets, is_eval=False,
                      activations=acts, sent_at=1e12, flush=2**63 - 1, tokens=tokens, signer=key, signature=signature)
    backward = Backward(run_id=run.run_id, mb_id=2**63 - 1, route=_ROUTE, loss=1e30, is_eval=False,
                        gradient=largest(boundary.encode_gradient(x)), downstream=["Q" * 64] * MAX_DOWNSTREAM,
                        downstream_id=2**63 - 1, signer=key, signature=signature, relayed=[relayed] * MAX_DOWNSTREAM)
    testimony = Testimony(forward=pack(forward), backward=pack(backward), signer=key, signature=signature)
    fraud = Fraud(run_id=run.run_id, witness="Q" * 64, mb_id=2**63 - 1, testimony=pack(testimony), relayed=relayed)
    hello = Hello(protocol_version=1, run_id=run.run_id, stage=0, peer_id="Q" * 64, capabilities=["x" * 64] * 32)
    state = max(len(pack(StateRequest(run_id=run.run_id, stage=1023, chunk=2**20, version=2**63 - 1))),
                len(pack(StateDigestRequest(run_id=run.run_id, stage=1023, seed=2**63 - 1, dims=256))))
    averaging = averaging_request_bytes(run)
    return {FORWARD_RPC: len(pack(forward)) + SLACK_BYTES, BACKWARD_RPC: len(pack(backward)) + SLACK_BYTES,
            REACH_RPC: max(REACH_BYTES, len(pack(hello)) + SLACK_BYTES),
            INFER_RPC: infer_message_bytes(run)["request"], STATE_RPC: state + SLACK_BYTES, AVG_RPC: averaging,
            SYNC_RPC: averaging, RECORDS_RPC: len(pack(RecordsRequest(run_id=run.run_id))) + SLACK_BYTES,
            VOUCHES_RPC: len(pack(VouchesRequest(run_id=run.run_id))) + SLACK_BYTES,
            TESTIMONY_RPC: len(pack(TestimonyRequest(run_id=run.run_id, sender="Q" * 64,
                                                     mb_id=2**63 - 1))) + SLACK_BYTES,
            FRAUD_RPC: len(pack(fraud)) + SLACK_BYTES}


def infer_message_bytes(run: RunConfig) -> dict[str, int]:
    """Largest ``infer`` request and reply (bytes, framing excluded): one sequence of ``block_size`` positions, its
    activations in fp32 (codec none, the widest allowed), or on the last stage one position's logits."""
    t, d, v = run.model.block_size, run.model.n_embd, run.model.vocab_size
    acts = encode(torch.zeros(1, t, d), "none")
    tokens = encode(torch.zeros(1, t, dtype=torch.int64), "none")
    request = max(len(pack(Infer(run_id=run.run_id, stage=1023, inputs=env, codec="x" * 32)))
                  for env in (acts, tokens))
    reply = max(len(pack(InferResult(stage=1023, version=2**63 - 1, outputs=env)))
                for env in (acts, encode(torch.zeros(1, v), "none")))
    return {"request": request + SLACK_BYTES, "reply": reply + SLACK_BYTES}


#: the message kind each handler takes; anything else is refused as BAD_REQUEST before the handler runs
HANDLER_KINDS = {FORWARD_RPC: (Forward,), BACKWARD_RPC: (Backward,), REACH_RPC: (Hello,),
                 STATE_RPC: (StateRequest, StateDigestRequest), AVG_RPC: (AveragingPart,), SYNC_RPC: (AveragingPart,),
                 INFER_RPC: (Infer,), RECORDS_RPC: (RecordsRequest,), VOUCHES_RPC: (VouchesRequest,),
                 TESTIMONY_RPC: (TestimonyRequest,), FRAUD_RPC: (Fraud,)}


def restrict_handlers(rpc: RpcServer, run: RunConfig) -> None:
    """Install each handler's message kind and, where the run fixes it, its largest request on ``rpc``."""
    sizes = pipeline_request_bytes(run)
    for name, kinds in HANDLER_KINDS.items():
        rpc.restrict(name, kinds=kinds, max_message_bytes=sizes.get(name))
