"""Weight stashing under the daemon's real ordering: the compute thread runs a micro-batch's forward, then the
averaging loop's finish (``AveragingLoop._finisher``, exactly what a finished round submits), then the backward.

The backward must see the weights its forward saw, not the averaged ones (the stash is taken before the averaging
writes into the live weights). A worker that stashes only at optimiser steps fails this test.
"""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor

import torch

from peer.averaging.loop import AveragingLoop
from peer.ops.metrics import PeerMetrics
from trainer.config import ModelConfig, RunConfig
from trainer.worker import StageWorker


class _NoTransport:
    async def add_handler(self, name, fn) -> None:
        raise AssertionError("not used")

    async def call(self, peer_id, name, msg, *, timeout):
        raise AssertionError("not used")


def _run() -> RunConfig:
    return RunConfig.default().replace(
        n_stages=2, model=ModelConfig(n_layer=2, n_embd=16, n_head=2, block_size=8, vocab_size=64),
        optim={"weight_stashing": True, "lr": 1e-2, "warmup_steps": 0}, averaging={"rule": "ema", "fraction": 0.5})


def test_averaging_finish_between_forward_and_backward_on_the_compute_thread():
    run = _run()
    worker = StageWorker(run, 0, auto_step=True)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")  # as Daemon.compute

    async def main() -> None:
        loop = asyncio.get_running_loop()

        async def compute(fn, *args):
            return await loop.run_in_executor(executor, fn, *args)

        async def worker_call(fn):
            return await compute(fn, worker)

        avg = AveragingLoop(p2p=None, rpc_server=None, dht=None, run=run, stage=0, worker_call=worker_call,
                            metrics=PeerMetrics(), transport=_NoTransport(), me="a")
        x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        g = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
        values, _ = await worker_call(lambda w: (w.averaging_begin(3), w.local_step))
        forward_weights = [p.detach().clone() for p in worker.parameters()]
        await compute(worker.forward, 0, x)
        partner = [v + 0.05 * torch.randn_like(v) for v in values]  # what a replica that drifted would send
        mean = [(a + b) / 2 for a, b in zip(values, partner, strict=True)]
        await worker_call(avg._finisher(3, mean, 2))
        averaged = [p.detach().clone() for p in worker.parameters()]
        assert max(float((a - b).abs().max()) for a, b in zip(averaged, forward_weights, strict=True)) > 1e-3
        ref = copy.deepcopy(worker.model)
        with torch.no_grad():
            for p, w in zip(ref.parameters(), forward_weights, strict=True):
                p.copy_(w)
        (ref(x) * g).sum().backward()
        want = [p.grad.clone() for p in ref.parameters()]
        got = await compute(_backward_grads, worker, g)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)

    try:
        asyncio.run(main())
    finally:
        executor.shutdown(wait=True)


def _backward_grads(worker: StageWorker, g: torch.Tensor) -> list[torch.Tensor]:
    """Backward with auto_step on would step at once: read the gradient it produced before that step."""
    captured: list[torch.Tensor] = []
    step = worker.optimizer_step

    def capture() -> None:
        captured.extend(worker.grads())
        step()

    worker.optimizer_step = capture  # type: ignore[method-assign]
    try:
        worker.backward(0, g)
    finally:
        del worker.optimizer_step
    return captured
