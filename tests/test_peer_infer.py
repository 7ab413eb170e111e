"""Generation through the pipeline, in-process: the ``infer`` handler's answers and refusals, and the client that
chains the stages (``RemotePipeline``) over a fake transport that packs and unpacks every message.

The multi-process test against a real swarm is ``tests/test_generate_swarm.py``.
"""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from peer.handlers.sizes import HANDLER_KINDS, infer_message_bytes, pipeline_request_bytes
from peer.membership.records import PeerRecord
from peer.ops.metrics import PeerMetrics
from peer.pipeline.infer import INFER_RPC, InferLimits, InferService
from peer.pipeline.remote import RemotePipeline, RunMismatch, SwarmUnavailable
from protocol.codecs.registry import encode
from protocol.errors import ErrorCode, PeerUnreachable, RateLimited, RemoteError, ValidationError
from protocol.messages import Busy, Error, Infer, InferResult, Message, pack, unpack
from trainer.config import RunConfig
from trainer.export import gpt_state, sample
from trainer.model import GPT
from trainer.worker import StageWorker

pytestmark = pytest.mark.timeout(120)

RUN = RunConfig.from_toml(Path(__file__).parent / "runs" / "tiny.toml")
T, C, V = RUN.model.block_size, RUN.model.n_embd, RUN.model.vocab_size


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Stage:
    """One in-process peer of a stage: a worker, its compute thread and its ``infer`` handler."""

    def __init__(self, stage: int, pool: ThreadPoolExecutor, *, limits: InferLimits | None = None,
                 clock: Clock | None = None, run: RunConfig = RUN) -> None:
        self.worker = StageWorker(run, stage)
        self.metrics = PeerMetrics("me", stage)
        self.queue, self.training = 0, True

        async def compute(fn, *args):
            return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

        self.service = InferService(run=run, stage=stage, worker=self.worker, compute=compute, metrics=self.metrics,
                                    queued=lambda: self.queue, serving=lambda: self.training, limits=limits,
                                    clock=clock or Clock())

    async def ask(self, msg: Message, peer: str = "client") -> Message:
        """What the RPC server answers: the handler's reply, or its ProtocolError as an Error (protocol.rpc)."""
        try:
            return unpack(pack(await self.service.rpc_infer(unpack(pack(msg)), peer)))
        except (ValidationError, RateLimited) as e:
            return Error(ErrorCode.RATE_LIMITED if isinstance(e, RateLimited) else ErrorCode.BAD_REQUEST, str(e))


def _tokens(n: int = 12) -> list[int]:
    return list(b"def main():\n    return 0\n")[:n]


def _infer(stage: int, x: torch.Tensor, codec: str = "none", run_id: str = RUN.run_id) -> Infer:
    return Infer(run_id=run_id, stage=stage, inputs=encode(x, "none"), codec=codec)


def _gpt(stages: list[Stage]) -> GPT:
    model = GPT(RUN.model)
    model.load_state_dict(gpt_state(RUN, {s: st.worker.model.state_dict() for s, st in enumerate(stages)}))
    return model.eval()


@pytest.fixture
def pool():
    pool = ThreadPoolExecutor(max_workers=1)
    yield pool
    pool.shutdown()


def test_each_stage_answers_its_forward_and_trains_nothing(pool):
    async def body() -> None:
        s0, s1 = Stage(0, pool), Stage(1, pool)
        # one training step on stage 1 (optimiser state exists), one forward pending on stage 0: both must stay
        s1.worker.forward_loss(7, torch.randn(2, 8, C), torch.randint(0, V, (2, 8)))
        s0.worker.forward(7, torch.randint(0, V, (2, 8)))
        before = {k: v.clone() for k, v in s1.worker.model.state_dict().items()}
        optim_before = repr(s1.worker.optimizer.state_dict()["state"])
        ids = torch.tensor([_tokens()])
        r0 = await s0.ask(_infer(0, ids))
        assert isinstance(r0, InferResult) and r0.stage == 0 and r0.version == 0 and r0.outputs.shape == (1, 12, C)
        r1 = await s1.ask(Infer(run_id=RUN.run_id, stage=1, inputs=r0.outputs, codec="none"))
        assert isinstance(r1, InferResult) and r1.outputs.shape == (1, V) and r1.version == 1
        from protocol.codecs.registry import decode

        with torch.no_grad():
            expected = _gpt([s0, s1])(ids)[:, -1]
        torch.testing.assert_close(decode(r1.outputs), expected, rtol=1e-5, atol=1e-5)
        r8 = await s1.ask(Infer(run_id=RUN.run_id, stage=1, inputs=r0.outputs, codec="int8"))
        assert (decode(r8.outputs) - expected).abs().max() <= 0.01 * expected.abs().max()
        for s in (s0, s1):
            assert s.worker.model.training and not s.worker.stashed_versions()
            assert s.metrics.count("infer_served") >= 1
        assert (s0.worker.local_step, s0.worker.pending(), s1.worker.local_step, s1.worker.pending()) == (0, 1, 1, 0)
        assert all(torch.equal(v, before[k]) for k, v in s1.worker.model.state_dict().items())
        assert repr(s1.worker.optimizer.state_dict()["state"]) == optim_before
        assert s0.worker.backward(7, torch.randn(2, 8, C)) is None and s0.worker.local_step == 1  # still backwardable

    asyncio.run(body())


