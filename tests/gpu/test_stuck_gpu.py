"""Hangs and health on a GPU: a rank held in `torch.cuda.synchronize()` behind a long kernel is
waiting, and a run of one such rank fails with HangError carrying NCCL's flight recorder; the
built-in GPU check passes on a real GPU and names what failed on a GPU that is not there."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from gpu_helpers import need_gpus
from test_failure_gpu import cycles_for

import slurmrun

pytestmark = pytest.mark.gpu

LIMIT = 120


@pytest.fixture(autouse=True)
def _logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path / "logs"))


def synchronize_behind_a_long_kernel(seconds: float, started: str) -> str:
    """One all_reduce (the recorder's entry), then a kernel of `seconds` and a synchronize."""
    import pathlib

    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1, device="cuda"))
    torch.cuda._sleep(cycles_for(seconds))
    pathlib.Path(started).write_text(str(time.time()))
    torch.cuda.synchronize()  # held here, behind the kernel
    return "done"


@pytest.mark.timeout(LIMIT + 60)
def test_a_rank_in_cuda_synchronize_is_waiting_and_its_hang_carries_the_flight_recorder(
    tmp_path: Path,
) -> None:
    need_gpus(1)
    started = tmp_path / "started"
    with pytest.raises(slurmrun.HangError) as caught:
        slurmrun.launch(
            synchronize_behind_a_long_kernel, (60.0, str(started)), workers_per_host=1,
            backend="nccl", timeout=LIMIT, hang_timeout=3.0, flight_recorder=True,
        )  # fmt: skip
    took = time.time() - float(started.read_text())
    error = caught.value
    text = str(error)
    assert took < 3.0 + 5.0, took
    assert error.stuck == (), text  # its one rank waits: in torch.cuda.synchronize
    assert "every rank waited in a collective" in text, text
    assert re.search(r"rank 0 \(\S+\): waiting: synchronize \(__init__\.py:\d+\)", text), text
    (dump,) = (Path(f) for f in error.flight_recorder)
    assert dump.name == "nccl_trace_rank_0" and dump.stat().st_size > 0, dump
    assert re.search(r"^rank 0: nccl:all_reduce #\d+", text, re.MULTILINE), text
    print(f"HangError {took:.1f} s after the synchronize began (hang_timeout 3 s)")


def test_the_gpu_check_passes_on_a_real_gpu_and_names_a_gpu_that_is_not_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    n = need_gpus(1)
    result = slurmrun.launch(lambda: 1, workers_per_host=1, backend=None, gpu_check="on")
    assert result.return_values == [[1]]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", str(n + 7))  # a GPU this machine does not have
    with pytest.raises(slurmrun.NodeUnhealthyError) as caught:
        slurmrun.launch(lambda: 1, workers_per_host=1, backend=None)  # "auto": the driver is here
    text = str(caught.value)
    assert f"GPU check (CUDA_VISIBLE_DEVICES={n + 7}): " in text, text
    assert "torch sees 0 of the 1 GPU(s) given" in text, text
