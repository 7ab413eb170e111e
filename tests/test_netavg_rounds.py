"""Averaging rounds: pure scheduling functions, and whole rounds among in-process peers over an in-memory transport.

The in-memory transport passes messages through the real protocol codec (pack/unpack) and turns Error replies into
RemoteError as protocol.rpc does, so everything but the sockets is the production path. Real hivemind P2P peers are
in test_netavg_p2p.py.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from peer.averaging.aggregate import robust_combine
from peer.averaging.exchange import EXCHANGE_REFUSALS, EXCHANGE_SENDS
from peer.averaging.loop import (
    AveragingLoop,
    NetAveragingConfig,
    admissible,
    next_round,
    round_deadline,
    round_start,
    same_stage_peers,
    wagma_partners,
)
from peer.averaging.sync import SYNC_RPC, SyncAverager
from peer.membership.records import PeerRecord
from peer.ops.metrics import PeerMetrics
from protocol.codecs.registry import encode
from protocol.errors import ErrorCode, RemoteError, StreamNotOpened
from protocol.messages import AveragingPart, Error
from trainer.config import AveragingConfig, RunConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.byzantine_peer import Attacker  # noqa: E402  (the red team's behaviour, injected through the seam)

RUN = RunConfig.default().replace(averaging={"period_s": 1.0, "round_steps": 1, "rounds_per_tick": 1})
SHAPES = [(3000,), (37,), (5,)]
FAST = NetAveragingConfig(collect_fraction=0.6, call_timeout_s=0.5, clock_skew_s=0.2, quorum_startup_s=0.0)


def aio(fn):
    """Run an async test function in a fresh event loop (no pytest asyncio plugin is installed)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))

    return wrapper


class MemTransport:
    """In-memory RPC between peers of one test; ``down`` peers neither answer nor can be reached."""

    def __init__(self) -> None:
        self.handlers: dict[tuple[str, str], object] = {}
        self.down: set[str] = set()
        self.resets: dict[tuple[str, str], int] = {}  # (caller, callee): calls that fail at once, like a reset stream
        self.lost_replies: dict[tuple[str, str], int] = {}  # (caller, callee): calls whose reply is lost
        self.unreached: dict[tuple[str, str], int] = {}  # (caller, callee): calls that open no stream (nothing sent)

    def for_peer(self, me: str) -> _PeerTransport:
        return _PeerTransport(self, me)


class _PeerTransport:
    def __init__(self, net: MemTransport, me: str) -> None:
        self.net, self.me = net, me

    async def add_handler(self, name, fn) -> None:
        self.net.handlers[(self.me, name)] = fn

    async def call(self, peer_id, name, msg, *, timeout):
        async def go():
            if peer_id in self.net.down or self.me in self.net.down:
                await asyncio.sleep(3600)
            if self.net.unreached.get((self.me, peer_id), 0) > 0:
                self.net.unreached[(self.me, peer_id)] -= 1
                raise StreamNotOpened(f"cannot open a stream to {peer_id}")
            if self.net.resets.get((self.me, peer_id), 0) > 0:
                self.net.resets[(self.me, peer_id)] -= 1
                raise ConnectionError(f"stream to {peer_id} reset")
            handler = self.net.handlers.get((peer_id, name))
            if handler is None:
                raise ConnectionError(f"{peer_id} does not serve {name}")
            reply = await handler(_wire(msg), self.me)
            if self.net.lost_replies.get((self.me, peer_id), 0) > 0:
                self.net.lost_replies[(self.me, peer_id)] -= 1
                raise ConnectionError(f"stream to {peer_id} closed before its reply")
            if isinstance(reply, Error):
                raise RemoteError(reply.code, reply.message)
            return _wire(reply)

        return await asyncio.wait_for(go(), timeout)


def _wire(msg):
    try:
        from protocol.messages import pack, unpack
    except ImportError:  # the message codec is not there yet: pass objects through
        return msg
    return unpack(pack(msg))


class FakeWorker:
    """The averaging hooks of StageWorker over fixed per-peer values; records what reaches it."""

    def __init__(self, seed: int, drift: float = 0.1) -> None:
        # replicas share the seeded init and drift apart a little, as honest ones do (0.1: ~14 % of their norm;
        # 0.02: ~3 %, inside the 5 % that bounds a lone partner before rounds of three are known)
        base, g = torch.Generator().manual_seed(1234), torch.Generator().manual_seed(seed)
        self.values = [torch.randn(s, generator=base) + drift * torch.randn(s, generator=g) for s in SHAPES]
        self.local_step = 0
        self.begun: set[int] = set()
        self.prepared: set[int] = set()
        self.placed: set[int] = set()  # ids of the tensors averaging_place handed back
        self.finished: dict[int, list[torch.Tensor]] = {}
        self.aborted: list[int] = []

    def averaging_prepare(self, r: int) -> None:
        self.prepared.add(r)

    def averaging_place(self, mean: list[torch.Tensor]) -> list[torch.Tensor]:
        assert threading.current_thread() is not threading.main_thread(), "placed on a worker thread"
        out = [m.clone() for m in mean]
        self.placed.update(id(m) for m in out)
        return out

    def averaging_begin(self, r: int) -> list[torch.Tensor]:
        assert r in self.prepared, "the loop draws a round's partition off the compute thread before its begin"
        self.begun.add(r)
        return [v.clone() for v in self.values]

    def averaging_finish(self, r: int, mean: list[torch.Tensor]) -> None:
        assert r in self.begun
        assert all(id(m) in self.placed for m in mean), "the aggregate reaches the finish through averaging_place"
        self.begun.discard(r)
        self.finished[r] = mean

    def averaging_abort(self, r: int) -> None:
        self.begun.discard(r)
        self.aborted.append(r)


