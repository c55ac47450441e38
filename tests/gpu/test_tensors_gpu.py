"""CUDA tensors returned from workers: equal values, arriving on the CPU, and how fast."""

from __future__ import annotations

import time

import pytest
from gpu_helpers import need_gpus

import slurmrun

pytestmark = pytest.mark.gpu

MIB = 1 << 20
OPTIONS = {"timeout": 300}


def made_on_gpu(dtype_name: str, mib: int) -> dict[str, object]:
    """A tensor of `mib` MiB on this worker's GPU and a strided view of it, with their
    `.cpu()` copies made here to compare against."""
    import torch

    dtype = getattr(torch, dtype_name)
    n = mib * MIB // dtype.itemsize
    rank = int(__import__("os").environ["RANK"])
    gen = torch.Generator(device="cuda").manual_seed(rank)
    t = torch.randn(n, device="cuda", generator=gen).to(dtype)
    view = t[n // 4 : n // 2 : 3]  # only the bytes it spans travel
    return {"gpu": t, "gpu_cpu": t.cpu(), "view": view, "view_cpu": view.cpu()}


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_cuda_tensors_arrive_on_the_cpu_with_equal_values(dtype_name: str) -> None:
    import torch

    n = need_gpus(1)
    values = slurmrun.launch(made_on_gpu, (dtype_name, 64), **OPTIONS).values()
    assert len(values) == n
    for v in values:
        for key in ("gpu", "view"):
            t = v[key]
            assert t.device.type == "cpu", f"{key} arrived on {t.device}"
            assert t.dtype == getattr(torch, dtype_name)
            assert torch.equal(t, v[f"{key}_cpu"]), f"{key} differs from .cpu() in the worker"
        assert v["view"].stride() == (3,), "the view arrives as a view"


def timed_return(mib: int, on_gpu: bool) -> dict[str, object]:
    """A float32 tensor of `mib` MiB returned from the GPU (`on_gpu`) or after this worker's
    own `.cpu()`; how long that `.cpu()` took; when the value was handed to slurmrun."""
    import torch

    t = torch.rand(mib * MIB // 4, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    copy = t.cpu()
    copy_s = time.perf_counter() - start
    return {"t": t if on_gpu else copy, "copy_s": copy_s, "sent_at": time.time()}


@pytest.mark.parametrize("mib", [256, 1024])
def test_cuda_tensor_return_speed(mib: int, report) -> None:
    # Printed, not asserted: from the moment the worker returns to the launch's last result,
    # for a tensor left on the GPU (slurmrun copies it to the host) and for one the worker
    # copied itself, next to that worker's own tensor.cpu().
    n = need_gpus(1)
    rates = {}
    for on_gpu in (True, False):
        started = time.time()
        result = slurmrun.launch(timed_return, (mib, on_gpu), **OPTIONS)
        values = result.values()
        assert all(tuple(v["t"].shape) == (mib * MIB // 4,) for v in values)
        assert all(v["t"].device.type == "cpu" for v in values)
        transfer_s = started + result.timings["last_result"] - min(v["sent_at"] for v in values)
        rates[on_gpu] = n * mib / max(transfer_s, 1e-9)
        copy = [mib / max(v["copy_s"], 1e-9) for v in values]
    report(
        f"{n} worker(s) x {mib} MiB float32, returned to the launcher: from the GPU "
        f"{rates[True]:.0f} MiB/s, already on the CPU {rates[False]:.0f} MiB/s; "
        f"tensor.cpu() in the worker {min(copy):.0f} MiB/s"
    )


def model_state() -> dict[str, object]:
    import torch

    torch.manual_seed(int(__import__("os").environ["RANK"]))
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.LayerNorm(512), torch.nn.Linear(512, 10)
    ).cuda()
    model.to(torch.bfloat16)
    model[0].to(torch.float32)
    state = model.state_dict()
    return {"state": state, "cpu": {k: v.cpu() for k, v in state.items()}}


def test_a_state_dict_on_gpu_arrives_on_the_cpu_with_equal_values() -> None:
    import torch

    n = need_gpus(1)
    result = slurmrun.launch(model_state, **OPTIONS)
    assert result.world_size == n
    for v in result.values():
        state, cpu = v["state"], v["cpu"]
        assert list(state) == list(cpu)
        for name, t in state.items():
            assert t.device.type == "cpu", f"{name} arrived on {t.device}"
            assert t.dtype == cpu[name].dtype and torch.equal(t, cpu[name]), name
        model = torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.LayerNorm(512), torch.nn.Linear(512, 10)
        )
        model.to(torch.bfloat16)
        model[0].to(torch.float32)
        model.load_state_dict(state)  # usable as it came


def odd_spans() -> dict[str, object]:
    """Byte tensors around the pinned chunk's size, at odd offsets, and their CPU copies."""
    import torch

    from slurmrun.device_bytes import CHUNK_BYTES

    sizes = [1, 4095, CHUNK_BYTES - 1, CHUNK_BYTES, CHUNK_BYTES + 1, 3 * CHUNK_BYTES + 5]
    spans = {}
    for n in sizes:  # a storage each, cut to the bytes its view spans (from a 16-byte boundary)
        at = n % 7 + 17
        own = torch.randint(0, 256, (n + 64,), dtype=torch.uint8, device="cuda")
        spans[f"{n}@{at}"] = own[at : at + n]
    small = torch.arange(10, device="cuda")  # alone it would be sent through the agent
    return {"spans": spans, "cpu": {k: v.cpu() for k, v in spans.items()}, "small": small}


@pytest.mark.parametrize("streamed", [True, False])
def test_chunk_boundaries_and_offsets_arrive_whole(streamed: bool) -> None:
    import torch

    need_gpus(1)
    if streamed:
        values = slurmrun.launch(odd_spans, **OPTIONS).values()
    else:
        # Under the stream threshold: the frame goes through the agent's connection.
        values = slurmrun.launch(lambda: {"small": odd_spans()["small"]}, **OPTIONS).values()
    for v in values:
        assert torch.equal(v["small"], torch.arange(10))
        for key, t in v.get("spans", {}).items():
            assert t.device.type == "cpu" and torch.equal(t, v["cpu"][key]), key
