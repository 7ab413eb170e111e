"""Generation through a live 2-stage swarm: `asyncmesh-peer generate --initial-peers` against the exported model.

One swarm serves every check of this module (it costs most of the time). It trains a frozen variant of the tiny run:
the same model with a learning rate of 1e-30, so every step leaves the weights as they were (an update of 1e-30 is
below the last bit of weights around 1e-2) while the peers forward, backward, step and announce like any swarm. Its
weights at generation time are thus those `export` fetches afterwards, and greedy generation through the pipeline
must give exactly what the exported model gives.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from swarm_utils import TINY_RUN, Swarm

from peer.cli import main
from trainer.config import RunConfig
from trainer.export import load_model

pytestmark = pytest.mark.timeout(300)

PROMPT = "def "


@pytest.fixture(scope="module")
def frozen(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    run_file = root / "frozen.toml"
    text = TINY_RUN.read_text()
    assert "lr = 3e-3" in text
    run_file.write_text(text.replace("lr = 3e-3", "lr = 1e-30"))
    swarm = Swarm(root)
    try:
        a = swarm.start("a", stage="0", run=run_file)
        b = swarm.start("b", stage="1", run=run_file, initial=a.wait_maddrs()[:1])
        for p in (a, b):
            p.wait_status(lambda s: s.get("state") == "training" and s.get("local_step", 0) >= 2, 150, "training")
        yield run_file, a, b
    finally:
        swarm.reap()


@pytest.fixture(scope="module")
def exported(frozen, tmp_path_factory):
    """The swarm's model, exported live (the weights generation ran on: they do not move)."""
    run_file, a, _ = frozen
    out = tmp_path_factory.mktemp("model")
    assert main(["export", "--run", str(run_file), "--initial-peers", *a.wait_maddrs()[:1], "--out", str(out)]) == 0
    return out


def _generate(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["generate", "--prompt", PROMPT, "--max-new-tokens", "16", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_greedy_and_seeded_generation_through_the_swarm_equal_the_exported_model(frozen, exported, capsys):
    run_file, a, b = frozen
    live = ["--initial-peers", b.wait_maddrs()[0], "--run", str(run_file)]
    code, greedy, err = _generate(capsys, *live, "--temperature", "0", "--codec", "none")
    assert code == 0, err
    assert greedy.startswith(PROMPT) and len(greedy.encode("utf-8", errors="replace")) >= len(PROMPT) + 1
    assert "16 tokens in" in err and "through 2 stages" in err
    code, seeded, err = _generate(capsys, *live, "--temperature", "0.8", "--seed", "3", "--codec", "none")
    assert code == 0, err
    assert _generate(capsys, "--model", str(exported), "--temperature", "0")[1] == greedy
    assert _generate(capsys, "--model", str(exported), "--temperature", "0.8", "--seed", "3")[1] == seeded
    code, _, err = _generate(capsys, "--initial-peers", b.wait_maddrs()[0], "--run", str(TINY_RUN))  # another run
    assert code == 2 and f"trains run {RunConfig.from_toml(run_file).run_id}" in err
    assert len(err.strip().splitlines()) == 1


def test_the_run_codec_logits_and_the_handler_refusals_on_live_peers(frozen, exported):
    run_file, a, b = frozen
    run = RunConfig.from_toml(run_file)
    steps = {p.name: p.status()["local_step"] for p in (a, b)}
    model, _ = load_model(exported)
    ids = list(b"import os\nfrom pathlib import P")  # within the block size (32)
    with torch.no_grad():
        expected = model(torch.tensor([ids]))[:, -1]

    async def body() -> dict:
        from hivemind import DHT

        from peer.membership.records import fetch_swarm, record_validator
        from peer.pipeline.infer import INFER_RPC
        from peer.pipeline.remote import RemotePipeline, rpc_call
        from protocol.codecs.registry import encode
        from protocol.errors import ErrorCode, RemoteError
        from protocol.messages import Infer
        from protocol.rpc import call

        dht = await asyncio.to_thread(DHT, initial_peers=a.wait_maddrs()[:1], client_mode=True, start=True,
                                      record_validators=[record_validator(run.run_id)])
        try:
            p2p = await dht.replicate_p2p()
            remote = RemotePipeline(run=run, call=rpc_call(p2p, 1 << 20),
                                    read_swarm=lambda: fetch_swarm(dht, run.run_id, timeout=5.0))
            await remote.wait_for_stages(30.0)
            got = {codec: await RemotePipeline(run=run, call=remote.call, read_swarm=remote.read_swarm,
                                               codec=codec).next_logits(ids) for codec in ("int8", "none")}
            ids_b = {r.stage: r.peer_id for r in remote.records.values()}
            codes = {}
            bad = {"oversize": Infer(run.run_id, 1, encode(torch.randn(1, 8 * run.model.block_size,
                                                                       run.model.n_embd), "none"), "none"),
                   "shape": Infer(run.run_id, 1, encode(torch.randn(1, 4, run.model.n_embd + 1), "none"), "none"),
                   "run": Infer("another-run", 1, encode(torch.randn(1, 4, run.model.n_embd), "none"), "none")}
            for name, msg in bad.items():
                try:
                    await call(p2p, ids_b[1], INFER_RPC, msg, timeout=10.0)
                except RemoteError as e:
                    codes[name] = e.code
            assert codes == {"oversize": ErrorCode.TOO_LARGE, "shape": ErrorCode.BAD_REQUEST,
                             "run": ErrorCode.WRONG_RUN}
            return got
        finally:
            await asyncio.to_thread(dht.shutdown)

    got = asyncio.run(body())
    torch.testing.assert_close(got["none"], expected, rtol=1e-4, atol=1e-4)
    assert (got["int8"] - expected).abs().max() <= 0.05 * expected.abs().max()
    status = b.status()
    assert status["state"] == "training" and status["counters"]["infer_served"] >= 2
    assert status["rejected"]["infer_bad_request"] >= 1 and status["rejected"]["infer_wrong_run"] >= 1
    for p in (a, b):  # the swarm kept training meanwhile
        p.wait_status(lambda s, p=p: s["local_step"] > steps[p.name], 60, "training on")