def _make_peer(net: MemTransport, name: str, worker: FakeWorker, peers: list[str], config=FAST, run=RUN,
               attack: str = ""):
    metrics = PeerMetrics(name, 0)

    async def worker_call(fn):
        worker.local_step += 1  # the compute thread makes progress between calls: tau must see it
        return fn(worker)

    async def fetch_peers():
        return [p for p in peers if p != name]

    loop = AveragingLoop(p2p=None, rpc_server=None, dht=None, run=run, stage=0, worker_call=worker_call,
                         metrics=metrics, config=config, transport=net.for_peer(name), fetch_peers=fetch_peers,
                         me=name, local_step=lambda: worker.local_step,
                         behaviour=Attacker(attack) if attack else None, prepare=worker.averaging_prepare,
                         place=worker.averaging_place)
    return loop, metrics


def _returning(*views: list[str]):
    """A fetch_peers seam returning ``views`` in turn, then the last one for ever."""
    calls = iter(views)
    last: list[str] = []

    async def fetch() -> list[str]:
        nonlocal last
        last = next(calls, last)
        return list(last)

    return fetch


def _int8_step(*tensors: torch.Tensor) -> float:
    return max(float(t.abs().max()) for t in tensors) / 127


async def _run_rounds(loops, seconds: float) -> None:
    for loop in loops:
        await loop.start()
    try:
        await asyncio.sleep(seconds)
    finally:
        for loop in loops:
            await loop.stop()


# ---- pure functions ------------------------------------------------------------------------------------------------
def test_round_clock_and_admission():
    cfg = NetAveragingConfig(collect_fraction=0.5, clock_skew_s=1.0)
    assert next_round(100.0, 10.0) == 10 and next_round(100.5, 10.0) == 11
    assert round_deadline(10, 10.0, cfg, run_timeout_s=30.0) == 105.0
    assert round_deadline(10, 10.0, cfg, run_timeout_s=2.0) == 102.0  # the run's timeout caps the window
    assert admissible(10, 100.1, 10.0, cfg, 30.0) is None
    assert admissible(11, 109.5, 10.0, cfg, 30.0) is None  # a slightly fast clock on the sender's side
    assert admissible(11, 108.0, 10.0, cfg, 30.0) == "future_round"
    assert admissible(10, 105.0, 10.0, cfg, 30.0) == "stale_round"
    with pytest.raises(ValueError, match="collect_fraction"):
        NetAveragingConfig(collect_fraction=1.0)
    assert round_deadline(10, 10.0, cfg, 30.0, window_s=12.0) == 112.0  # the measured window, across ticks
    assert admissible(10, 111.0, 10.0, cfg, 30.0, window_s=12.0) is None
    # rounds_per_tick 4: slot j of tick t (key 4t + j) starts j quarter-periods after the tick, its window from there
    assert round_start(41, 10.0, 4) == 102.5 and next_round(100.1, 10.0, 4) == 41 and next_round(102.5, 10.0, 4) == 41
    assert round_deadline(41, 10.0, cfg, 30.0, per_tick=4) == 107.5
    assert admissible(41, 101.6, 10.0, cfg, 30.0, per_tick=4) is None
    assert admissible(43, 105.0, 10.0, cfg, 30.0, per_tick=4) == "future_round"
    assert admissible(41, 107.5, 10.0, cfg, 30.0, per_tick=4) == "stale_round"


@pytest.mark.timeout(30)
@aio
async def test_a_ticks_rounds_begin_at_their_own_slots_spread_over_the_tick():
    """rounds_per_tick 4, replicas owing a round at every slot: each round begins at its slot's start (a quarter
    period apart), not every round of a tick at the tick's start. Begun together, a tick's rounds on a stage of
    whole-tensor rounds (p x round_steps = 1) all averaged the same values, each counted as a new round."""
    run = RUN.replace(averaging={"period_s": 1.0, "rounds_per_tick": 4, "round_steps": 1, "fraction": 0.05})
    net, names = MemTransport(), ["p0", "p1"]
    begun_at: dict[int, float] = {}
    loops = []
    for n in names:
        worker = FakeWorker(len(loops))
        plain_begin = worker.averaging_begin

        def begin(r: int, plain_begin=plain_begin) -> list[torch.Tensor]:
            begun_at.setdefault(r, time.time())
            return plain_begin(r)

        worker.averaging_begin = begin
        loop, _ = _make_peer(net, n, worker, names, run=run)
        loop.local_step = lambda: int(time.time() * 100)  # ~25 steps a slot: a round owed at every slot
        loops.append(loop)
    await _run_rounds(loops, 2.3)
    assert len(begun_at) >= 6
    for r, t in begun_at.items():
        assert 0.0 <= t - round_start(r, 1.0, 4) < 0.2, (r, t - round_start(r, 1.0, 4))


def test_the_exchange_window_follows_the_exchanges_not_a_constant():
    """A round that ends below its quorum for lack of time lengthens the window (4- and 8-replica stages lost a third
    to a half of their rounds in a fixed 0.6-period window); complete rounds bring it back towards twice what they
    take, never under collect_fraction x period_s nor over max_window_periods periods."""
    loop, metrics = _make_peer(MemTransport(), "p0", FakeWorker(0), ["p0", "p1"])
    base = loop.window_s
    assert base == pytest.approx(FAST.collect_fraction * RUN.averaging.period_s)
    loop.observe_exchange(base, complete=False, starved=True)
    assert loop.window_s == pytest.approx(2 * base) and metrics.averaging_cadence()["avg_window_s"] == loop.window_s
    for _ in range(10):
        loop.observe_exchange(loop.window_s, complete=False, starved=True)
    assert loop.window_s == pytest.approx(FAST.max_window_periods * RUN.averaging.period_s)  # bounded
    loop.observe_exchange(0.5, complete=False, starved=False)  # reached its quorum without one: says nothing
    assert loop.window_s == pytest.approx(FAST.max_window_periods * RUN.averaging.period_s)
    for _ in range(40):
        loop.observe_exchange(0.4, complete=True, starved=False)  # every part within 0.4 s
    assert loop.window_s == pytest.approx(0.8, rel=0.05)
    for _ in range(40):
        loop.observe_exchange(0.01, complete=True, starved=False)
    assert loop.window_s == pytest.approx(base)  # never below the run's short window


