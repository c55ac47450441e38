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
    """A tensor of `mib` MiB on this worker's GPU, its `.cpu()` copy, and the copy's speed."""
    import torch

    dtype = getattr(torch, dtype_name)
    n = mib * MIB // dtype.itemsize
    rank = int(__import__("os").environ["RANK"])
    gen = torch.Generator(device="cuda").manual_seed(rank)
    t = torch.randn(n, device="cuda", generator=gen).to(dtype)
    torch.cuda.synchronize()
    start = time.perf_counter()
    copy = t.cpu()
    copy_s = time.perf_counter() - start
    # A view too: only its bytes travel, and it still equals its .cpu()
    view = t[n // 4 : n // 2 : 3]
    return {
        "gpu": t,
        "cpu": copy,
        "view": view,
        "view_cpu": view.cpu(),
        "copy_s": copy_s,
        "sent_at": time.time(),
    }


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_cuda_tensors_arrive_on_the_cpu_with_equal_values(dtype_name: str, report) -> None:
    import torch

    n = need_gpus(1)
    mib = 256
    started = time.time()
    result = slurmrun.launch(made_on_gpu, (dtype_name, mib), **OPTIONS)
    received = time.time()
    values = result.values()
    assert len(values) == n
    for v in values:
        for key in ("gpu", "view"):
            t = v[key]
            assert t.device.type == "cpu", f"{key} arrived on {t.device}"
            assert t.dtype == getattr(torch, dtype_name)
            assert torch.equal(t, v[f"{key}_cpu"]), f"{key} differs from .cpu() in the worker"
    # Printed, not asserted: the launch's transfer (all workers in parallel) next to each
    # worker's own tensor.cpu().
    first_sent = min(v["sent_at"] for v in values)
    last_result = started + result.timings.get("last_result", received - started)
    transfer_s = max(last_result - first_sent, 1e-9)
    # the GPU tensor (its view shares its storage), its CPU copy and the view's (1/12)
    total_mib = n * mib * (2 + 1 / 12)
    copy_rate = [mib / max(v["copy_s"], 1e-9) for v in values]
    report(
        f"{dtype_name}: {n} worker(s) x {mib} MiB on GPU: returned at {total_mib / transfer_s:.0f}"
        f" MiB/s in all (launch, {total_mib:.0f} MiB incl. the CPU copies, in {transfer_s:.2f} s);"
        f" tensor.cpu() in the worker {min(copy_rate):.0f}-{max(copy_rate):.0f} MiB/s per GPU"
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
