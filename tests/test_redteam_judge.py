"""The red team's judge (tools/redteam_swarm.py): which pipelines it assembles, the ratio against the twin, and the
loss of weights fetched through the state RPC from a state server in this process, evaluated here."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hivemind.p2p import P2P

from peer.ops.metrics import PeerMetrics
from peer.state.sync import StateServer
from protocol.limits import RpcLimits
from protocol.rpc import RpcServer
from tools.redteam import outcome
from tools.redteam_swarm import Judge, Verdict, pipeline_loss, pipelines, ratio, stall_and_loss
from trainer.config import RunConfig
from trainer.worker import StageWorker

TINY = Path(__file__).resolve().parent / "runs" / "tiny.toml"


def test_pipelines_pair_replicas_and_put_extra_peers_in_place_of_replica_0() -> None:
    layout = [["v00", "v01"], ["v10", "v11"]]
    assert pipelines(layout, {}) == {"r0": ["v00", "v10"], "r1": ["v01", "v11"]}
    assert pipelines(layout, {"pw": 1}) == {"r0": ["v00", "v10"], "r1": ["v01", "v11"], "pw": ["v00", "pw"]}
    assert pipelines([["a"], ["b", "c"]], {}) == {"r0": ["a", "b"], "r1": ["a", "c"]}  # uneven: the last replica


def test_ratio_is_against_the_twin_at_the_same_moment_and_drives_the_outcome() -> None:
    assert ratio(2.2, 2.0) == 1.1 and ratio(None, 2.0) is None and ratio(2.0, None) is None
    v = Verdict(losses={"r0": 2.0, "r1": 3.0, "pw": 5.0})
    assert v.mean(["r0", "r1"]) == 2.5 and v.mean() == 10 / 3
    assert outcome(0.5, 1.04, refused=True) == "refused"
    assert outcome(0.5, 1.06, refused=True) == "degraded"
    assert outcome(6.0, 1.0, refused=True) == "stalled"


def test_stall_is_the_longest_stretch_without_a_new_step() -> None:
    samples = [(1.0, 5, 2.0), (2.0, 6, None), (5.5, 6, 1.9), (6.0, 7, None)]
    stall, loss = stall_and_loss(samples, 0.0, 7.0)
    assert stall == 4.0 and loss == 1.9  # from the step at 2.0 to the next at 6.0


def test_pipeline_loss_reads_the_weights_not_a_report() -> None:
    run = RunConfig.from_toml(TINY)
    workers = [StageWorker(run, s) for s in range(run.n_stages)]
    x = torch.randint(0, run.model.vocab_size, (run.data.batch_size, run.model.block_size))
    batches = [(x, torch.roll(x, -1, dims=1))]
    init = pipeline_loss(run, [w.model.state_dict() for w in workers], batches)
    assert abs(init - math.log(run.model.vocab_size)) < 0.3  # the seeded init predicts about uniformly
    ruined = dict(workers[1].model.state_dict())
    ruined["lm_head.weight"] = torch.randn_like(ruined["lm_head.weight"]) * 10  # confidently wrong
    assert pipeline_loss(run, [workers[0].model.state_dict(), ruined], batches) > init + 1.0


def test_the_judge_fetches_a_peers_weights_through_the_state_rpc(tmp_path: Path) -> None:
    run = RunConfig.from_toml(TINY)
    worker = StageWorker(run, 1)
    with torch.no_grad():
        for p in worker.model.parameters():
            p.add_(0.01)

    async def main() -> tuple[dict[str, torch.Tensor] | None, float]:
        server_p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        rpc = RpcServer(server_p2p, RpcLimits())

        async def worker_call(fn: Callable[[StageWorker], Any]) -> Any:
            return fn(worker)

        state = StateServer(p2p=server_p2p, rpc_server=rpc, run=run, stage=1, worker_call=worker_call,
                            metrics=PeerMetrics("served", 1))
        await state.start()
        state.ready = True
        maddrs = [str(m) for m in await server_p2p.get_visible_maddrs()]
        judge = Judge(run, tmp_path / "judge.key", eval_batches=1)
        try:
            await judge.start(maddrs)
            got = await judge.weights(server_p2p.peer_id.to_base58(), maddrs, 1)
            stage0 = StageWorker(run, 0).model.state_dict()
            loss = pipeline_loss(run, [stage0, got], judge.batches) if got is not None else float("nan")
        finally:
            await judge.close()
            await rpc.shutdown()
            await server_p2p.shutdown()
        return got, loss

    got, loss = asyncio.run(main())
    assert got is not None
    for k, v in worker.model.state_dict().items():
        assert torch.equal(got[k], v), k
    assert math.isfinite(loss)


def test_a_groups_control_and_liveness_go_under_groups_its_attacks_on_top() -> None:
    from tools.redteam import _merge
    results: dict[str, Any] = {"groups": {}}
    _merge(results, "2x2", {"control": [{"honest_val_loss_ratio": 1.02}], "victims_alive": True, "twin_alive": True,
                            "witness_sybils": {"outcome": "degraded"}})
    _merge(results, "1x2", {"error": "PeerProcessError: v00 gave no training within 180 s"})
    assert results["groups"]["2x2"] == {"control": [{"honest_val_loss_ratio": 1.02}], "victims_alive": True,
                                        "twin_alive": True}
    assert results["witness_sybils"] == {"outcome": "degraded"}
    assert results["groups"]["1x2"]["error"].startswith("PeerProcessError")