def test_same_stage_peers_and_the_mean_are_order_independent():
    def rec(pid, stage, state="training"):
        return PeerRecord(peer_id=pid, stage=stage, throughput=1.0, queue=0, version=0, state=state)

    records = {p.peer_id: p for p in [rec("b", 0), rec("a", 0), rec("me", 0), rec("c", 1), rec("d", 0, "joining")]}
    assert same_stage_peers(records, 0, "me") == ["a", "b"]
    x = [[torch.randn(100) for _ in range(2)] for _ in range(3)]
    cfg = AveragingConfig(aggregator="mean")
    m1, _, _ = robust_combine("p1", x[0], {"p2": x[1], "p3": x[2]}, cfg, outlier_factor=4.0, outlier_rms=0.01)
    m2, _, _ = robust_combine("p3", x[2], {"p2": x[1], "p1": x[0]}, cfg, outlier_factor=4.0, outlier_rms=0.01)
    for a, b, j in zip(m1, m2, range(2), strict=True):
        assert torch.equal(a, b)  # bit-identical whoever computes it
        torch.testing.assert_close(a, (x[0][j] + x[1][j] + x[2][j]) / 3)


# ---- whole rounds --------------------------------------------------------------------------------------------------
@pytest.mark.timeout(30)
@aio
async def test_three_peers_average_to_the_mean_within_int8_error_and_agree_bitwise():
    net, names = MemTransport(), ["p0", "p1", "p2"]
    workers = [FakeWorker(i) for i in range(3)]
    run = RUN.replace(averaging={"aggregator": "mean"})  # the robust aggregators: test_netavg_robust.py
    peers = [_make_peer(net, n, w, names, run=run) for n, w in zip(names, workers, strict=True)]
    await _run_rounds([lp for lp, _ in peers], 2.6)
    common = set.intersection(*(set(w.finished) for w in workers))
    assert common, "no round completed on every peer"
    for r in common:
        for j, shape in enumerate(SHAPES):
            true_mean = sum(w.values[j] for w in workers) / 3
            step = max(float(w.values[j].abs().max()) for w in workers) / 127  # int8 absmax step, worst case
            for w in workers:
                assert w.finished[r][j].shape == shape
                assert float((w.finished[r][j] - true_mean).abs().max()) <= step
            assert torch.equal(workers[0].finished[r][j], workers[1].finished[r][j])
            assert torch.equal(workers[0].finished[r][j], workers[2].finished[r][j])
    for _, metrics in peers:
        snap = metrics.snapshot()
        assert metrics.avg_group_size == 3 and metrics.avg_tau is not None and metrics.avg_tau >= 1
        assert snap["counters"].get("averaging_rounds_ok", 0) >= 1
        assert not any(k.startswith("rejected:") for k in snap["counters"])


@pytest.mark.timeout(30)
@aio
async def test_a_peer_opens_a_round_only_when_due_and_joins_a_due_partners_round():
    """round_steps = 3: p0 steps 3 a round and is due; p1 never steps, opens one round (its first) and otherwise only
    joins p0's on demand; each finished round adds the run's round fraction to its metrics."""
    run = RUN.replace(averaging={"round_steps": 3, "fraction": 0.1})
    net, names = MemTransport(), ["p0", "p1"]
    workers = [FakeWorker(0), FakeWorker(1)]
    steps = {"p0": 0, "p1": 0}
    peers = []
    for n, w in zip(names, workers, strict=True):
        loop, metrics = _make_peer(net, n, w, names, run=run)
        loop.local_step = lambda n=n: steps[n]
        peers.append((loop, metrics))
    assert peers[0][0].due()

    async def p0_steps() -> None:
        while True:
            await asyncio.sleep(RUN.averaging.period_s / 3)
            steps["p0"] += 1

    ticker = asyncio.create_task(p0_steps())
    try:
        await _run_rounds([lp for lp, _ in peers], 4.2)
    finally:
        ticker.cancel()
    assert not peers[1][0].due()
    assert set(workers[0].finished) == set(workers[1].finished) and len(workers[0].finished) >= 2
    for _, metrics in peers:
        rounds = metrics.snapshot()["counters"]["averaging_rounds_ok"]
        assert metrics._avg_fraction_sum == pytest.approx(0.3 * rounds)


@pytest.mark.parametrize(("steps_per_tick", "per_tick"), [(4.2, 1), (9.7, 1), (13, 2), (27, 3), (3, 2)])
def test_rounds_follow_local_steps_however_they_fall_on_the_ticks(steps_per_tick, per_tick):
    """round_steps = 10: a peer owes one round per 10 local steps and carries the remainder, so over 200 ticks it
    takes part in steps / 10 rounds (within one), not one round per first tick after 10 steps (at 4.2 steps a tick:
    one round per 3 ticks, 67 rounds for 840 steps, 20 % too few). Up to rounds_per_tick rounds open at one tick,
    each its own slot."""
    run = RUN.replace(averaging={"round_steps": 10, "fraction": 0.05, "rounds_per_tick": per_tick})
    worker = FakeWorker(0)
    loop, _ = _make_peer(MemTransport(), "p0", worker, ["p0", "p1"], run=run)
    loop.peers = ["p1"]
    steps, keys = 0.0, []
    loop.local_step = lambda: int(steps)
    loop._ensure_round = lambda key: (keys.append(key), loop._pay())
    for tick in range(200):
        steps += steps_per_tick
        opened = loop.open_due(tick)
        assert opened == [tick * per_tick + j for j in range(len(opened))]  # slots 0, 1, ... of this tick
    # the first round opens at once, for the steps before it; every 10 steps after it owe one more
    assert abs(len(keys) - (1 + (int(steps) - int(steps_per_tick)) / 10)) <= 1.0
    assert len(set(keys)) == len(keys)