def test_refusals_are_answered_and_counted(pool):
    async def body() -> None:
        s0, s1 = Stage(0, pool), Stage(1, pool)
        ids = torch.tensor([_tokens()])
        acts = torch.randn(1, 12, C)
        cases = [
            (s0, _infer(0, ids, run_id="other"), ErrorCode.WRONG_RUN, "wrong_run"),
            (s0, _infer(1, acts), ErrorCode.WRONG_STAGE, "wrong_stage"),
            (s0, _infer(0, torch.tensor([list(range(T + 1))])), ErrorCode.BAD_REQUEST, "bad_request"),  # too long
            (s0, _infer(0, torch.zeros(2, 4, dtype=torch.int64)), ErrorCode.BAD_REQUEST, "bad_request"),  # a batch
            (s0, _infer(0, torch.zeros(1, 0, dtype=torch.int64)), ErrorCode.BAD_REQUEST, "bad_request"),  # empty
            (s0, _infer(0, torch.tensor([[1, V]])), ErrorCode.BAD_REQUEST, "bad_request"),  # outside the vocabulary
            (s0, _infer(0, acts), ErrorCode.BAD_REQUEST, "bad_request"),  # floats to stage 0
            (s0, _infer(0, ids, codec="int4"), ErrorCode.BAD_REQUEST, "bad_request"),  # not a reply codec
            (s1, _infer(1, torch.randn(1, 4, C + 1)), ErrorCode.BAD_REQUEST, "bad_request"),  # wrong width
            (s1, _infer(1, torch.full((1, 4, C), float("nan"))), ErrorCode.BAD_REQUEST, "bad_request"),
            (s1, _infer(1, torch.full((1, 4, C), 1e7)), ErrorCode.BAD_REQUEST, "bad_request"),  # beyond max_abs
            (s1, Infer(run_id=RUN.run_id, stage=1, inputs=encode(acts, "int4"), codec="none"), ErrorCode.BAD_REQUEST,
             "bad_request"),  # an input codec the stage does not take
        ]
        for stage, msg, code, reason in cases:
            reply = await stage.ask(msg)
            assert isinstance(reply, Error) and reply.code == code, (msg, reply)
            assert stage.metrics.count(f"rejected:infer_{reason}") >= 1
        assert s0.metrics.count("rejected:infer_bad_request") == 6
        s0.training = False  # joining, loading or draining
        reply = await s0.ask(_infer(0, ids))
        assert isinstance(reply, Error) and reply.code == ErrorCode.NOT_READY
        s0.training = True
        s0.queue = 4  # training work waits: it goes first
        assert isinstance(await s0.ask(_infer(0, ids)), Busy)
        s0.queue = 0
        s0.service.active = 2  # as many requests as it computes at once
        assert isinstance(await s0.ask(_infer(0, ids)), Busy)
        s0.service.active = 0
        assert s0.metrics.count("infer_busy") == 2 and s0.metrics.count("infer_served") == 0
        assert isinstance(await s0.ask(_infer(0, ids)), InferResult)
        for s in (s0, s1):
            assert s.worker.local_step == 0 and not s.worker.pending()

    asyncio.run(body())


def test_callers_are_rate_limited_and_generation_keeps_to_its_share_of_compute(pool):
    async def body() -> None:
        clock = Clock()
        s = Stage(0, pool, clock=clock, limits=InferLimits(peer_per_s=2, peer_burst=3, compute_share=0.25,
                                                           share_burst_s=0.5))
        msg = _infer(0, torch.tensor([_tokens()]))
        for _ in range(3):
            assert isinstance(await s.ask(msg, "greedy"), InferResult)
        reply = await s.ask(msg, "greedy")
        assert isinstance(reply, Error) and reply.code == ErrorCode.RATE_LIMITED
        assert s.metrics.count("rejected:infer_rate_limited") == 1
        assert isinstance(await s.ask(msg, "another"), InferResult)  # per caller
        clock.now += 1.0  # two more for "greedy"
        assert isinstance(await s.ask(msg, "greedy"), InferResult)
        s.service._share.spend(1.0)  # generation used more than its share: Busy until the bucket refills
        reply = await s.ask(msg, "third")
        assert isinstance(reply, Busy) and 1.0 < reply.retry_after_s < 4.0
        clock.now += reply.retry_after_s
        assert isinstance(await s.ask(msg, "third"), InferResult)

    asyncio.run(body())


