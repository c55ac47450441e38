"""Kept workers with NCCL (`Launcher(keep_workers=True)`): one set of worker processes serves
every run, with its CUDA context, its NCCL communicator and the CUDA tensors it kept, so a
later run pays neither again; closing the launcher gives the GPU back."""

from __future__ import annotations

import os
import time

import pytest
from gpu_helpers import GIB, compute_app_pids, gpu_memory, need_gpus, wait_memory_back

import slurmrun

pytestmark = pytest.mark.gpu

OPTIONS = {"timeout": 300, "keep_workers": True}
RUNS = 4


def all_reduce_kept(k: int) -> tuple[float, float, int, int]:
    """(the all_reduced value, the sum of the CUDA tensor run 1 kept, its device pointer, pid)."""
    import torch
    import torch.distributed as dist

    state = slurmrun.worker_state()
    if "kept" not in state:
        state["kept"] = torch.full((1 << 20,), 3.0, device="cuda")
    t = torch.full((1 << 20,), float(k), device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    kept = state["kept"]
    return t[0].item(), float(kept.sum().item()), kept.data_ptr(), os.getpid()


@pytest.mark.timeout(900)
def test_kept_nccl_workers_serve_every_run_with_their_cuda_state(report) -> None:
    n = need_gpus(1)
    baseline = gpu_memory()
    apps = compute_app_pids()
    expected_sum = 3.0 * (1 << 20)  # exact in float32, whatever the order of the sum
    times: list[float] = []
    answers: list[list[tuple[float, float, int, int]]] = []
    with slurmrun.Launcher(**OPTIONS) as launcher:
        for k in range(1, RUNS + 1):
            start = time.perf_counter()
            answers.append(launcher.run(all_reduce_kept, (k,)).values())
            times.append(time.perf_counter() - start)
        workers = {a[3] for a in answers[0]}
        assert workers <= compute_app_pids(), "the kept workers must still hold their context"
    for k, values in enumerate(answers, start=1):
        assert [v[0] for v in values] == [float(k * n)] * n, f"run {k}: {values}"
        assert [v[1] for v in values] == [expected_sum] * n, f"run {k}: the kept tensor changed"
        # the same processes, and the same CUDA allocation: nothing was made again
        assert [(v[2], v[3]) for v in values] == [(v[2], v[3]) for v in answers[0]], (k, values)
    extra = wait_memory_back(baseline)
    assert all(e <= GIB // 2 for e in extra), f"after the launcher closed: {extra} bytes used"
    held = compute_app_pids() - apps
    assert not held, f"after the launcher closed, pids {held} still hold a CUDA context"
    report(
        f"{n} kept NCCL worker(s), all_reduce of 4 MiB: "
        + ", ".join(f"run {i + 1} {t:.3f} s" for i, t in enumerate(times))
        + " (run 1 makes the CUDA context and NCCL communicator; later runs reuse them)"
    )