def test_steps_made_alone_leave_the_per_step_fraction():
    """A stage's first replica trains alone until a second one joins: the steps it makes at slots that find nobody to
    average with are not counted in avg_fraction_per_step (a 2-replica swarm's first peers looked 30 % short of p
    for the minute they trained alone)."""
    run = RUN.replace(averaging={"round_steps": 10, "fraction": 0.05, "rounds_per_tick": 1})
    loop, metrics = _make_peer(MemTransport(), "p0", FakeWorker(0), ["p0", "p1"], run=run)
    metrics.start_averaging(0)
    steps = 0
    loop.local_step = lambda: steps
    loop._ensure_round = lambda key: loop._pay()
    loop.peers = []
    for key in range(10):  # alone: 10 slots, 100 steps
        steps += 10
        assert not loop.open_slot(key)
    loop.peers = ["p1"]
    for key in range(10, 20):  # with a partner: a round per slot
        steps += 10
        assert loop.open_slot(key)
        metrics.observe_round(ok=True, group_size=2, tau=1, fraction=0.5)
    metrics.local_step = steps
    assert metrics.averaging_cadence()["avg_fraction_per_step"] == pytest.approx(10 * 0.5 / 110)  # 90 alone


def test_owed_rounds_are_capped_and_a_failed_round_is_owed_again():
    run = RUN.replace(averaging={"round_steps": 10, "fraction": 0.05, "rounds_per_tick": 2})
    loop, _ = _make_peer(MemTransport(), "p0", FakeWorker(0), ["p0", "p1"], run=run)
    loop.peers = ["p1"]
    loop._ensure_round = lambda key: loop._pay()
    steps = 0
    loop.local_step = lambda: steps
    assert loop.due()  # the first round is owed at once
    loop._pay()
    assert not loop.due()
    steps = 1000  # a long time alone: at most rounds_per_tick + 1 rounds are owed, not 100
    assert loop.owed() == 30
    assert loop.open_due(7) == [14, 15]  # rounds_per_tick at one tick, the third at the next
    assert loop.open_due(8) == [16]
    assert not loop.due()
    loop._pay(-1)  # that round failed: owed again
    assert loop.due() and loop.owed() == 10
    for _ in range(5):  # pulled into a faster partner's rounds: owes at most -round_steps
        loop._pay()
    assert loop.owed() == -10
    steps += 19
    assert not loop.due()
    steps += 1
    assert loop.due() and loop.owed() == 10


@aio
async def test_a_round_is_opened_once_however_late_its_parts_come():
    """A partner's part for a round this peer already finished (or opened early on its part) never opens it again:
    the tick skips it and the late part is told the round is over here."""
    loop, _ = _make_peer(MemTransport(), "p0", FakeWorker(0), ["p0", "p1"], run=RUN)
    loop.peers = ["p1"]
    key = next_round(time.time(), RUN.averaging.period_s)
    slot = loop._ensure_round(key)
    loop.exchange.close(key)
    loop.exchange.slots.pop(key, None)
    await loop.stop()
    loop._stopped = False
    with pytest.raises(Exception, match="over here"):
        loop._ensure_round(key)
    loop.local_step = lambda: 100
    assert loop.due() and loop.open_due(key) == []  # owed, but that slot is taken: the tick skips it
    assert slot.key == key


@pytest.mark.timeout(30)
@aio
async def test_a_round_with_a_grown_window_pulls_in_partners_whose_windows_are_short():
    """Only the largest id owes rounds, and its window has grown to 2 periods while its partners' are at the run's
    short window (each peer measures its own). Its rounds must still reach both: it waits for smaller ids' calls only
    the short window's grace (not half its own grown window, which let every round it opened start late), and a
    partner admits a part as long as any peer's window may still be open, collecting from then on. Before, its
    partners refused such parts as stale: rounds failed with no part, and each failure doubled its window further."""
    run = RUN.replace(averaging={"period_s": 1.0, "rounds_per_tick": 1, "round_steps": 1, "fraction": 0.05})
    net, names = MemTransport(), ["p0", "p1", "p2"]
    workers = [FakeWorker(i, drift=0.02) for i in range(3)]
    peers = [_make_peer(net, n, w, names, run=run) for n, w in zip(names, workers, strict=True)]
    for loop, _ in peers[:2]:
        loop.local_step = lambda: 0  # never step: they open only their first round, then are pulled in
    fast = peers[2][0]
    fast.local_step = lambda: int(time.time() * 10)
    fast.window_s = 2.0 * run.averaging.period_s
    fast.observe_exchange = lambda *a, **k: None  # it stays grown (in a loaded swarm, rounds kept it at its bound)
    await _run_rounds([lp for lp, _ in peers], 4.5)
    late = [k for k in workers[2].finished if k not in workers[0].finished or k not in workers[1].finished]
    assert len(workers[2].finished) >= 3 and len(late) <= 1, (sorted(workers[2].finished), late)
    assert peers[2][1].snapshot()["counters"].get("averaging_rounds_failed", 0) <= 1


@pytest.mark.timeout(30)
@aio
async def test_malicious_parts_are_rejected_counted_and_do_not_reach_honest_weights():
    net, names = MemTransport(), ["p0", "p1"]
    workers = [FakeWorker(0, drift=0.02), FakeWorker(1, drift=0.02)]
    # the attacker is in the honest peers' view (it announced itself), so they keep the round open for it
    peers = [_make_peer(net, n, w, names + ["evil"]) for n, w in zip(names, workers, strict=True)]
    sent: list[str] = []

    async def attack():
        # wait until round r is open on the honest peers, then send each kind of poison once per honest peer
        r = next_round(time.time(), RUN.averaging.period_s)
        await asyncio.sleep(max(0.0, r * RUN.averaging.period_s - time.time()) + 0.05)
        good = [torch.zeros(s) for s in SHAPES]
        poisons = {
            "nonfinite": [torch.full(SHAPES[0], float("nan")), *good[1:]],
            "shape": [torch.zeros(SHAPES[0][0] + 1), *good[1:]],
            "too_far": [torch.full(SHAPES[0], 1e6), *good[1:]],
            "tensor_count": good[:2],
        }
        transport = net.for_peer("evil")
        for kind, tensors in poisons.items():
            codec = "none" if kind == "nonfinite" else "int8"
            part = AveragingPart(run_id=RUN.run_id, stage=0, round_no=r, sender="evil",
                                 tensors=[encode(t, codec) for t in tensors], weight=1e6)
            for target in names:
                with pytest.raises(RemoteError):
                    await transport.call(target, "avg_part", part, timeout=1.0)
            sent.append(kind)
        spoofed = AveragingPart(run_id=RUN.run_id, stage=0, round_no=r, sender="p1",
                                tensors=[encode(t, "int8") for t in good], weight=1.0)
        with pytest.raises(RemoteError):
            await transport.call("p0", "avg_part", spoofed, timeout=1.0)
        return r

    attack_task = asyncio.create_task(attack())
    await _run_rounds([lp for lp, _ in peers], 2.6)
    attacked = await attack_task
    assert sent == ["nonfinite", "shape", "too_far", "tensor_count"]
    for _, metrics in peers:
        counters = metrics.snapshot()["counters"]
        for kind in sent:
            assert counters.get(f"rejected:avg_{kind}") == 1, counters
    assert peers[0][1].snapshot()["counters"].get("rejected:avg_sender_mismatch") == 1
    assert attacked in workers[0].finished, "the attacked round must still complete among the honest peers"
    for j in range(len(SHAPES)):
        honest = (workers[0].values[j] + workers[1].values[j]) / 2
        step = max(float(w.values[j].abs().max()) for w in workers) / 127
        for w in workers:
            for mean in w.finished.values():
                assert float((mean[j] - honest).abs().max()) <= step


