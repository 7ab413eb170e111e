"""Peer configuration, command-line parsing, swarm summaries and small daemon helpers (no network)."""

from __future__ import annotations

import argparse

import pytest

from peer.cli import join as cmd_join
from peer.cli import swarm as cmd_swarm
from peer.config import PeerConfig
from peer.errors import UserError
from peer.membership.reachability import is_public_unroutable, tcp_targets
from peer.ops.procs import PeerProcess


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cmd_join.add_arguments(p)
    return p.parse_args(list(argv))


def test_join_arguments_build_the_configs():
    run, cfg = cmd_join.build_config(parse("--stage", "1", "--initial-peers", "/ip4/1.2.3.4/tcp/5/p2p/Qm",
                                           "--max-steps", "7", "--mode", "sync", "--set", "eval_every_s=2.5",
                                           "--set", "hop_retries=9"))
    assert cfg.stage == 1 and cfg.initial_peers == ("/ip4/1.2.3.4/tcp/5/p2p/Qm",) and cfg.max_steps == 7
    assert cfg.mode == "sync" and cfg.eval_every_s == 2.5 and cfg.hop_retries == 9
    assert run.run_id == type(run).default().run_id
    assert cmd_join.build_config(parse("--stage", "auto"))[1].stage is None


@pytest.mark.parametrize("item, match", [("nope=1", "FIELD=VALUE"), ("hop_retries=x", "hop_retries"),
                                         ("use_ipfs=maybe", "true or false"), ("eval_every_s", "FIELD=VALUE")])
def test_bad_overrides_say_what_to_fix(item, match):
    with pytest.raises(UserError, match=match):
        cmd_join.parse_overrides([item])


@pytest.mark.parametrize("stage, match", [("first", "'auto' or a stage number"), ("-1", ">= 0, got -1")])
def test_bad_stage_is_a_one_line_user_error(stage, match):
    with pytest.raises(UserError, match=match):
        cmd_join.build_config(parse("--stage", stage))


@pytest.mark.parametrize("kw, match", [
    (dict(stage=-1), "--stage"), (dict(device="tpu"), "--device"), (dict(mode="fast"), "--mode"),
    (dict(rpc_timeout_s=0), "rpc_timeout_s"), (dict(record_ttl_s=5, announce_every_s=5), "record_ttl_s"),
    (dict(rebalance_quality=1.5), "rebalance_quality"), (dict(metrics_port=70000), "metrics-port"),
    (dict(max_queue=0), "max_queue"), (dict(eval_every_s=-1), "eval_every_s"),
    (dict(recheck_after_warmups=-1.0), "recheck_after_warmups"), (dict(throughput=-1.0), "throughput"),
    (dict(throughput=float("inf")), "throughput"),
])
def test_peer_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        PeerConfig(**kw)


def test_inflight_fills_the_pipeline_unless_set():
    assert PeerConfig().inflight_for(3) == 4
    assert PeerConfig(max_inflight=9).inflight_for(3) == 9


def test_swarm_summary_sums_stage0_throughput_and_counters():
    peers = [dict(stage=0, tokens_per_s=100.0, steps=10, initial_loss=5.0, final_loss=3.0, final_val_loss=3.1,
                  microbatches_dropped=1, microbatches_requeued=1, averaging_rounds_ok=2, spotcheck_sent=5,
                  recheck_passed=7, recheck_failed=1),
             dict(stage=0, tokens_per_s=50.0, steps=12, initial_loss=5.2, final_loss=3.2, final_val_loss=None,
                  microbatches_dropped=0, microbatches_requeued=0, averaging_rounds_ok=3),
             dict(stage=1, tokens_per_s=999.0, steps=30, final_loss=3.0, averaging_rounds_failed=1),
             dict(stage=0, tokens_per_s=0.0, steps=0, initial_loss=None, final_loss=None)]  # started as it ended
    s = cmd_swarm.merge_summaries(peers, mode="async")
    assert s["tokens_per_s"] == 150.0 and s["steps"] == 10 and len(s["per_peer"]) == 4
    assert s["initial_loss"] == pytest.approx(5.1) and s["final_val_loss"] == pytest.approx(3.1)
    assert s["averaging_rounds_ok"] == 5 and s["averaging_rounds_failed"] == 1 and s["microbatches_dropped"] == 1
    assert s["spotcheck_sent"] == 5  # micro-batches stage 1 trained twice: its tokens exceed stage 0's by them
    assert s["recheck_passed"] == 7 and s["recheck_failed"] == 1 and s["spotcheck_failed"] == 0


def test_swarm_refuses_fewer_peers_than_stages():
    p = argparse.ArgumentParser()
    cmd_swarm.add_arguments(p)
    with pytest.raises(UserError, match="at least 2"):
        cmd_swarm.run(p.parse_args(["--peers", "1"]))


class _Proc:
    def __init__(self, returncode: int | None) -> None:
        self.returncode = returncode

    def poll(self) -> int | None:
        return self.returncode


def test_swarm_ends_when_stage0_is_done_or_a_stage_is_left_without_live_peers(tmp_path):
    swarm = cmd_swarm.Swarm(argparse.Namespace(), tmp_path)

    def state(*peers: tuple[int, int | None]) -> str | None:  # (stage, exit code or None while alive)
        swarm.children = [PeerProcess(f"peer{i}", _Proc(rc), tmp_path, 0, i=i) for i, (_, rc) in enumerate(peers)]
        swarm.status = {i: {"stage": stage} for i, (stage, _) in enumerate(peers)}
        return swarm.finished(2)

    assert state((0, None), (1, None), (0, None), (1, None)) is None
    assert state((0, None), (1, None), (0, 0), (1, None)) is None  # one stage-0 replica done, the other trains on
    assert "every stage-0 peer" in state((0, 0), (1, None), (0, 0), (1, None))
    # the hang this rule fixes: stage 1 finished its --max-steps, a late stage-0 peer would wait for it forever
    reason = state((1, 0), (0, 0), (0, 0), (0, None))
    assert reason is not None and "stage 1 has no live peer" in reason and "peer0 exited (code 0)" in reason
    assert "stage 1 has no live peer" in state((0, None), (1, 137))  # a crash that empties a stage ends it too


def test_reachability_targets():
    maddrs = ["/ip4/1.2.3.4/tcp/31337/p2p/QmX", "/ip4/127.0.0.1/tcp/5", "/ip6/::1/udp/3", "/dns/x/tcp/1"]
    assert tcp_targets(maddrs) == [("1.2.3.4", 31337), ("127.0.0.1", 5)]
    assert is_public_unroutable("127.0.0.1") and is_public_unroutable("0.0.0.0")
    assert not is_public_unroutable("1.2.3.4")
