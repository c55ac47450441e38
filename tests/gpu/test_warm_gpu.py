"""Warm launchers with NCCL: later runs reuse the agents, fork fresh workers, and leave the GPU
as they found it between runs (the spawner never holds a CUDA context)."""

from __future__ import annotations

import os
import time

import pytest
from gpu_helpers import GIB, compute_app_pids, gpu_memory, need_gpus, wait_memory_back

import slurmrun

pytestmark = pytest.mark.gpu

OPTIONS = {"timeout": 300}
RUNS = 3


def all_reduce_on_gpu(k: int) -> tuple[float, int, int]:
    """(the all_reduced value, bytes this worker allocated on its GPU, its pid)."""
    import torch
    import torch.distributed as dist

    t = torch.full((1 << 20,), float(k), device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    return t[0].item(), torch.cuda.memory_allocated(), os.getpid()


@pytest.mark.timeout(900)
def test_warm_nccl_runs_fork_fresh_workers_and_free_the_gpu_between_runs(report) -> None:
    n = need_gpus(1)
    baseline = gpu_memory()
    apps = compute_app_pids()
    start = time.perf_counter()
    cold = slurmrun.launch(all_reduce_on_gpu, (0,), **OPTIONS)
    cold_s = time.perf_counter() - start
    assert [v[0] for v in cold.values()] == [0.0] * n
    times: list[float] = []
    pids: list[set[int]] = []
    with slurmrun.Launcher(**OPTIONS) as launcher:
        for k in range(1, RUNS + 1):
            start = time.perf_counter()
            result = launcher.run(all_reduce_on_gpu, (k,))
            times.append(time.perf_counter() - start)
            values = result.values()
            assert [v[0] for v in values] == [float(k * n)] * n
            assert all(v[1] >= 4 << 20 for v in values)  # the tensor was on the GPU
            pids.append({v[2] for v in values})
            extra = wait_memory_back(baseline)
            assert all(e <= GIB // 2 for e in extra), f"after warm run {k}: {extra} bytes used"
            held = compute_app_pids() - apps
            assert not held, f"between warm runs, pids {held} hold a CUDA context"
    assert all(not (a & b) for i, a in enumerate(pids) for b in pids[i + 1 :]), pids
    extra = wait_memory_back(baseline)
    assert all(e <= GIB // 2 for e in extra), f"after the launcher closed: {extra} bytes used"
    report(
        f"{n} NCCL worker(s), all_reduce of 4 MiB: cold launch {cold_s:.2f} s; warm launcher "
        + ", ".join(f"run {i + 1} {t:.3f} s" for i, t in enumerate(times))
    )