@pytest.mark.timeout(30)
@aio
async def test_a_vanished_peer_costs_only_its_contribution_and_a_lone_survivor_aborts_cleanly():
    net, names = MemTransport(), ["p0", "p1", "p2"]
    workers = [FakeWorker(i, drift=0.02) for i in range(3)]
    peers = [_make_peer(net, n, w, names) for n, w in zip(names, workers, strict=True)]
    net.down.add("p2")  # p2 is in everyone's view but is gone: it neither answers nor reaches anyone
    await _run_rounds([lp for lp, _ in peers[:2]], 1.8)
    common = set(workers[0].finished) & set(workers[1].finished)
    assert common
    for r in common:
        for j in range(len(SHAPES)):
            assert torch.equal(workers[0].finished[r][j], workers[1].finished[r][j])
            step = max(float(w.values[j].abs().max()) for w in workers[:2]) / 127
            honest = (workers[0].values[j] + workers[1].values[j]) / 2
            assert float((workers[0].finished[r][j] - honest).abs().max()) <= step
    assert peers[0][1].avg_group_size == 2

    # now p1 is gone too: p0 is alone with two dead peers in its view; every round it begins is aborted
    lone = FakeWorker(0)
    loop, metrics = _make_peer(net, "p0", lone, names, config=FAST)
    net.down.add("p1")
    await _run_rounds([loop], 1.8)
    assert lone.finished == {} and lone.aborted and not lone.begun
    assert metrics.snapshot()["counters"].get("averaging_rounds_failed", 0) >= 1