def test_the_infer_handler_takes_only_infer_and_small_requests():
    assert HANDLER_KINDS[INFER_RPC] == (Infer,)
    sizes = infer_message_bytes(RUN)
    assert sizes["request"] == pipeline_request_bytes(RUN)[INFER_RPC] < pipeline_request_bytes(RUN)["forward"]
    longest = Infer(run_id=RUN.run_id, stage=1, inputs=encode(torch.randn(1, T, C), "none"), codec="none")
    assert len(pack(longest)) <= sizes["request"]
    many = Infer(run_id=RUN.run_id, stage=1, inputs=encode(torch.randn(1, 8 * T, C), "none"), codec="none")
    assert len(pack(many)) > sizes["request"]  # refused before it is read


class Net:
    """Delivers ``infer`` calls to in-process stages through pack/unpack; ``dead``/``busy`` peers fail."""

    def __init__(self) -> None:
        self.stages: dict[str, Stage] = {}
        self.dead: set[str] = set()
        self.busy: set[str] = set()
        self.calls: list[str] = []

    async def call(self, peer: str, name: str, msg: Message, timeout: float) -> Message:
        assert name == INFER_RPC
        self.calls.append(peer)
        if peer in self.dead:
            raise PeerUnreachable(f"{peer} is gone")
        if peer in self.busy:
            return Busy(retry_after_s=5.0)
        reply = await self.stages[peer].ask(msg)
        if isinstance(reply, Error):
            raise RemoteError(reply.code, reply.message)
        return reply

    def records(self, run: RunConfig = RUN) -> dict[str, PeerRecord]:
        return {pid: PeerRecord(peer_id=pid, stage=st.service.stage, throughput=1.0, queue=0, version=0,
                                state="training") for pid, st in self.stages.items() if st.service.run is run}


def _remote(net: Net, *, run: RunConfig = RUN, codec: str | None = "none", timeout_s: float = 5.0) -> RemotePipeline:
    async def read():
        return net.records(run)

    return RemotePipeline(run=run, call=net.call, read_swarm=read, codec=codec, timeout_s=timeout_s,
                          rng=random.Random(0))


def test_the_client_chains_the_stages_and_samples_what_the_whole_model_samples(pool):
    async def body() -> None:
        net = Net()
        net.stages = {"a0": Stage(0, pool), "b0": Stage(0, pool), "a1": Stage(1, pool), "b1": Stage(1, pool)}
        b = net.stages
        b["b0"].worker.model.load_state_dict(b["a0"].worker.model.state_dict())  # replicas agree
        b["b1"].worker.model.load_state_dict(b["a1"].worker.model.state_dict())
        net.dead.add("b0")  # one replica of stage 0 is gone, one of stage 1 always busy: the others serve
        net.busy.add("b1")
        remote = _remote(net)
        await remote.wait_for_stages(1.0)
        model = _gpt([b["a0"], b["a1"]])
        prompt = _tokens(5)
        ids = list(prompt)
        from trainer.export import next_token

        for _ in range(8):
            logits = await remote.next_logits(ids)
            ids.append(int(next_token(logits, temperature=0, top_k=0)))
        assert ids == sample(model, prompt, 8, temperature=0)
        assert [h.peer_id for h in remote.hops] == ["a0", "a1"]
        assert "b0" in net.calls and "b1" in net.calls  # tried, then skipped for a while
        long = list(range(3 * T))  # the context is cut to the block size
        with torch.no_grad():
            expected = model(torch.tensor([long[-T:]]))[:, -1]
        torch.testing.assert_close(await remote.next_logits(long), expected, rtol=1e-5, atol=1e-5)
        int8 = _remote(net, codec=None)  # the run's activation codec
        assert (await int8.next_logits(long) - expected).abs().max() <= 0.05 * expected.abs().max()

    asyncio.run(body())


def test_the_client_says_what_is_missing_or_wrong(pool):
    async def body() -> None:
        net = Net()
        net.stages = {"a0": Stage(0, pool)}
        with pytest.raises(SwarmUnavailable, match=r"stage\(s\) \[1\]") as e:
            await _remote(net).wait_for_stages(0.1)
        assert e.value.exit_code == 3
        net.stages["a1"] = Stage(1, pool)
        net.dead.add("a1")
        remote = _remote(net, timeout_s=1.5)
        with pytest.raises(SwarmUnavailable, match="no peer of stage 1 answered within --timeout 1.5 s"):
            await remote.next_logits(_tokens())
        other = RUN.replace(name="another")
        with pytest.raises(RunMismatch, match=f"trains run {RUN.run_id}, not run {other.run_id}") as e:
            await _remote(net, run=other).probe_run(["a0"])
        assert e.value.exit_code == 2

    asyncio.run(body())
