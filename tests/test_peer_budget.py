"""Memory-aware stage choice: the limit a peer may use, the stages that fit, and the errors at start."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from peer.budget import memory_limit, plan
from peer.cli import join as cmd_join
from peer.config import PeerConfig
from peer.daemon import Daemon
from peer.errors import UserError
from peer.ops.dashboard import memory_text
from peer.ops.metrics import PeerMetrics
from trainer.config import RunConfig
from trainer.memory import HEADROOM, GiB

RUN = RunConfig.default()


def between_gb(run: RunConfig, small: int, large: int) -> float:
    """A --memory-gb under which stage ``small`` fits and stage ``large`` does not (on the CPU)."""
    b = plan(run, device="cpu", precision="fp32", inflight=run.n_stages + 1, memory_gb=1.0)
    lo, hi = b.needs(small) * HEADROOM, b.needs(large) * HEADROOM
    assert lo < hi
    return (lo + hi) / 2 / GiB


def test_limit_sources():
    assert memory_limit("cpu", 2.5) == (int(2.5 * GiB), "--memory-gb")
    limit, source = memory_limit("cpu", 0.0)
    assert source == "available RAM" and limit is not None and limit > 0


def test_the_budget_lists_what_fits():
    b = plan(RUN, device="cpu", precision="fp32", inflight=3, memory_gb=between_gb(RUN, 1, 0))
    assert b.fitting == (1,)
    assert b.fits(1) and not b.fits(0)
    b.check_stage(1)
    b.check_stage(None)
    d = b.as_dict(1)
    assert d["fits"] == [1] and d["estimate_bytes"] == b.needs(1) and d["precision"] == "fp32"
    assert plan(RUN, device="cpu", precision="fp32", inflight=3, memory_gb=64).fitting == (0, 1)


def test_a_fixed_stage_that_does_not_fit_says_what_fits_and_what_to_do():
    b = plan(RUN, device="cpu", precision="fp32", inflight=3, memory_gb=between_gb(RUN, 1, 0))
    with pytest.raises(UserError) as e:
        b.check_stage(0)
    msg = str(e.value)
    assert "--stage 0 needs" in msg and "stages that fit: 1" in msg and "--stage 1 or --stage auto" in msg
    assert "--memory-gb" in msg and "bf16" in msg


def test_no_stage_fits_is_a_clear_error():
    b = plan(RUN, device="cpu", precision="fp32", inflight=3, memory_gb=0.001)
    assert b.fitting == ()
    with pytest.raises(UserError, match="no stage of this run fits .* stage 0 .* stage 1 .*asyncmesh-peer memory"):
        b.check_stage(None)


def test_the_daemon_refuses_at_start_and_reports_the_budget():
    gb = between_gb(RUN, 1, 0)
    with pytest.raises(UserError, match="--stage 0 needs"):
        Daemon(RUN, PeerConfig(stage=0, device="cpu", memory_gb=gb, backup_every_s=0))
    with pytest.raises(UserError, match="no stage of this run fits"):
        Daemon(RUN, PeerConfig(device="cpu", memory_gb=0.001))
    metrics = PeerMetrics()
    metrics.memory = plan(RUN, device="cpu", precision="fp32", inflight=3, memory_gb=gb).as_dict()
    metrics.stage = 1
    snap = metrics.snapshot()["memory"]
    assert snap["fits"] == [1] and snap["estimate_bytes"] == snap["stage_bytes"][1]
    assert snap["limit_source"] == "--memory-gb"
    text = memory_text(snap).plain
    assert text.startswith("needs ") and "(fp32) of" in text and "fits stage 1" in text


def test_a_neighbour_copy_kept_in_memory_counts_on_the_cpu_only():
    plain = plan(RUN, device="cpu", precision="fp32", inflight=3, memory_gb=64)
    kept = plan(RUN, device="cpu", precision="fp32", inflight=3, memory_gb=64, spare_in_memory=True)
    e1 = plain.estimates[1]
    # stage 1's state, EMA included; its weights are the re-check copy's already (the module shares them)
    assert kept.needs(0) == plain.needs(0) + e1.weights + e1.optimizer + e1.weights - e1.weights
    assert kept.as_dict(0)["estimate_bytes"] == kept.needs(0)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_copies_re_checks_compute_with_count_on_the_device(device, monkeypatch):
    """Every stage but the last holds the next stage's weights for its re-checks, and stage 1 stage 0's as well
    (2 stages: the last stage's neighbour copy; 3 or more: a private copy)."""
    import peer.budget

    monkeypatch.setattr(peer.budget, "memory_limit", lambda device, gb: (64 * GiB, "test"))
    run3 = RUN.replace(n_stages=3, model={"n_layer": 3})
    assert [peer.budget.recheck_stages(3, s) for s in range(3)] == [(1,), (2, 0), ()]
    assert [peer.budget.recheck_stages(2, s) for s in range(2)] == [(1,), (0,)]
    for run in (RUN, run3):
        on = plan(run, device=device, precision="fp32", inflight=3)
        off = plan(run, device=device, precision="fp32", inflight=3, rechecks=False)
        w = [e.weights for e in on.estimates]
        n = run.n_stages
        want = [w[1], w[0]] if n == 2 else [w[1], w[2] + w[0], 0]
        assert [on.needs(s) - off.needs(s) for s in range(n)] == want, run.n_stages


def test_a_model_the_estimate_cannot_build_trains_unchecked(monkeypatch):
    import peer.budget

    def broken(*a, **k):
        raise NotImplementedError("no meta kernel for some op")

    monkeypatch.setattr(peer.budget, "estimate_stage", broken)
    b = plan(RUN, device="cpu", precision="fp32", inflight=3, memory_gb=0.001)
    assert b.fitting is None and b.limit_bytes is None and "failed" in b.source
    b.check_stage(1)  # no refusal without an estimate
    metrics = PeerMetrics()
    metrics.memory = b.as_dict()
    assert "not estimated" in memory_text(metrics.snapshot()["memory"]).plain


def test_join_flags_build_the_config():
    args = cmd_join.build_config(_parse("--precision", "bf16", "--memory-gb", "6.5"))[1]
    assert args.precision == "bf16" and args.memory_gb == 6.5
    with pytest.raises(ValueError, match="--memory-gb"):
        PeerConfig(memory_gb=-1)
    with pytest.raises(ValueError, match="--precision"):
        PeerConfig(precision="fp16")


def _parse(*argv: str):
    import argparse

    p = argparse.ArgumentParser()
    cmd_join.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.slow  # a whole `asyncmesh-peer join` process: ~5 s on an idle machine
def test_join_with_a_stage_that_does_not_fit_fails_at_start_in_one_line():
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-m", "peer.cli", "join", "--no-tui", "--device", "cpu", "--stage", "0",
                          "--memory-gb", f"{between_gb(RUN, 1, 0):.6f}", "--set", "backup_every_s=0"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]  # after the peer's log lines
    assert last.startswith("asyncmesh-peer join: error: --stage 0 needs"), out.stderr
    assert "stages that fit: 1" in last and "15 % headroom" in last