@pytest.mark.timeout(30)
@aio
async def test_parts_for_a_stale_or_far_future_round_are_refused_with_a_clock_hint():
    net = MemTransport()
    worker = FakeWorker(0)
    loop, metrics = _make_peer(net, "p0", worker, ["p0"])
    loop.peers = ["x"]  # x announced itself (a stranger's part is refused before its round is looked at)
    loop.fetch_peers = _returning(["x"])
    await loop.start()
    try:
        now_round = int(time.time() // RUN.averaging.period_s)
        for r in (now_round - 5, now_round + 5):
            part = AveragingPart(run_id=RUN.run_id, stage=0, round_no=r, sender="x",
                                 tensors=[encode(torch.zeros(s), "int8") for s in SHAPES], weight=1.0)
            with pytest.raises(RemoteError, match="clocks"):
                await net.for_peer("x").call("p0", "avg_part", part, timeout=1.0)
        wrong_run = AveragingPart(run_id="0" * 16, stage=0, round_no=now_round, sender="x", tensors=[], weight=1.0)
        with pytest.raises(RemoteError):
            await net.for_peer("x").call("p0", "avg_part", wrong_run, timeout=1.0)
        assert metrics.snapshot()["counters"].get("rejected:avg_wrong_run") == 1
    finally:
        await loop.stop()
    assert worker.finished == {} and worker.begun == set()


async def _sync_averagers(net: MemTransport, names: list[str], *, timeout_s: float = 1.0,
                          grace_s: float = 0.2) -> list[SyncAverager]:
    cfg = NetAveragingConfig(sync_timeout_s=timeout_s, sync_grace_s=grace_s)
    avgs = []
    for n in names:
        s = SyncAverager(p2p=None, rpc_server=None, run=RUN, stage=0, metrics=PeerMetrics(n, 0), config=cfg,
                         transport=net.for_peer(n), me=n)
        await s.start()
        avgs.append(s)
    return avgs


@pytest.mark.timeout(30)
@aio
async def test_sync_average_is_an_exact_barrier_and_survives_a_missing_replica():
    net, names = MemTransport(), ["p0", "p1", "p2"]
    avgs = await _sync_averagers(net, names)
    grads = [[torch.randn(4, 5), torch.randn(7)] for _ in names]

    async def late(i, delay):
        await asyncio.sleep(delay)
        return await avgs[i].all_average(0, grads[i], names)

    results = await asyncio.gather(late(0, 0.0), late(1, 0.2), late(2, 0.4))
    for mean, n in results:
        assert n == 3
        for j in range(2):
            assert mean[j].shape == grads[0][j].shape
            torch.testing.assert_close(mean[j], sum(g[j] for g in grads) / 3)
            assert torch.equal(mean[j], results[0][0][j])
    # step 1: p2 never arrives; the others wait sync_timeout_s and average what they have
    results = await asyncio.gather(*(avgs[i].all_average(1, grads[i], names) for i in range(2)))
    for mean, n in results:
        assert n == 2
        torch.testing.assert_close(mean[1], (grads[0][1] + grads[1][1]) / 2)
    assert avgs[0].metrics.snapshot()["counters"].get("sync_average_incomplete") == 1


@pytest.mark.timeout(30)
@aio
async def test_sync_average_counts_only_announced_replicas_and_drops_an_outlier():
    net, names = MemTransport(), ["p0", "p1", "p2", "p3"]
    avgs = await _sync_averagers(net, names)
    grads = [[torch.randn(50)] for _ in names]
    grads[3] = [-10 * grads[0][0]]  # p3 is announced, but sends a scaled, flipped gradient
    view = names[:3] + ["p3"]
    # p2 is not in p0's and p1's view (a stranger to them); p3 is announced. p2 and p3 come first, so their parts
    # are waiting at p0 and p1 when those open the barrier

    async def later(i: int) -> tuple[list[torch.Tensor], int]:
        await asyncio.sleep(0.5)
        return await avgs[i].all_average(0, grads[i], ["p0", "p1", "p3"])

    vouched: dict[str, list[str]] = {n: [] for n in names}
    for a in avgs:  # whose part went into the mean did validated work: known from then on
        a.vouch = vouched[a.me].append
    results = await asyncio.gather(later(0), later(1), avgs[2].all_average(0, grads[2], view),
                                   avgs[3].all_average(0, grads[3], view))
    for i in (0, 1):
        mean, n = results[i]
        assert n == 2  # the stranger's part is ignored, the outlier dropped
        torch.testing.assert_close(mean[0], (grads[0][0] + grads[1][0]) / 2)
        counters = avgs[i].metrics.snapshot()["counters"]
        assert counters["rejected:avg_not_member"] == 1 and counters["rejected:avg_outlier"] == 1
    assert vouched["p0"] == ["p1"] and vouched["p1"] == ["p0"]  # not the stranger, not the outlier


@pytest.mark.timeout(30)
@aio
async def test_a_replica_whose_own_gradient_is_the_outlier_steps_with_the_others_mean():
    # a replica whose flush went wrong (a far-off gradient) must take the same step as the others: keeping its own
    # part while they drop it forked its weights from theirs, repaired only at the next barrier by loading a state
    net, names = MemTransport(), ["p0", "p1", "p2", "p3"]
    avgs = await _sync_averagers(net, names)
    g = torch.Generator().manual_seed(0)
    grads = [[torch.randn(50, generator=g), torch.randn(3, 4, generator=g)] for _ in names]
    grads[2] = [20 * t for t in grads[2]]
    results = await asyncio.gather(*(a.all_average(0, g, names) for a, g in zip(avgs, grads, strict=True)))
    expected = [(grads[0][j] + grads[1][j] + grads[3][j]) / 3 for j in range(2)]
    for mean, n in results:
        assert n == 3
        for m, e, m0 in zip(mean, expected, results[0][0], strict=True):
            torch.testing.assert_close(m, e)
            assert torch.equal(m, m0)  # the same bits at every replica, the outlier's own included
    counters = avgs[2].metrics.snapshot()["counters"]
    assert counters["avg_self_outlier"] == 1 and not counters.get("rejected:avg_outlier")


@aio
async def test_a_sync_replica_keeps_a_step_that_a_replica_now_ahead_finished_with_it(monkeypatch):
    avg = (await _sync_averagers(MemTransport(), ["p0"]))[0]
    peers = ["p1", "p2", "p3"]
    current = avg.exchange.open(19, time.time() + 10)
    current.contributions["p1"] = [torch.zeros(1)]  # p1 finished step 19 with us; p2's part has not come yet
    later = avg.exchange.open(20, time.time() + 10)
    later.senders.add("p1")  # p1 waits at step 20
    assert avg._ahead(19, peers) is None  # p2's part can still come (p1 got it, or p2 answers late callers)
    assert avg._ahead(19, peers, finished_too=True) == 20
    # ... for a while: then the step is left, so that a replica that skipped it (a joiner) costs seconds, not the
    # barrier's deadline
    monkeypatch.setattr("peer.averaging.sync.AHEAD_HOLD_S", 0.3)
    t0 = time.monotonic()
    await asyncio.wait_for(avg._watch_ahead(19, peers), 5.0)
    assert time.monotonic() - t0 >= 0.3
    later.senders.add("p3")
    assert avg._ahead(19, peers) is None
    later.senders.clear()
    later.senders.add("p3")  # only a replica that skipped step 19 waits ahead: we are the ones behind
    assert avg._ahead(19, peers) == 20
    assert avg._ahead(19, ["p1", "p2"]) is None  # ... unless it is not in our view


@pytest.mark.timeout(30)
@aio
async def test_a_sync_replica_that_is_behind_adopts_the_others_step():
    net, names = MemTransport(), ["p0", "p1", "p2"]
    avgs = await _sync_averagers(net, names)
    avgs[0].last_step = avgs[1].last_step = 9  # p0 and p1 have stepped; p2 joined from an older snapshot
    grads = [[torch.full((6,), float(i + 1))] for i in range(3)]
    results = await asyncio.gather(avgs[0].all_average(10, grads[0], names), avgs[1].all_average(10, grads[1], names),
                                   avgs[2].all_average(0, grads[2], names))
    for mean, n in results:
        assert n == 3
        assert torch.equal(mean[0], torch.full((6,), 2.0))
    assert [a.last_step for a in avgs] == [10, 10, 10]
    assert not any(a.exchange.slots for a in avgs)  # nothing left open


def test_wagma_groups_over_reachable_peers_are_disjoint_symmetric_and_rotate():
    ids = ["a", "b", "c", "d"]
    for r in range(4):
        groups = {p: wagma_partners(p, ids, r, 2) for p in ids}
        for p, group in groups.items():
            assert len(group) == 1 and groups[group[0]] == [p]  # pairs, and both sides agree
    assert wagma_partners("a", ids, 0, 2) != wagma_partners("a", ids, 1, 2)  # the groups rotate
    assert wagma_partners("a", ["a"], 0, 2) == []


@pytest.mark.parametrize("n", [3, 4, 5, 8])
def test_a_daemons_wagma_groups_rotate_for_every_replica_count_with_two_rounds_a_tick(n):
    """A daemon that opens only slot 0 of each tick (two slots a tick) has even round numbers only: its groups
    still rotate through every digit field, so after 2 L ticks every replica has been grouped with another."""
    run = RUN.replace(averaging={"rule": "wagma", "wagma_group_size": 2, "wagma_global_every": 1000,
                                 "rounds_per_tick": 2})
    names = [f"p{i}" for i in range(n)]
    loops = {p: _make_peer(MemTransport(), p, FakeWorker(i), names, run=run)[0] for i, p in enumerate(names)}
    for lp in loops.values():
        lp.peers = list(names)
    fields = max(1, (n - 1).bit_length())
    for p, lp in loops.items():
        groups = [tuple(lp.partners(2 * tick)) for tick in range(2 * fields)]
        assert len(set(groups)) > 1 or n == 2, (p, groups)  # the groups change from tick to tick
        for tick, group in enumerate(groups):  # and both sides of a pair agree
            assert all(p in loops[q].partners(2 * tick) for q in group)
    reach = {p: {p} for p in names}  # every model reaches every other within 2 L ticks (padded groups, design.md)
    for tick in range(2 * fields):
        reach = {p: reach[p].union(*(reach[q] for q in loops[p].partners(2 * tick))) for p in names}
    assert all(r == set(names) for r in reach.values())


@pytest.mark.timeout(30)
@aio
async def test_wagma_rule_averages_within_rotating_pairs():
    run = RUN.replace(averaging={"rule": "wagma", "wagma_group_size": 2, "wagma_global_every": 1000})
    net, names = MemTransport(), ["p0", "p1", "p2", "p3"]
    workers = [FakeWorker(i) for i in range(4)]
    peers = [_make_peer(net, n, w, names, run=run) for n, w in zip(names, workers, strict=True)]
    await _run_rounds([lp for lp, _ in peers], 2.6)
    checked = 0
    for i, w in enumerate(workers):
        for r, mean in w.finished.items():
            (partner,) = wagma_partners(names[i], names, r, 2)
            other = workers[names.index(partner)]
            expected = (w.values[0] + other.values[0]) / 2
            assert float((mean[0] - expected).abs().max()) <= _int8_step(w.values[0], other.values[0])
            checked += 1
    assert checked >= 4


@pytest.mark.timeout(30)
@aio
async def test_a_peer_that_sees_nobody_yet_joins_the_rounds_it_is_asked_for():
    net = MemTransport()
    workers = [FakeWorker(0), FakeWorker(1)]
    newcomer, _ = _make_peer(net, "p0", workers[0], ["p0"])
    # its first read of the DHT does not show p1 yet; p1's first part makes it read again, and p1 is there now
    newcomer.fetch_peers = _returning([], ["p1"])
    veteran, _ = _make_peer(net, "p1", workers[1], ["p0", "p1"])
    await _run_rounds([newcomer, veteran], 2.6)
    common = set(workers[0].finished) & set(workers[1].finished)
    assert common
    for r in common:
        assert torch.equal(workers[0].finished[r][0], workers[1].finished[r][0])


@pytest.mark.timeout(30)
@aio
async def test_sync_future_steps_a_stranger_opens_are_bounded_and_expire():
    net = MemTransport()
    (target,) = await _sync_averagers(net, ["p0"])
    target.config = NetAveragingConfig(sync_timeout_s=0.3)

    def part(step: int, sender: str) -> AveragingPart:
        return AveragingPart(run_id=RUN.run_id, stage=0, round_no=step, sender=sender,
                             tensors=[encode(torch.ones(6), "none")], weight=1.0)

    stranger = net.for_peer("evil")
    waiting = [asyncio.create_task(stranger.call("p0", "avg_sync", part(step, "evil"), timeout=2.0))
               for step in range(1, 5)]
    await asyncio.sleep(0.05)
    assert len(target.exchange.slots) == 4
    with pytest.raises(RemoteError, match="too many open steps"):  # a fifth future step finds the table full
        await stranger.call("p0", "avg_sync", part(5, "evil"), timeout=2.0)
    for task in waiting:
        with pytest.raises(RemoteError, match="not open in time"):
            await task
    await asyncio.sleep(0.1)  # all four have expired: an honest replica's part is admitted again
    honest = asyncio.create_task(net.for_peer("p1").call("p0", "avg_sync", part(7, "p1"), timeout=2.0))
    await asyncio.sleep(0.05)
    assert set(target.exchange.slots) == {7}
    honest.cancel()


def test_flush_clock_closes_each_flush_once_and_ignores_retries():
    from peer.averaging.sync import FlushClock

    clock = FlushClock()
    assert clock.on_forward(7) is None  # the first flush we see: nothing to close yet
    assert clock.on_forward(7) is None
    assert clock.on_forward(8) == 7  # the first forward of 8 closes 7
    assert clock.on_forward(8) is None
    assert clock.on_forward(7) is None and clock.current == 8  # a retried hop of flush 7 closes nothing
    assert clock.on_forward(8) is None
    assert clock.on_forward(11) == 10  # flushes we never saw: the barrier the others run now
    # a partner opened barrier 11 before any forward of 12 reached us (it got the whole flush): join it, once
    assert clock.on_remote_barrier(11) == 11 and clock.current == 12
    assert clock.on_forward(12) is None  # ...and the forwards of 12 that come later close nothing
    assert clock.on_remote_barrier(11) is None and clock.on_remote_barrier(5) is None  # stale
    assert clock.on_remote_barrier(14) == 14 and clock.current == 15  # we missed flushes 13 and 14
    fresh = FlushClock()
    assert fresh.on_remote_barrier(3) == 3  # a new replica joins its partners' barrier rather than make them wait


def test_flush_clock_closes_a_flush_when_its_share_is_done_and_only_once():
    """The drain closes a flush (its barrier overlaps the earlier stages' backwards); the next forward, a partner's
    barrier or a late micro-batch of that flush then close nothing more."""
    from peer.averaging.sync import FlushClock

    clock = FlushClock()
    assert clock.on_forward(4) is None
    assert clock.on_drained(4) == 4  # the M-th backward of flush 4 here: barrier 4 at once
    assert clock.on_drained(4) is None and clock.on_remote_barrier(4) is None  # a retried micro-batch, a partner
    assert clock.on_forward(4) is None  # a late forward of flush 4 joins flush 5's gradient
    assert clock.on_forward(5) is None and clock.current == 5  # flush 4 is closed already
    assert clock.on_forward(7) == 6  # short of M in flush 5 and 6 (drops): the forward of 7 closes 6
    assert clock.on_drained(5) is None  # too late: 5 is behind what we accumulate
    assert clock.on_remote_barrier(7) == 7 and clock.on_drained(7) is None


async def _pair_meets(avgs: list[SyncAverager], step: int, *, within_s: float) -> list[list[torch.Tensor]]:
    """Both replicas of a pair run barrier ``step`` with gradients 1 and 3; each ends with their mean, 2, within
    ``within_s``. Returns the gradients."""
    grads = [[torch.full((4,), 1.0)], [torch.full((4,), 3.0)]]
    names = [a.me for a in avgs]
    t0 = asyncio.get_running_loop().time()
    results = await asyncio.gather(*(a.all_average(step, g, names) for a, g in zip(avgs, grads, strict=True)))
    assert asyncio.get_running_loop().time() - t0 < within_s
    for mean, n in results:
        assert n == 2 and torch.equal(mean[0], torch.full((4,), 2.0))
    return grads


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("fault", "grace"), [
    ("resets", 0.2),  # each side's first call fails at once (a reset stream): retried, not left to the deadline
    ("lost_replies", 0.5),  # p1 took p0's part and finished, its reply was lost: p0's retry gets p1's part from
])                          # the finished barrier, so both hold the same mean
@aio
async def test_a_failed_exchange_ends_in_one_mean_well_before_the_deadline(fault: str, grace: float):
    net, names = MemTransport(), ["p0", "p1"]
    avgs = await _sync_averagers(net, names, timeout_s=10.0, grace_s=grace)
    faults = {("p0", "p1"): 1, ("p1", "p0"): 1} if fault == "resets" else {("p0", "p1"): 1}
    setattr(net, fault, dict(faults))
    await _pair_meets(avgs, 3, within_s=3.0)  # not the 10 s deadline
    # the fault did happen: p0's first call failed (p1 calls p0 only if p0's retry has not reached it within the
    # grace, which on a loaded machine it may well have, so p1's own reset may stay unused)
    assert getattr(net, fault)[("p0", "p1")] == 0


