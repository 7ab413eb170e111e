"""tools/bench_links.py's pure parts: the codec runs, network names, and the figures against int8."""

from __future__ import annotations

import pytest

from tools.bench_links import codec_run, compare, markdown, parse_network, payload_per_token, wire_bytes_per_token
from trainer.config import RunConfig


def test_codec_runs_and_networks():
    base = RunConfig.default()
    sub = codec_run(base, "subspace-int4", 16)
    comp = sub.compression
    assert comp.subspace and comp.subspace_rank == 16 and comp.subspace_codec == "int4"
    assert codec_run(base, "int8", 16).run_id == base.run_id  # the baseline is the base run itself
    assert parse_network("20mbit-101ms") == (20.0, 50.5)
    with pytest.raises(ValueError):
        parse_network("20mbps")
    pay = payload_per_token(sub)
    window = (base.model.block_size + 1) / base.model.block_size  # 1-byte ids, the targets' last one per row
    assert pay["activations"] == 8 + window + 16 * 2 / 64 and pay["gradients"] == 8 + 16 * 2 / 64  # codes, scales
    pay3 = payload_per_token(codec_run(base, "subspace-int3", 16))
    assert pay3["activations"] == 6 + window + 16 * 2 / 64 and pay3["gradients"] == 6 + 16 * 2 / 64  # 3 bits a code
    d = base.model.n_embd
    # int8 codes, scales, int64 targets, and the token window the last stage re-checks forwards with
    assert payload_per_token(base)["activations"] == d + 2 * d / 128 + 8 + window


def test_figures_against_int8():
    def case(points, tokens):
        return {"curve": [{"t": t, "tokens": n, "val_loss": v} for t, n, v in points], "tokens": tokens,
                "tokens_per_s": tokens / 30, "final_val_loss": points[-1][2],
                "link_bytes": [{"stage": 0, "tx": 1000 * tokens, "rx": 0}, {"stage": 1, "tx": 10 * tokens, "rx": 0}]}
    cases = {"int8": case([(10, 100, 4.0), (20, 200, 3.0), (30, 300, 3.0)], 300),
             "subspace": case([(10, 300, 3.6), (20, 600, 2.5), (30, 900, 2.0)], 900)}
    compare(cases)
    s = cases["subspace"]
    assert s["time_to_loss"]["int8_s"] == pytest.approx(50 / 3) and 10 < s["time_to_loss"]["codec_s"] < 13
    assert s["time_to_loss_speedup_vs_int8"] > 1
    assert s["equal_tokens"]["tokens"] == 300 and s["equal_tokens_loss_ratio_vs_int8"] == pytest.approx(3.6 / 3.0)
    assert s["equal_tokens_at_evaluation"]["tokens"] == 300  # each curve has one evaluation in the common range
    assert s["equal_tokens_at_evaluation"]["ratio"] == pytest.approx(3.6 / 3.0)
    assert cases["int8"]["time_to_loss_speedup_vs_int8"] == 1.0
    assert wire_bytes_per_token(cases["subspace"], 2) == {"activations": 1000, "gradients": 10, "total": 1010}
    assert wire_bytes_per_token(cases["subspace"], 2, eval_tokens=900)["activations"] == 500
    framed = {"tokens": 100, "budget_s": 10.0, "link_bytes": [{"stage": 0, "tx": 5000, "rx": 0, "rpc_tx": 3000},
                                                                {"stage": 1, "tx": 4000, "rx": 0, "rpc_tx": 2000}]}
    wire = wire_bytes_per_token(framed, 2)
    assert wire["rpc_activations"] == 30 and wire["rpc_gradients"] == 20 and wire["rpc_total"] == 50
    assert wire["overhead_bytes_per_s"] == 400  # (2000 + 2000) bytes beyond the messages over 10 s
    for rec in cases.values():
        rec["bytes_per_token"] = {**wire_bytes_per_token(rec, 2),
                                  "payload": {"activations": 1, "gradients": 1, "fp32_activations": 512}}
    assert "| 20mbit-101ms | subspace |" in markdown({"networks": {"20mbit-101ms": cases}})


def test_both_swarm_benchmarks_give_every_option_their_swarms_read():
    """bench_links trains its swarms with bench_ttl's ``train_case``: every ``args.X`` that ``train_case`` and
    ``SwarmCase`` read must come out of both tools' command lines (a new swarm option once broke bench_links)."""
    import inspect
    import re

    from tools import bench_links, bench_ttl, swarm_case

    source = inspect.getsource(bench_ttl.train_case) + inspect.getsource(swarm_case.SwarmCase)
    read = set(re.findall(r"\bargs\.(\w+)", source))
    assert {"queue_ms", "slow_start_after_idle", "budget_s", "replicas"} <= read
    for args in (bench_links.parse_args([]), bench_ttl.parse_args([])):
        assert read <= set(vars(args)), sorted(read - set(vars(args)))
    assert "backup_every_s=0" in bench_links.parse_args([]).overrides
    paced = bench_links.parse_args(["--compute-pace", "4"]).overrides
    assert "compute_pace=4" in paced


def test_a_run_cut_short_keeps_the_swarms_it_finished(tmp_path, monkeypatch):
    """As bench_ttl: the first codec's swarm is in --json when the second is interrupted."""
    import json

    import tools.bench_links as bl

    trained: list[str] = []

    def fake_case(case, args, workdir, n_stages):
        trained.append(str(args.run))
        if len(trained) > 1:
            raise KeyboardInterrupt("signal 15")
        return {"label": "async/loopback", "mode": "async", "tokens": 512, "tokens_per_s": 51.2, "budget_s": 10.0,
                "curve": [{"t": 5.0, "tokens": 512, "val_loss": 3.0}], "final_val_loss": 3.0,
                "evals_per_replica": {"1": 1}, "link_bytes": [{"stage": 0, "tx": 5000, "rx": 0, "rpc_tx": 4000},
                                                               {"stage": 1, "tx": 5000, "rx": 0, "rpc_tx": 4000}]}

    monkeypatch.setattr(bl, "train_case", fake_case)
    monkeypatch.setattr(bl, "unwind_on_sigterm", lambda: None)
    monkeypatch.setattr(bl, "codec_costs", lambda run: {})
    out = tmp_path / "links.json"
    with pytest.raises(KeyboardInterrupt):
        bl.main(["--networks", "loopback", "--codecs", "int8", "subspace-int3", "--workdir", str(tmp_path / "w"),
                 "--json", str(out)])
    doc = json.loads(out.read_text())
    assert len(trained) == 2 and list(doc["networks"]["loopback"]) == ["int8"]
    assert doc["meta"]["partial"] and doc["networks"]["loopback"]["int8"]["bytes_per_token"]["total"] > 0
