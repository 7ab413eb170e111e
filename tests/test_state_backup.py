"""Neighbour backups: the copy a peer keeps of the next stage (fetched, kept, never replaced by a less advanced one),
announced in its signed record, served by its state server, and restored when a stage has no peer left."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from pathlib import Path

import pytest
import torch
from hivemind.utils import get_dht_time

import peer.state.backup as backup_mod
import peer.state.restore as restore_mod
from peer.membership.records import PeerRecord, RecordError, record_validator, swarm_key
from peer.membership.signing import Signer, seal
from peer.ops.metrics import PeerMetrics
from peer.state.backup import neighbour_stage, take_backup, upstream_stage
from peer.state.checkpoint import checkpoint_path, checkpoint_steps, save_checkpoint
from peer.state.spare import SpareStore, adopt_checkpoint, spare_fields, spare_path
from peer.state.sync import StateServer, StateSyncConfig, load_state_from_peers
from protocol.errors import RemoteError
from protocol.messages import Error, pack, unpack
from tests.test_peer_signing import _dht_record
from trainer.config import RunConfig
from trainer.worker import StageWorker

pytestmark = pytest.mark.timeout(60)

RUN = RunConfig.from_toml(Path(__file__).parent / "runs" / "tiny.toml")  # 2 stages
SMALL = StateSyncConfig(chunk_bytes=16 * 1024, chunk_timeout_s=5.0)


def worker(stage: int, steps: int) -> StageWorker:
    w = StageWorker(RUN, stage)
    g = torch.Generator().manual_seed(stage * 100 + steps)
    for _ in range(steps):
        w.set_grads([torch.randn(p.shape, generator=g) for p in w.parameters()])
        w.optimizer_step()
    return w


def rec(pid: str, stage: int, version: int = 0, st: str = "training", **kw) -> PeerRecord:
    return PeerRecord(peer_id=pid, stage=stage, throughput=1.0, queue=0, version=version, state=st, **kw)


class Direct:
    """Transport straight into in-process StateServers, through the real message codec."""

    def __init__(self, servers: dict[str, StateServer]) -> None:
        self.servers = servers

    async def call(self, peer_id, name, msg, *, timeout):
        reply = await self.servers[peer_id]._handle(unpack(pack(msg)), "client")
        if isinstance(reply, Error):
            raise RemoteError(reply.code, reply.message)
        return unpack(pack(reply))


def server(w: StageWorker, spare: SpareStore | None = None) -> StateServer:
    async def worker_call(fn):
        return fn(w)

    s = StateServer(p2p=None, rpc_server=None, run=RUN, stage=w.stage, worker_call=worker_call,
                    metrics=PeerMetrics("srv", w.stage), config=SMALL, transport=Direct({}), spare=spare)
    s.ready = True
    return s


# ----- the record ----------------------------------------------------------------------------------------------------
def test_the_record_announces_the_copy_and_older_records_stay_valid():
    plain = rec("QmA", 0).to_value()
    assert not any(k.startswith("backup_") for k in plain)  # what older validators accept, unchanged
    assert PeerRecord.from_value("QmA", plain).backup_stage is None
    value = rec("QmA", 0, backup_stage=1, backup_step=42, backup_taken_at=1.7e9).to_value()
    back = PeerRecord.from_value("QmA", value)
    assert (back.backup_stage, back.backup_step, back.backup_taken_at) == (1, 42, 1.7e9)
    assert spare_fields(None) == {}
    with pytest.raises(ValueError):
        rec("QmA", 0, backup_stage=1)  # the three fields go together


@pytest.mark.parametrize("bad", [
    {"backup_stage": 1},  # partial
    {"backup_stage": 1, "backup_step": 5},
    {"backup_stage": -1, "backup_step": 5, "backup_taken_at": 1.0},
    {"backup_stage": True, "backup_step": 5, "backup_taken_at": 1.0},
    {"backup_stage": "1", "backup_step": 5, "backup_taken_at": 1.0},
    {"backup_stage": 1, "backup_step": -3, "backup_taken_at": 1.0},
    {"backup_stage": 1, "backup_step": 2**63, "backup_taken_at": 1.0},
    {"backup_stage": 1, "backup_step": 5, "backup_taken_at": math.nan},
    {"backup_stage": 1, "backup_step": 5, "backup_taken_at": 0.0},
    {"backup_stage": 1, "backup_step": 5, "backup_taken_at": "yesterday"},
])
def test_malformed_backup_fields_are_refused_by_every_nodes_validator(bad):
    with pytest.raises(RecordError):
        PeerRecord.from_value("QmA", {**rec("QmA", 0).to_value(), **bad})
    signer = Signer.generate()
    key, v, exp = swarm_key("backup-run"), record_validator("backup-run"), get_dht_time() + 20
    good = rec(signer.peer_id, 0, backup_stage=1, backup_step=9, backup_taken_at=time.time()).to_value()
    assert v.validate(_dht_record(signer.peer_id, seal(signer, key, good, exp, None), exp, key=key))
    malformed = {**rec(signer.peer_id, 0).to_value(), **bad}
    assert not v.validate(_dht_record(signer.peer_id, seal(signer, key, malformed, exp, None), exp, key=key))


# ----- keeping the copy ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("on_disk", [True, False])
def test_a_less_advanced_copy_never_replaces_a_more_advanced_one(tmp_path, on_disk):
    store = SpareStore(RUN, tmp_path if on_disk else None)
    assert store.offer(1, worker(1, 3).state_dict(), source="a", taken_at=100.0)
    assert not store.offer(1, worker(1, 2).state_dict(), source="b", taken_at=200.0)
    assert store.info.step == 3 and store.info.source == "a" and store.read(1)["local_step"] == 3
    assert store.read(0) is None
    assert store.offer(1, worker(1, 5).state_dict(), source="b", taken_at=300.0)
    assert store.read(1)["local_step"] == 5 and spare_fields(store.info)["backup_step"] == 5
    if on_disk:  # a restarted peer finds its copy again; its own-stage checkpoint files are left alone
        again = SpareStore(RUN, tmp_path)
        assert again.scan() == store.info
        assert not checkpoint_path(tmp_path, 1).exists() and checkpoint_steps(tmp_path, RUN) == {}
        assert spare_path(tmp_path, 1).exists()


def test_the_copy_lives_beside_the_peers_own_checkpoint_of_that_stage(tmp_path):
    save_checkpoint(tmp_path, RUN, 1, worker(1, 7).state_dict())
    store = SpareStore(RUN, tmp_path)
    store.offer(1, worker(1, 2).state_dict(), source="a", taken_at=1.0)
    assert checkpoint_steps(tmp_path, RUN) == {1: 7}  # the peer's own checkpoint is not replaced


# ----- fetching and serving ------------------------------------------------------------------------------------------
def test_a_backup_is_fetched_from_the_neighbour_kept_and_only_fetched_again_when_it_moved_on(tmp_path):
    async def main():
        trained = worker(1, 4)
        donor = server(trained)
        store, metrics = SpareStore(RUN, tmp_path), PeerMetrics("me", 0)
        records = {"d": rec("d", 1, version=4), "x": rec("x", 0, version=9)}
        transport = Direct({"d": donor})
        kw = dict(run=RUN, stage=0, my_id="me", spares=store, metrics=metrics, p2p=None, transport=transport,
                  config=SMALL)
        # the neighbour stage's only replica, unwitnessed: copied only once it did validated work for us
        assert not await take_backup(records=records, **kw)
        kw["trusted"] = ["d"]
        assert await take_backup(records=records, **kw)
        assert store.info.stage == 1 and store.info.step == 4 and store.info.source == "d"
        taken = metrics.snapshot()["counters"]
        assert taken["backups_taken"] == 1 and taken["backup_bytes_in"] > 0
        assert not await take_backup(records=records, **kw)  # nobody is ahead of the copy: no traffic
        assert metrics.snapshot()["counters"]["backups_taken"] == 1
        assert not await take_backup(records={"x": rec("x", 0, version=9)}, **kw)  # no peer on the neighbour stage
        return store.read(1), trained.state_dict()

    copy, original = asyncio.run(main())
    assert copy["local_step"] == 4 and copy["model"].keys() == original["model"].keys()
    assert all(torch.equal(copy["model"][k], original["model"][k]) for k in original["model"])
    assert neighbour_stage(1, 0) is None and neighbour_stage(3, 2) == 0


def test_stage1_of_a_longer_run_keeps_a_private_copy_of_stage0_of_its_weights_only():
    """Stage 1 re-checks stage 0's forwards: in runs of 3+ stages its neighbour copy is of stage 2, so it takes a
    second copy of stage 0 by the same rules, weights and step only, kept in memory apart from the announced one."""
    assert [upstream_stage(3, s) for s in range(3)] == [None, 0, None]
    assert upstream_stage(2, 1) is None and upstream_stage(5, 1) == 0  # 2 stages: the neighbour copy is of stage 0

    async def main():
        trained = worker(0, 3)
        private, announced, metrics = SpareStore(RUN, None), SpareStore(RUN, None), PeerMetrics("me", 1)
        kw = dict(run=RUN, stage=1, my_id="me", metrics=metrics, p2p=None, transport=Direct({"d": server(trained)}),
                  config=SMALL, records={"d": rec("d", 0, version=3)}, trusted=["d"])
        assert await take_backup(spares=private, of=0, weights_only=True, **kw)
        assert announced.info is None and private.info.stage == 0 and private.info.step == 3
        return private.read(0), trained.state_dict()

    copy, original = asyncio.run(main())
    assert set(copy) <= {"format", "run_id", "stage", "model", "local_step"} and "model" in copy
    assert "optimizer" in original  # what a full copy would have held besides
    assert all(torch.equal(copy["model"][k], original["model"][k]) for k in original["model"])


def test_a_copy_asked_for_comes_early_at_most_every_refresh_bound_and_even_while_busy(monkeypatch):
    """A re-check that fails against the held copy asks for a fresher one (``SpareStore.want_fresh``): the loop takes
    it before its period ends, even while the compute queue is busy, and no more often than ``REFRESH_MIN_S``."""
    monkeypatch.setattr(backup_mod, "REFRESH_MIN_S", 0.5)
    taken: list[float] = []

    async def fake_take(**kw):
        taken.append(time.monotonic())
        return True
    monkeypatch.setattr(backup_mod, "take_backup", fake_take)

    async def main():
        store, metrics = SpareStore(RUN, None), PeerMetrics("me", 0)
        loop = asyncio.ensure_future(backup_mod.backup_loop(
            run=RUN, stage=0, my_id="me", period_s=60.0, spares=store, metrics=metrics, p2p=None,
            swarm=dict, busy=lambda: True))
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        store.want_fresh()
        while len(taken) < 1:
            await asyncio.sleep(0.02)
        store.want_fresh()  # asked again at once: not before the bound
        while len(taken) < 2:
            await asyncio.sleep(0.02)
        loop.cancel()
        return t0, metrics.snapshot()["counters"]

    t0, counters = asyncio.run(main())
    assert taken[0] - t0 < 0.6  # the first within the bound since the loop started, not the 60-s period
    assert taken[1] - taken[0] >= 0.45
    assert counters["backups_wanted"] == 2 and counters.get("backups_skipped_busy", 0) == 0


def test_the_backup_loop_copies_only_a_witnessed_state(tmp_path):
    """A liar announcing the neighbour stage's most advanced state serves zeros: the other replica refuses it, the
    honest replica's state is copied, and the copy's step is capped at what the witness reports."""
    async def main():
        liar = worker(1, 4)
        liar.local_step = 2**40
        with torch.no_grad():
            for p in liar.model.parameters():
                p.zero_()
        honest = worker(1, 5)
        store, metrics = SpareStore(RUN, tmp_path), PeerMetrics("me", 0)
        records = {"liar": rec("liar", 1, version=2**40), "h": rec("h", 1, version=5)}
        transport = Direct({"liar": server(liar), "h": server(honest)})
        kw = dict(run=RUN, stage=0, my_id="me", spares=store, metrics=metrics, p2p=None, transport=transport,
                  config=SMALL, records=records)
        assert not await take_backup(**kw)  # a stage of two, one word against another: nothing is copied
        assert metrics.snapshot()["counters"]["state_sync_outvoted"] == 2 and store.info is None
        assert await take_backup(trusted=["h"], **kw)  # h did validated work for us: it witnesses, and is copied
        assert store.info.source == "h" and store.info.step == 5
        copy = store.read(1)
        assert float(copy["model"][next(iter(copy["model"]))].abs().sum()) > 0

    asyncio.run(main())


def test_a_peer_serves_its_copy_for_the_copys_stage_and_counts_the_traffic(tmp_path):
    async def main():
        store = SpareStore(RUN, tmp_path)
        store.offer(1, worker(1, 6).state_dict(), source="d", taken_at=time.time())
        holder = server(worker(0, 2), spare=store)
        metrics = PeerMetrics("joiner", 1)
        got = await load_state_from_peers(p2p=None, run=RUN, stage=1, metrics=metrics, donors=["h"],
                                          reference=StageWorker(RUN, 1).state_dict(), config=SMALL,
                                          transport=Direct({"h": holder}))
        served = holder.metrics.snapshot()["counters"]
        nobody = SpareStore(RUN, None)
        plain = server(worker(0, 2), spare=nobody)
        refused = await load_state_from_peers(p2p=None, run=RUN, stage=1, metrics=metrics, donors=["p"],
                                              config=SMALL, transport=Direct({"p": plain}))
        return got, served, refused, plain.metrics.snapshot()["counters"]

    got, served, refused, plain = asyncio.run(main())
    assert got is not None and got["local_step"] == 6 and got["stage"] == 1
    assert served["backups_served"] == 1 and served["backup_bytes_out"] > 0
    assert refused is None and plain["rejected:state_wrong_stage"] >= 1


# ----- restoring an emptied stage ------------------------------------------------------------------------------------
def _restore(tmp_path, monkeypatch, records, delivered: dict, spare=None, trusted=None):
    asked: list[list[str]] = []

    async def fake_load(*, donors, **kw):
        asked.append(list(donors))
        return delivered.get(donors[0])

    async def io(fn, *args):
        return fn(*args)

    async def refresh():
        return records

    monkeypatch.setattr(restore_mod, "load_state_from_peers", fake_load)
    metrics = PeerMetrics()
    out = asyncio.run(restore_mod.restore_state(
        run=RUN, stage=1, my_id="me", refresh=refresh, p2p=None, dht=None, metrics=metrics,
        reference={}, checkpoint_dir=tmp_path, io=io, timeout_s=5.0, donor_wait_s=0.0, spare=spare,
        trusted=None if trusted is None else lambda: trusted))
    return out, asked, metrics


def test_an_emptied_stage_is_restored_from_the_freshest_announced_copy_with_its_age(tmp_path, monkeypatch, caplog):
    taken = time.time() - 90
    records = {"s0a": rec("s0a", 0, 500, backup_stage=1, backup_step=300, backup_taken_at=taken - 600),
               "s0b": rec("s0b", 0, 500, backup_stage=1, backup_step=450, backup_taken_at=taken),
               "gone": rec("gone", 0, 500, st="draining", backup_stage=1, backup_step=999, backup_taken_at=taken)}
    with caplog.at_level(logging.WARNING, logger="peer.state.restore"):
        out, asked, metrics = _restore(tmp_path, monkeypatch, records,
                                       {"s0a": {"local_step": 300}, "s0b": {"local_step": 450}})
    assert out.source.kind == "spare" and out.source.label == "s0b" and out.state["local_step"] == 450
    assert asked == [["s0b"]]
    line = next(r.getMessage() for r in caplog.records if "backup copy" in r.getMessage())
    assert "held by peer s0b" in line and "step 450" in line
    age = int(line.split("taken ")[1].split(" s ago")[0])
    assert 89 <= age <= 95
    assert any("backup copy" in w["text"] for w in metrics.snapshot()["warnings"])
    assert "seeded init" not in caplog.text


def test_a_failed_copy_falls_to_the_next_and_a_checkpoint_ahead_wins(tmp_path, monkeypatch):
    records = {"a": rec("a", 0, 500, backup_stage=1, backup_step=300, backup_taken_at=time.time()),
               "b": rec("b", 0, 500, backup_stage=1, backup_step=450, backup_taken_at=time.time())}
    out, asked, _ = _restore(tmp_path, monkeypatch, records, {"a": {"local_step": 300}})  # b fails to deliver
    assert out.source.label == "a" and asked == [["b"], ["a"]]
    save_checkpoint(tmp_path, RUN, 1, {"local_step": 400, "model": {}})
    out, asked, _ = _restore(tmp_path, monkeypatch, records, {"b": {"local_step": 450}})
    assert out.source.label == "b"  # ahead of the checkpoint
    save_checkpoint(tmp_path, RUN, 1, {"local_step": 600, "model": {}})
    out, asked, _ = _restore(tmp_path, monkeypatch, records, {"b": {"local_step": 450}})
    assert out.source.kind == "checkpoint" and asked == []  # no copy is ahead of it: nothing downloaded


def test_copies_of_vouched_holders_are_asked_before_strangers_announcing_more(tmp_path, monkeypatch):
    now = time.time()
    records = {f"sybil{i}": rec(f"sybil{i}", 0, 500, backup_stage=1, backup_step=10**6, backup_taken_at=now)
               for i in range(3)}
    records["h"] = rec("h", 0, 500, backup_stage=1, backup_step=450, backup_taken_at=now)
    delivered = {"h": {"local_step": 450}}  # the sybils' copies are refused by their witnesses: nothing delivered
    out, asked, _ = _restore(tmp_path, monkeypatch, records, delivered, trusted=["h"])
    assert out.source.label == "h" and asked == [["h"]]  # no stranger's copy downloaded first
    out, asked, _ = _restore(tmp_path, monkeypatch, records, delivered)  # nobody vouched for: by announced step
    assert out.source.label == "h" and [a[0] for a in asked] == ["sybil0", "sybil1", "sybil2", "h"]


def test_a_copy_behind_the_donor_is_not_fetched_one_ahead_wins_and_the_own_copy_counts(tmp_path, monkeypatch):
    records = {"d": rec("d", 1, 400), "a": rec("a", 0, 500, backup_stage=1, backup_step=300,
                                                  backup_taken_at=time.time())}
    out, asked, _ = _restore(tmp_path, monkeypatch, records, {"d": {"local_step": 400}})
    assert out.source.kind == "donor" and asked == [["d"]]  # the steady swarm: copies trail their donors
    # a whole-swarm restart: the donor came back behind a state its former peer now offers as a copy
    records["d"] = rec("d", 1, 10)
    out, asked, _ = _restore(tmp_path, monkeypatch, records, {"d": {"local_step": 10}, "a": {"local_step": 300}})
    assert out.source.kind == "spare" and out.source.label == "a" and asked == [["d"], ["a"]]
    own = SpareStore(RUN, None)
    own.offer(1, {"local_step": 77}, source="x", taken_at=time.time() - 5)
    out, asked, _ = _restore(tmp_path / "empty", monkeypatch, {"s0": rec("s0", 0, 90)}, {}, spare=own)
    assert out.source.kind == "spare" and out.source.label == "me" and out.state["local_step"] == 77


def test_a_donor_whose_record_outlives_it_does_not_hide_the_copies(tmp_path, monkeypatch):
    # the stage's only peer was killed a moment ago: its record still says "training" until it expires
    records = {"dead": rec("dead", 1, 320), "a": rec("a", 0, 500, backup_stage=1, backup_step=300,
                                                     backup_taken_at=time.time())}
    out, asked, _ = _restore(tmp_path, monkeypatch, records, {"a": {"local_step": 300}})
    assert asked == [["dead"], ["a"]]
    assert out.source.kind == "spare" and out.state["local_step"] == 300


def test_a_peer_that_came_back_on_another_stage_offers_its_former_checkpoint_as_a_copy(tmp_path):
    save_checkpoint(tmp_path, RUN, 0, {"local_step": 3216, "model": {}})
    save_checkpoint(tmp_path, RUN, 1, {"local_step": 3157, "model": {}})
    store = SpareStore(RUN, tmp_path)
    info = adopt_checkpoint(store, tmp_path, RUN, stage=1)
    assert info is not None and (info.stage, info.step) == (0, 3216)
    assert store.read(0)["local_step"] == 3216 and spare_fields(store.info)["backup_step"] == 3216
    assert adopt_checkpoint(store, tmp_path, RUN, stage=1) is None  # held already
    store.offer(0, {"local_step": 4000}, source="n", taken_at=time.time())
    assert adopt_checkpoint(store, tmp_path, RUN, stage=1) is None  # a more advanced copy of that stage is kept
    assert adopt_checkpoint(SpareStore(RUN, tmp_path / "x"), tmp_path / "x", RUN, stage=0) is None  # nothing held


def test_a_replica_that_starts_over_says_whether_the_stages_training_lives_on(tmp_path, monkeypatch):
    """A joiner whose donors were all refused by their witnesses starts from the seeded init. While other replicas of
    its stage train, the stage's training is not lost (a newcomer's default swarm showed "its training so far is
    lost" for a third stage-0 replica whose two donors disagreed early in training): the warning says which."""
    alive = {"r1": rec("r1", 1, 100), "r2": rec("r2", 1, 120), "s0": rec("s0", 0, 130)}
    _, asked, metrics = _restore(tmp_path, monkeypatch, alive, {})  # every donor's state refused: none delivered
    assert asked and [w["text"] for w in metrics.snapshot()["warnings"]] == [
        "stage 1: this replica starts from the run's seeded init while the swarm is at step 130: no donor, checkpoint "
        "or copy it could verify was available; the stage's 2 other replica(s) keep its training, and averaging pulls "
        "this one towards them"]
    _, _, metrics = _restore(tmp_path, monkeypatch, {"s0": rec("s0", 0, 130)}, {})  # the stage emptied
    texts = [w["text"] for w in metrics.snapshot()["warnings"]]
    assert len(texts) == 1 and texts[0].endswith("so its training so far is lost"), texts