@pytest.mark.timeout(30)
@aio
async def test_an_exchange_is_retried_as_often_as_its_failure_allows(monkeypatch):
    # connections still being dialled when the first barrier opens: more failures in a row than any fixed count of
    # retries, on both sides, but none sent anything; the barrier still completes, long before its deadline
    net, names = MemTransport(), ["p0", "p1"]
    avgs = await _sync_averagers(net, names, timeout_s=20.0)
    net.unreached = {("p0", "p1"): 8, ("p1", "p0"): 8}
    grads = await _pair_meets(avgs, 0, within_s=15.0)  # not the 20 s deadline
    assert net.unreached[("p0", "p1")] == 0  # p0 called p1 more than eight times

    # a call that sent the whole part and got none back is retried EXCHANGE_SENDS times, a refusal
    # EXCHANGE_REFUSALS times, whatever time is left (here with short waits between them)
    monkeypatch.setattr("peer.averaging.exchange.EXCHANGE_BACKOFF_MAX_S", 0.1)
    monkeypatch.setattr("peer.averaging.exchange.EXCHANGE_REFUSED_WAIT_S", 0.1)
    cases = ((1, ErrorCode.UNAUTHORIZED, EXCHANGE_REFUSALS), (2, ErrorCode.NOT_READY, EXCHANGE_SENDS))
    for step, code, expected in cases:
        calls: list[str] = []

        async def answer(msg, peer, code=code, calls=calls):  # a partner that never takes our part
            calls.append(peer)
            return Error(code=code, message="no")

        net.handlers[("p1", SYNC_RPC)] = answer
        avgs[0].config = NetAveragingConfig(sync_timeout_s=4.0, sync_grace_s=0.2)
        mean, n = await avgs[0].all_average(step, grads[0], names)
        assert n == 1 and len(calls) == expected, code


