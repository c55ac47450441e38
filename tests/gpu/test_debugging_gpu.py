"""Debugging NCCL workers on a GPU: every rank's stacks while the main thread waits in
`torch.cuda.synchronize()`, and the NCCL flight recorder's dump when a collective times out."""

from __future__ import annotations

import json
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from gpu_helpers import need_gpus
from test_failure_gpu import cycles_for

import slurmrun
from slurmrun.stacks.report import StackSource

pytestmark = pytest.mark.gpu

LIMIT = 300


@pytest.fixture(autouse=True)
def _logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path / "logs"))


def _wait_for(path: Path, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def wait_on_the_gpu(seconds: float, started: str) -> str:
    import pathlib

    import torch
    import torch.distributed as dist

    dist.barrier()
    torch.cuda._sleep(cycles_for(seconds))
    pathlib.Path(f"{started}{dist.get_rank()}").touch()
    torch.cuda.synchronize()
    return "done"


@pytest.mark.timeout(LIMIT + 60)
def test_stacks_of_ranks_waiting_for_their_gpu(tmp_path: Path) -> None:
    n = need_gpus(1)
    launcher = slurmrun.Launcher(timeout=LIMIT)
    started = tmp_path / "started"
    results: list[object] = []
    runner = threading.Thread(
        target=lambda: results.append(launcher.run(wait_on_the_gpu, (8.0, str(started))))
    )
    runner.start()
    try:
        for rank in range(n):
            _wait_for(Path(f"{started}{rank}"))
        time.sleep(1.0)
        report = launcher.stacks(timeout=10)
    finally:
        runner.join(LIMIT)
    assert report is not None
    assert [r.rank for r in report.ranks] == list(range(n))
    for rank in report.ranks:
        # synchronize() lets go of the GIL: the worker's own thread answers, no faulthandler.
        assert rank.source is StackSource.PYTHON, rank
        main = next(t for t in rank.threads if t.name.startswith("MainThread"))
        functions = [f.function for f in main.frames]
        assert functions[-1] == "synchronize" and "wait_on_the_gpu" in functions, functions
    assert results and results[0].values() == ["done"] * n  # type: ignore[attr-defined]


def collective_behind_a_long_kernel(started: str, seconds: float) -> str:
    """A few all_reduces, then one queued behind a kernel longer than NCCL's timeout: the
    watchdog times it out and dumps the flight recorder. (With one GPU no peer can be missing:
    the kernel stands in for one. The watchdog's teardown then waits for the GPU, so the run
    ends when the kernel does.)"""
    import pathlib

    import torch
    import torch.distributed as dist

    t = torch.ones(1 << 10, device="cuda")
    for _ in range(3):
        dist.all_reduce(t)
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles_for(seconds))
    dist.all_reduce(t)
    pathlib.Path(started).touch()
    torch.cuda.synchronize()
    return "ended"


def _load_trace(data: bytes) -> dict[str, Any]:
    try:
        return pickle.loads(data)  # type: ignore[no-any-return]
    except pickle.UnpicklingError:
        return json.loads(data)  # type: ignore[no-any-return]


@pytest.mark.timeout(LIMIT + 60)
def test_the_flight_recorder_dumps_when_a_collective_times_out(tmp_path: Path, report) -> None:
    need_gpus(1)
    started = tmp_path / "started"
    begin = time.monotonic()
    try:
        outcome = slurmrun.launch(
            collective_behind_a_long_kernel,
            (str(started), 45.0),
            timeout=15,
            flight_recorder=True,
        ).rank(0)
    except Exception as exc:  # the watchdog may end the process: either is fine
        outcome = f"{type(exc).__name__}: {str(exc)[:200]}"
    took = time.monotonic() - begin
    assert started.exists(), "the worker never reached the collective"
    dumps = sorted((tmp_path / "logs").glob("2*/flight_recorder/nccl_trace_rank_*"))
    listing = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "logs").rglob("*"))
    assert dumps, f"no flight recorder dump (the run: {outcome}); files: {listing}"
    trace = _load_trace(dumps[0].read_bytes())
    entries = trace["entries"]
    names = [e.get("profiling_name", "") for e in entries]
    assert sum("all_reduce" in name for name in names) >= 4, names
    states = [e.get("state") for e in entries]
    assert states[-1] != "completed", states  # the one that timed out
    report(
        f"NCCL timeout 15 s, collective behind a 45 s kernel: the run {outcome!r} after "
        f"{took:.1f} s; dump {dumps[0].name}: {len(entries)} entries, last {names[-1]} "
        f"{states[-1]}"
    )
