"""A rank that raises while its NCCL collective still waits behind GPU work (one GPU: the work
is a long kernel; test_hang_gpu.py has the two-GPU case, a peer hanging in the collective):
the exception arrives promptly, not when the kernel or NCCL's timeout would end, and the GPU's
memory comes back."""

from __future__ import annotations

import time

import pytest
from gpu_helpers import GIB, gpu_memory, need_gpus, wait_memory_back

import slurmrun

pytestmark = pytest.mark.gpu

KERNEL_S = 60.0  # the queued kernel's length; also far above PROMPT
PROMPT = 30.0


class GaveUpError(RuntimeError):
    pass


def cycles_for(seconds: float) -> int:
    """GPU clock cycles that `torch.cuda._sleep` spins for `seconds` (measured here)."""
    import torch

    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    calibration = 100_000_000
    start = time.perf_counter()
    torch.cuda._sleep(calibration)
    torch.cuda.synchronize()
    return int(seconds * calibration / (time.perf_counter() - start))


def raise_with_a_collective_queued(seconds: float) -> None:
    import torch
    import torch.distributed as dist

    t = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles_for(seconds))  # the GPU is busy for `seconds`
    dist.all_reduce(t)  # queued behind it
    raise GaveUpError(f"rank {dist.get_rank()} gives up")


@pytest.mark.timeout(600)
def test_a_rank_raising_with_gpu_work_queued_is_reported_promptly(report) -> None:
    need_gpus(1)
    baseline = gpu_memory()
    start = time.monotonic()
    with pytest.raises(GaveUpError, match="gives up"):
        slurmrun.launch(raise_with_a_collective_queued, (KERNEL_S,), timeout=KERNEL_S * 2)
    took = time.monotonic() - start
    report(f"the raising rank's error after {took:.1f} s (its GPU busy for {KERNEL_S:.0f} s)")
    assert took < PROMPT, f"the exception came after {took:.0f} s"
    extra = wait_memory_back(baseline)
    assert all(e <= GIB // 2 for e in extra), f"bytes still used above the baseline: {extra}"