@pytest.mark.timeout(30)
@aio
async def test_a_barrier_opened_by_a_replica_is_reported_to_the_others():
    net, names = MemTransport(), ["p0", "p1"]
    avgs = await _sync_averagers(net, names)
    opened: list[tuple[int, str]] = []

    def join(step: int, peer: str) -> None:  # what a later stage of the daemon does: join that barrier now
        opened.append((step, peer))
        asyncio.ensure_future(avgs[1].all_average(step, [torch.full((3,), 3.0)], names))

    avgs[1].on_remote_open = join
    mean, n = await avgs[0].all_average(5, [torch.full((3,), 1.0)], names)
    assert opened == [(5, "p0")]
    assert n == 2 and torch.equal(mean[0], torch.full((3,), 2.0))


def test_a_peer_averaging_far_less_per_step_than_the_run_says_is_told_what_to_change():
    loop, metrics = _make_peer(MemTransport(), "p0", FakeWorker(0), ["p0"])
    fraction = RUN.averaging.round_fraction
    metrics.start_averaging(0)
    for step in range(1, 7):  # six rounds, each standing for 5x round_steps local steps (a fast peer, a slow clock)
        metrics.local_step = step * 5 * RUN.averaging.round_steps
        metrics.observe_round(ok=True, group_size=2, tau=1.0, fraction=fraction)
        loop._check_cadence()
    assert any("round_steps" in w["text"] for w in metrics.snapshot()["warnings"])
    for step in range(7, 200):  # it catches up (a round per round_steps): the warning goes away
        metrics.local_step = 6 * 5 * RUN.averaging.round_steps + (step - 6) * RUN.averaging.round_steps
        metrics.observe_round(ok=True, group_size=2, tau=1.0, fraction=fraction)
        loop._check_cadence()
    assert not any("round_steps" in w["text"] for w in metrics.snapshot()["warnings"])
