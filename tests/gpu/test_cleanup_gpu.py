"""Self-cleaning on GPUs: every device's memory is free again once `launch` returns, after a
clean run and after a worker was SIGKILLed holding 10 GiB; two launches in one script."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from gpu_helpers import GIB, compute_app_pids, gpu_memory, need_gpus, script_env, wait_memory_back

import slurmrun
from slurmrun.errors import WorkerFailedError

pytestmark = pytest.mark.gpu


OPTIONS = {"timeout": 300}
HOLD_GIB = 10


def hold(gib: int, kill_rank: int | None) -> int:
    """Fills `gib` GiB of this worker's GPU; rank `kill_rank` then SIGKILLs itself while the
    others wait for it in an NCCL barrier (which never completes)."""
    import torch
    import torch.distributed as dist

    block = torch.ones(gib * (1 << 30), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    dist.barrier()  # every worker holds its block before anyone dies
    if dist.get_rank() == kill_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    torch.cuda.synchronize()
    return int(block[-1].item())


def _need_free(gib: int) -> list[tuple[int, int]]:
    memory = gpu_memory()
    short = [i for i, (free, _) in enumerate(memory) if free < (gib + 1) * GIB]
    if short:
        pytest.skip(f"needs {gib + 1} GiB free on every GPU; GPU(s) {short} have less")
    return memory


def test_memory_is_free_on_every_gpu_after_launch_returns() -> None:
    n = need_gpus(1)
    baseline = _need_free(2)
    apps = compute_app_pids()
    result = slurmrun.launch(hold, (2, None), **OPTIONS)
    assert result.values() == [1] * n
    extra = wait_memory_back(baseline)
    assert all(e <= GIB // 2 for e in extra), f"bytes still used above the baseline: {extra}"
    assert compute_app_pids() <= apps, "a process of the launch still holds a CUDA context"


def test_memory_is_free_after_a_worker_is_sigkilled_holding_10_gib() -> None:
    n = need_gpus(1)
    baseline = _need_free(HOLD_GIB)
    apps = compute_app_pids()
    kill_rank = n - 1
    with pytest.raises(WorkerFailedError) as failed:
        slurmrun.launch(hold, (HOLD_GIB, kill_rank), **OPTIONS)
    assert failed.value.rank == kill_rank and failed.value.exitcode == -signal.SIGKILL
    extra = wait_memory_back(baseline)
    assert all(e <= GIB // 2 for e in extra), f"bytes still used above the baseline: {extra}"
    assert compute_app_pids() <= apps, "a process of the launch still holds a CUDA context"


TWO_LAUNCHES = textwrap.dedent(
    """
    import slurmrun


    def step(k):
        import torch
        import torch.distributed as dist

        t = torch.full((1 << 20,), float(k), device="cuda")
        dist.all_reduce(t)
        return t[0].item()


    if __name__ == "__main__":
        first = slurmrun.launch(step, (1,), timeout=300)
        second = slurmrun.launch(step, (2,), timeout=300)
        print("RESULTS", first.values(), second.values())
    """
)


@pytest.mark.timeout(900)
def test_two_launches_in_one_script(tmp_path) -> None:
    n = need_gpus(1)
    baseline = gpu_memory()
    script = tmp_path / "two_launches.py"
    script.write_text(TWO_LAUNCHES)
    out = subprocess.run(
        [sys.executable, str(script)],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=script_env(),
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert f"RESULTS {[float(n)] * n} {[2.0 * n] * n}" in out.stdout, out.stdout[-2000:]
    extra = wait_memory_back(baseline)
    assert all(e <= GIB // 2 for e in extra), f"bytes still used above the baseline: {extra}"
