"""The GPU path, exercised on the CPU where it can be: bf16 autocast in the worker (fp32 master weights), codecs that
encode on the tensor's device and copy only the encoded tensors to the host. The CUDA cases run only where torch sees
a GPU."""

from __future__ import annotations

import pytest
import torch

import protocol.codecs.registry as registry
from protocol.codecs import quant
from protocol.codecs.registry import decode, encode
from trainer.config import RunConfig
from trainer.worker import StageWorker, resolve_precision

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
FLOAT_CODECS = ("fp16", "bf16", "int8", "int4")


def tiny(n_stages: int = 2, arch: str = "gpt") -> RunConfig:
    return RunConfig.default().replace(
        n_stages=n_stages, model={"arch": arch, "n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 16,
                                  "vocab_size": 64},
        optim={"warmup_steps": 0, "total_steps": 200, "lr": 3e-3}, data={"batch_size": 4})


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (4, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)  # a learnable task: predict the next token of a rotation


def train(workers: list[StageWorker], steps: int) -> list[float]:
    losses = []
    for mb in range(steps):
        x, y = batch(mb % 4)
        h = workers[0].forward(mb, x)
        assert h.dtype == torch.float32  # what crosses the wire stays fp32 whatever the precision
        loss, g = workers[1].forward_loss(mb, h, y)
        assert g is not None and g.dtype == torch.float32
        workers[0].backward(mb, g)
        losses.append(loss)
    return losses


def test_precision_resolution():
    assert resolve_precision("auto", "cpu") == "fp32"
    assert resolve_precision("auto", "cuda") == "bf16"
    assert resolve_precision("bf16", "cpu") == "bf16"
    with pytest.raises(ValueError, match="precision"):
        resolve_precision("fp16", "cpu")


def test_a_bf16_worker_computes_in_bf16_and_keeps_fp32_master_state():
    run = tiny()
    workers = [StageWorker(run, s, precision="bf16") for s in range(2)]
    seen: list[torch.dtype] = []
    workers[0].model.blocks[0].mlp.c_fc.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    losses = train(workers, 30)
    assert seen and set(seen) == {torch.bfloat16}  # forwards and recomputes ran under autocast
    for w in workers:
        assert w.local_step == 30
        assert all(p.dtype == torch.float32 for p in w.parameters())
        for state in w.optimizer.state.values():
            assert all(v.dtype == torch.float32 for v in state.values() if torch.is_tensor(v) and v.dim())
    assert sum(losses[-8:]) / 8 < losses[0] - 0.5  # it trains


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_bf16_starts_where_fp32_starts(arch):
    x, y = batch(0)
    out = {}
    for precision in ("fp32", "bf16"):
        w = [StageWorker(tiny(arch=arch), s, precision=precision, auto_step=False) for s in range(2)]
        out[precision] = w[1].forward_loss(0, w[0].forward(0, x), y)[0]
    assert out["bf16"] == pytest.approx(out["fp32"], rel=0.02)


def test_bf16_with_weight_stashing_backwards_at_the_forward_weights():
    """Two micro-batches in flight on stage 0: the second backward must run at the weights of its forward even
    though the first one's step changed them, under autocast as without."""
    run = tiny()
    w0, w1 = (StageWorker(run, s, precision="bf16") for s in range(2))
    (xa, ya), (xb, yb) = batch(0), batch(1)
    ha, hb = w0.forward(0, xa), w0.forward(1, xb)
    _, ga = w1.forward_loss(0, ha, ya)
    _, gb = w1.forward_loss(1, hb, yb)
    w0.backward(0, ga)
    assert w0.stashed_versions() == [0]  # the weights micro-batch 1 was forwarded at
    w0.backward(1, gb)
    assert w0.stashed_versions() == [] and w0.local_step == 2


def encoded_parts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.Tensor, ...]]:
    seen: list[tuple[torch.Tensor, ...]] = []
    real = registry.to_host

    def spy(parts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        seen.append(parts)
        return real(parts)

    monkeypatch.setattr(registry, "to_host", spy)
    return seen


@pytest.mark.parametrize("codec", FLOAT_CODECS)
def test_only_the_encoded_tensors_cross_to_the_host(codec, monkeypatch):
    seen = encoded_parts(monkeypatch)
    t = torch.randn(4, 16, 32)
    env = encode(t, codec)
    assert len(seen) == 1
    assert sum(p.numel() * p.element_size() for p in seen[0]) == len(env.data)  # never the fp32 tensor itself
    if codec == "int8":
        assert [p.dtype for p in seen[0]] == [torch.bfloat16, torch.int8]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", FLOAT_CODECS)
def test_payload_is_the_same_encoded_before_or_after_the_host_copy(device, codec):
    t = torch.randn(3, 50, 40) * torch.logspace(-3, 2, 40)  # blocks of very different scales
    on_device, on_host = encode(t.to(device), codec), encode(t, codec)
    assert (on_device.codec, on_device.dtype, on_device.shape) == (on_host.codec, on_host.dtype, on_host.shape)
    assert bool(((decode(on_host).reshape(-1) - t.reshape(-1)).abs() <= one_step(t, codec) + 6e-8).all())
    if on_device.data == on_host.data:
        return
    assert device != "cpu", "the CPU path must give exactly the host's bytes"
    # a GPU may round a few values the other way: within one step of the codec
    a, b = decode(on_device).reshape(-1), decode(on_host).reshape(-1)
    assert bool(((a - b).abs() <= one_step(t, codec) * 1.001 + 6e-8).all())


def one_step(t: torch.Tensor, codec: str) -> torch.Tensor:
    """The distance between neighbouring codes at each value of ``t`` under ``codec`` (flat)."""
    flat = t.reshape(-1).float()
    if codec in ("fp16", "bf16"):
        return flat.abs() * {"fp16": 2.0**-10, "bf16": 2.0**-7}[codec]
    block = quant.INT8_BLOCK if codec == "int8" else quant.INT4_BLOCK
    scales = quant._scales(quant._blocks(flat, block))[1]
    gap = 1 / 127 if codec == "int8" else float((quant.INT4_LEVELS[1:] - quant.INT4_LEVELS[:-1]).max())
    return (scales * gap).repeat_interleave(block)[: flat.numel()]


def test_the_int4_kernel_runs_on_the_tensor_device():
    t = torch.randn(1000)
    tables = quant._tables(t.device)
    assert tables[0].device == t.device and torch.equal(tables[0], quant._GRID_CODES)
    scales, packed = quant.quantize_int4(t)
    assert scales.device == t.device and packed.device == t.device
    torch.testing.assert_close(quant.dequantize_int4(scales, packed, t.numel()), t, atol=0.2 * 4.5, rtol=0)
