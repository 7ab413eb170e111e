"""/metrics through prometheus_client: counters from 0, conventional names, build, process metrics; /status complete;
warnings that expire; one peer-id abbreviation."""

from __future__ import annotations

import asyncio
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from peer.ids import short_id
from peer.ops.metrics import KNOWN_COUNTERS, PeerMetrics
from peer.ops.prom import peer_registry, prometheus_text, render
from peer.ops.status_server import StatusServer, fetch_status


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def samples(text: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_every_known_counter_is_exposed_from_zero_with_conventional_names():
    m = PeerMetrics("12D3KooWpeer")
    got = samples(prometheus_text(m.snapshot()))
    for name in ("asyncmesh_microbatches_dropped_total", "asyncmesh_bytes_received_total",
                 "asyncmesh_bytes_sent_total", "asyncmesh_tokens_total", "asyncmesh_retries_total",
                 "asyncmesh_averaging_rounds_failed_total"):
        assert got[name] == 0, name
    assert got['asyncmesh_rejected_total{reason="wrong_run"}'] == 0
    assert len([k for k in got if k.endswith("_total") and "{" not in k]) >= len(KNOWN_COUNTERS)
    assert not any(k.startswith(("asyncmesh_bytes_in", "asyncmesh_bytes_out")) for k in got)
    m.inc("bytes_in", 500)
    m.inc("microbatches_dropped")
    m.inc("rejected:bad_tensor", 2)
    got = samples(prometheus_text(m.snapshot()))
    assert got["asyncmesh_bytes_received_total"] == 500 and got["asyncmesh_microbatches_dropped_total"] == 1
    assert got['asyncmesh_rejected_total{reason="bad_tensor"}'] == 2


def test_build_info_process_metrics_and_the_complete_status():
    m = PeerMetrics("12D3KooWpeer")
    m.run_id, m.run_name, m.device, m.n_stages = "abc123", "test-tiny", "cpu", 2
    m.maddrs = ["/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWpeer"]
    text = render(peer_registry(m.snapshot))
    got = samples(text)
    build = next(k for k in got if k.startswith("asyncmesh_build_info"))
    assert 'run_id="abc123"' in build and 'run_name="test-tiny"' in build and 'device="cpu"' in build
    assert re.search(r'torch="\d+\.\d+', build), build
    assert got["process_resident_memory_bytes"] > 0 and "process_cpu_seconds_total" in got
    assert got["asyncmesh_stages"] == 2
    assert not any(k.startswith("asyncmesh_gpu_") for k in got)  # a CPU peer has no GPU series
    snap = m.snapshot()
    assert snap["n_stages"] == 2 and snap["maddrs"] == m.maddrs and snap["run_name"] == "test-tiny"


def test_a_warning_disappears_when_resolved_or_after_its_ttl():
    clock = Clock()
    m = PeerMetrics(clock=clock, warning_ttl_s=60)
    m.warn("no reachable peer serves stage 1 (...)", key="no_route:1")
    m.warn("checkpoint failed: disk full")
    assert len(m.snapshot()["warnings"]) == 2
    m.resolve("no_route:1")  # a route works again: the warning is no longer true
    assert [w["text"] for w in m.snapshot()["warnings"]] == ["checkpoint failed: disk full"]
    clock.t += 59
    assert len(m.snapshot()["warnings"]) == 1
    clock.t += 2  # not repeated for longer than the TTL
    assert m.snapshot()["warnings"] == []
    m.resolve("nothing")  # no-op


def test_metrics_are_served_over_http_by_the_status_server():
    async def main() -> str:
        m = PeerMetrics("12D3KooWpeer")
        async with StatusServer(m, port=0) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            raw = await reader.read()
            writer.close()
            assert (await fetch_status("127.0.0.1", server.port))["peer_id"] == "12D3KooWpeer"
        return raw.decode()

    raw = asyncio.run(main())
    assert raw.startswith("HTTP/1.1 200") and "asyncmesh_microbatches_dropped_total 0.0" in raw


@pytest.mark.parametrize("pid, short", [("12D3KooWAbCdEfGhIjKlMnOp", "…IjKlMnOp"), ("Qm123", "Qm123"), ("", "?")])
def test_one_peer_id_abbreviation(pid, short):
    assert short_id(pid) == short
    if len(pid) > 9:
        assert len(short_id(pid)) == 9 and pid.endswith(short_id(pid)[1:])


def test_gpu_memory_and_utilisation_on_a_cuda_device(monkeypatch):
    import torch

    for name, value in (("is_available", True), ("is_initialized", True), ("memory_allocated", 1000),
                        ("memory_reserved", 2000), ("max_memory_allocated", 1500)):
        monkeypatch.setattr(torch.cuda, name, lambda *a, v=value, **k: v)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (5000, 8000))
    monkeypatch.setattr(torch.cuda, "utilization", lambda *a, **k: 37)
    m = PeerMetrics("p")
    m.device = "cuda"
    got = samples(render(peer_registry(m.snapshot, process=False)))
    assert got['asyncmesh_gpu_memory_allocated_bytes{device="cuda"}'] == 1000
    assert got['asyncmesh_gpu_memory_total_bytes{device="cuda"}'] == 8000
    assert got['asyncmesh_gpu_utilization_ratio{device="cuda"}'] == pytest.approx(0.37)

    def no_nvml(*a: object, **k: object) -> int:
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(torch.cuda, "utilization", no_nvml)  # without NVML: memory only, no error
    got = samples(render(peer_registry(m.snapshot, process=False)))
    assert "asyncmesh_gpu_memory_reserved_bytes{device=\"cuda\"}" in got
    assert not any("utilization" in k for k in got)


def test_the_memory_estimate_and_limit_are_exposed_for_the_stage_served():
    m = PeerMetrics("12D3KooWpeer")
    assert not any(k.startswith("asyncmesh_memory_") for k in samples(prometheus_text(m.snapshot())))
    m.memory = {"limit_bytes": 8 * 2**30, "limit_source": "--memory-gb", "precision": "bf16", "headroom": 1.15,
                "device_type": "cuda", "stage_bytes": [3 * 2**30, 5 * 2**30], "fits": [0, 1]}
    m.stage = 1
    got = samples(prometheus_text(m.snapshot()))
    assert got["asyncmesh_memory_estimate_bytes"] == 5 * 2**30 and got["asyncmesh_memory_limit_bytes"] == 8 * 2**30
