"""Stage 0's data driver: keeps ``max_inflight`` micro-batches in flight, re-queues dropped ones, runs evaluations.

Each stage-0 peer reads its own shard of the training split (seeded by its peer id) and never loses a sample: a
micro-batch whose route broke or whose gradient did not come back in time is dropped everywhere, counted
(``microbatches_dropped``) and its sample goes back to the front of the queue (``microbatches_requeued``). Consecutive
drops back off exponentially (an empty next stage costs a forward per attempt, so the driver must not spin), and a
driver that stops (its peer leaves stage 0, or exits) gives its re-queued and in-flight samples back to the peer's
``SampleLedger`` (``peer.pipeline.ledger``), from which the next driver draws first.
Evaluation sends the fixed validation batches forward only; the last stage answers each with its loss.

In ``sync`` mode the driver runs GPipe: it sends M micro-batches, waits until all their gradients are back (re-sending
dropped ones), then the flush ends with ``on_flush`` (gradient average across replicas and one optimiser step). Every
training forward carries the flush number, so later stages step when the next flush reaches them instead of counting
micro-batches (a count drifts with every retried hop; see PipelineServicer.on_flush).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from peer.pipeline.ledger import Sample, SampleLedger
from peer.pipeline.servicer import PipelineServicer
from peer.pipeline.work import MicroBatchIds, Pending, Refused

if TYPE_CHECKING:
    from peer.ops.metrics import PeerMetrics
    from trainer.data import BatchStream
    from trainer.stream import ShardStream

logger = logging.getLogger(__name__)

DROP_BACKOFF_BASE_S = 0.1  # first pause after a dropped micro-batch; doubles per consecutive drop
DROP_BACKOFF_MAX_S = 2.0  # longest pause between attempts while the next stage stays unreachable
FINAL_EVAL_TRIES = 3  # attempts at the validation loss reported when training ends


@runtime_checkable
class ReadsAhead(Protocol):
    """A stream that reads ahead in a thread (``trainer.stream.ShardStream``): it can say whether a batch is ready."""

    def ready(self) -> bool: ...

    def wait_ready(self) -> None: ...


class Stage0Driver:
    """Drives the pipeline from stage 0.

    Args:
        pipe: this peer's PipelineServicer (stage 0).
        stream: the training BatchStream of this peer's shard.
        val: the fixed validation batches, identical on every peer.
        inflight: micro-batches kept in flight (async mode).
        stop: set when the peer should stop feeding work.
        max_steps: stop after this many local optimiser steps (0: never).
        ledger: the peer's samples owed across stage moves (drawn from first, given back to on stop).
        samples_log: append a digest of every trained micro-batch's tokens here (audits across restarts).
    """

    def __init__(self, *, pipe: PipelineServicer, stream: BatchStream | ShardStream,
                 val: list[tuple[torch.Tensor, torch.Tensor]], inflight: int, stop: asyncio.Event, max_steps: int,
                 metrics: PeerMetrics, ledger: SampleLedger | None = None, samples_log: Path | None = None) -> None:
        self.pipe, self.stream, self.val, self.inflight = pipe, stream, val, inflight
        self.samples_log = samples_log
        self.stop, self.max_steps, self.metrics = stop, max_steps, metrics
        self.ledger = ledger if ledger is not None else SampleLedger()
        self.requeue: deque[Sample] = deque()
        self.in_flight: dict[int, Sample] = {}  # drawn, sent, not yet trained nor re-queued
        self._keys = 0
        self.drop_streak = 0
        self.ids = MicroBatchIds()
        self.losses: list[float] = []
        self.val_losses: list[float] = []
        self.tokens = 0
        self.tokens_timed = 0  # tokens completed after the first completion (the rate's numerator)
        self.first_done: float | None = None
        self.finished: float | None = None
        self.flush: int | None = None  # sync mode: the flush in progress, sent with every training forward

    def new_id(self) -> int:
        return self.ids.new()

    def done(self) -> bool:
        return self.stop.is_set() or (self.max_steps > 0 and self.pipe.worker.local_step >= self.max_steps)

    # ----- one micro-batch ------------------------------------------------------------------------------------------
    async def one(self, sample: tuple[torch.Tensor, torch.Tensor], *, is_eval: bool = False) -> float | Refused | None:
        """Run one micro-batch through the pipeline; returns its loss, None when it was dropped, or ``REFUSED`` when
        the last stage would not train on it."""
        pipe = self.pipe
        x, y = sample
        mb_id = self.new_id()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[float | Refused | None] = loop.create_future()
        p = Pending(prev_peer=None, next_peer=None, route=[], is_eval=is_eval, done=done,
                    deadline=time.monotonic() + pipe.cfg.microbatch_timeout_s)
        pipe.expect(mb_id, p)
        if pipe.is_last:  # a one-stage run: the whole model is here
            pipe.forget(mb_id)
            if is_eval:
                return float(await pipe.compute(pipe.worker.evaluate, x, y))
            loss, _ = await pipe.meter.timed(mb_id, True, pipe.worker.forward_loss, mb_id, x, y)
            return float(loss)
        if is_eval:
            out = await pipe.compute(pipe.worker.evaluate, x)
        else:
            out = await pipe.meter.timed(mb_id, False, pipe.worker.forward, mb_id, x)
        try:
            targets, window = await loop.run_in_executor(None, pipe.boundary.first_hop, x, y)
            await pipe.forward_next(mb_id, out, targets, [pipe.my_id], is_eval, None if is_eval else self.flush,
                                    window=window)
            return await done  # set by the backward, a drop, or the expiry timer
        except asyncio.CancelledError:  # stopped mid-flight: release what the worker keeps for it
            if pipe.forget(mb_id) and not is_eval:
                pipe.spawn(pipe.compute(pipe.worker.drop, mb_id))
            raise

    async def _train_one(self, sample: Sample) -> bool:
        self._keys += 1
        key = self._keys
        self.in_flight[key] = sample  # stays there if we are cancelled: given back when the driver stops
        loss = await self.one(sample)
        self.in_flight.pop(key, None)
        if isinstance(loss, Refused):  # the last stage refused it (loss far above its recent ones): not re-sent
            self.metrics.inc("samples_refused", int(sample[0].shape[0]))
            return True
        if loss is None:
            self.metrics.inc("microbatches_dropped")
            self.metrics.inc("microbatches_requeued")
            self.requeue.appendleft(sample)
            self.drop_streak += 1  # back off while the route stays broken: each attempt costs a forward
            await asyncio.sleep(min(DROP_BACKOFF_BASE_S * 2 ** (self.drop_streak - 1), DROP_BACKOFF_MAX_S))
            return False
        self.drop_streak = 0
        n_tokens = int(sample[0].numel())
        if self.first_done is None:  # throughput counts from the first completed micro-batch (pipeline full)
            self.first_done = time.monotonic()
            n_tokens_counted = 0
        else:
            n_tokens_counted = n_tokens
        self.tokens += n_tokens
        self.tokens_timed += n_tokens_counted
        self.metrics.inc("tokens", n_tokens)
        self.metrics.inc("samples", int(sample[0].shape[0]))
        if self.samples_log is not None:
            with open(self.samples_log, "a") as f:  # one short line, flushed on close: survives a SIGKILL
                f.write(f"{sample_digest(sample)}\n")
        self.metrics.local_step = self.pipe.worker.local_step
        if math.isfinite(loss):
            self.losses.append(loss)
            self.metrics.observe_loss(loss)
        return True

    async def _source_ready(self) -> None:
        """Wait, off the event loop, until the stream can hand out a batch at once (a streamed dataset reads ahead
        in a thread; the loop must keep serving RPCs while the source is slow)."""
        if self.requeue or len(self.ledger) or not isinstance(self.stream, ReadsAhead) or self.stream.ready():
            return
        await asyncio.get_running_loop().run_in_executor(None, self.stream.wait_ready)

    def _sample(self) -> Sample:
        if self.requeue:
            return self.requeue.popleft()
        owed = self.ledger.take()
        return owed if owed is not None else self.stream.next()

    def untrained(self) -> list[Sample]:
        """The samples this driver drew and has not trained: re-queued, then in flight (what a checkpoint of the
        ledger saves as owed besides the ledger's own)."""
        return list({id(s): s for s in (*self.requeue, *self.in_flight.values())}.values())  # one entry per sample

    def _give_back(self, extra: Sequence[Sample] = ()) -> None:
        """Return every sample drawn and not trained to the peer's ledger, and keep the stream's position there
        (the driver is stopping)."""
        owed = {id(s): s for s in (*extra, *self.untrained())}
        self.ledger.give_back(list(owed.values()))
        self.requeue.clear()
        self.in_flight.clear()
        self.ledger.detach(self.stream)
        close = getattr(self.stream, "close", None)
        if close is not None:
            close()

    # ----- loops -----------------------------------------------------------------------------------------------------
    async def run_async(self) -> None:
        """Keep ``inflight`` micro-batches in flight until stopped or max_steps is reached."""
        slots = asyncio.Semaphore(self.inflight)
        running: set[asyncio.Task[bool]] = set()

        def finished(task: asyncio.Task[bool]) -> None:
            running.discard(task)
            slots.release()
        try:
            while not self.done() and self.pipe.accepting:  # not accepting: the peer is leaving stage 0
                await slots.acquire()
                await self._source_ready()
                if self.done() or not self.pipe.accepting:
                    slots.release()
                    break
                task = asyncio.ensure_future(self._train_one(self._sample()))
                running.add(task)
                task.add_done_callback(finished)
            if not self.done():
                # the peer is leaving stage 0 (not accepting): StageService.leave drains and then cancels us, and
                # the samples go back to the ledger below. Returning now would read as "max_steps reached".
                await asyncio.Future()
            if running:
                self.pipe.stop_accepting()  # stage 0 takes no forwards; this only stops waiting for routes
                await asyncio.wait(running, timeout=self.pipe.cfg.drain_timeout_s)
        finally:
            for t in running:
                t.cancel()
            self._give_back()
            self.finished = time.monotonic()

    async def run_sync(self, microbatches: int, on_flush: Callable[[], Awaitable[None]],
                       ready: Callable[[], bool] = lambda: True, flush_no: Callable[[], int] = lambda: 0) -> None:
        """GPipe: M micro-batches, wait for all gradients (re-sending dropped ones), then ``on_flush``.

        ``ready`` gates each flush (the daemon waits for a full mesh: the same number of replicas on every stage, so
        that pipeline i is pinned to replica i of each stage and every replica gets exactly M micro-batches).
        ``flush_no`` gives the number of the flush about to start (the stage's barrier step).
        """
        batch: list[Sample] = []
        try:
            while not self.done():
                while not ready() and not self.stop.is_set():
                    await asyncio.sleep(0.2)
                self.flush = flush_no()
                batch = []
                for _ in range(microbatches):
                    await self._source_ready()
                    batch.append(self._sample())
                while batch and not self.stop.is_set():
                    results = await asyncio.gather(*(self._train_one(s) for s in batch))
                    batch = [s for s, ok in zip(batch, results, strict=True) if not ok]
                    self.requeue.clear()  # re-sent here, within the same flush
                if self.stop.is_set():
                    break
                await on_flush()
        finally:
            self.in_flight.clear()  # in sync mode every untrained sample of the flush is still in `batch`
            self._give_back(batch)
            self.finished = time.monotonic()

    async def evaluate(self) -> float | None:
        """Validation loss over the fixed validation batches, or None when any of them did not come back (a mean over
        a subset is a different figure: the batches' losses differ by more than a few evaluations' progress)."""
        results = await asyncio.gather(*(self.one(b, is_eval=True) for b in self.val))
        losses = [r for r in results if isinstance(r, float) and math.isfinite(r)]
        if not losses or len(losses) < len(self.val):
            self.metrics.inc("eval_failed")
            return None
        value = sum(losses) / len(losses)
        self.val_losses.append(value)
        self.metrics.observe_val(value)
        return value

    async def final_evaluate(self, tries: int = FINAL_EVAL_TRIES, pause_s: float = 1.0) -> float | None:
        """The validation loss when training ends: a few tries, since the driver no longer waits for routes and a
        next-stage peer may be banned for a moment; None when none came back."""
        for attempt in range(tries):
            if attempt:
                await asyncio.sleep(pause_s)
            value = await self.evaluate()
            if value is not None:
                return value
        logger.warning("the final evaluation failed %d times (no route to the last stage, or its losses were "
                       "refused); the summary reports the latest periodic evaluation instead", tries)
        return None

    async def eval_loop(self, every_s: float) -> None:
        while not self.stop.is_set():
            try:
                await asyncio.wait_for(self.stop.wait(), timeout=every_s)
            except TimeoutError:
                await self.evaluate()

    def tokens_per_s(self) -> float:
        """Training tokens per second from the first completed micro-batch to the end (start-up excluded)."""
        if self.first_done is None:
            return 0.0
        elapsed = (self.finished or time.monotonic()) - self.first_done
        return self.tokens_timed / elapsed if elapsed > 0 else 0.0


def sample_digest(sample: Sample) -> str:
    """16 hex digits naming a micro-batch by its input tokens (the samples log)."""
    return hashlib.sha256(sample[0].numpy().tobytes()).hexdigest()[:16]
