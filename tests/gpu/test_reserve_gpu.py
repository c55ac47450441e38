"""A reservation's kept NCCL workers, driven by launchers that are separate processes (issue
48's "reserve once and iterate"): the device machine has no SLURM, so the keeper runs outside
a job (``--job-id``), its agents on this machine, exactly the keeper a reservation's batch step
runs. A second launcher finds the first one's worker, CUDA context, communicator and kept
tensor; when the keeper ends, the GPU is given back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from gpu_helpers import GIB, compute_app_pids, gpu_memory, need_gpus, script_env, wait_memory_back

from slurmrun.reservations import ReservationRecord

pytestmark = pytest.mark.gpu

JOB = "4242"
WITHIN = 180.0

DRIVER = textwrap.dedent(
    """
    import json, os, sys, time

    import slurmrun


    def all_reduce_kept(k):
        import torch
        import torch.distributed as dist

        state = slurmrun.worker_state()
        if "kept" not in state:
            state["kept"] = torch.full((1 << 20,), 3.0, device="cuda")
        t = torch.full((1 << 20,), float(k), device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        kept = state["kept"]
        backend = dist.get_backend()
        return t[0].item(), float(kept.sum().item()), kept.data_ptr(), os.getpid(), backend


    start = time.perf_counter()
    with slurmrun.Launcher(job=sys.argv[1], keep_workers=True, timeout=300) as launcher:
        first = time.perf_counter()
        values = launcher.run(all_reduce_kept, (int(sys.argv[2]),)).values()
        ran = time.perf_counter() - first
    print(json.dumps({"values": values, "run": ran, "whole": time.perf_counter() - start}))
    """
)


@pytest.mark.timeout(900)
def test_kept_nccl_workers_of_a_reservation_serve_launchers_one_after_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, report
) -> None:
    n = need_gpus(1)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    env = {k: v for k, v in script_env().items() if not k.startswith("SLURM_")}
    baseline = gpu_memory()
    apps = compute_app_pids()
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    log = tmp_path / "keeper.log"
    keeper = subprocess.Popen(
        [sys.executable, "-m", "slurmrun.batch.keeper", "--job-id", JOB,
         "--folder", str(tmp_path / "jobs"), "--idle-timeout", "300"],
        env=env, cwd=tmp_path, stdout=log.open("wb"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + WITHIN
        while ReservationRecord.read(JOB) is None:
            assert keeper.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        runs = []
        for k in (1, 2, 3):
            out = subprocess.run(
                [sys.executable, str(driver), JOB, str(k)], env=env, cwd=tmp_path,
                capture_output=True, text=True, timeout=WITHIN, check=False,
            )  # fmt: skip
            assert out.returncode == 0, out.stderr[-3000:]
            runs.append(json.loads(out.stdout.splitlines()[-1]))
        first = runs[0]["values"]
        for k, run in enumerate(runs, start=1):
            values = run["values"]
            assert [v[0] for v in values] == [float(k * n)] * n, (k, values)
            assert [v[1] for v in values] == [3.0 * (1 << 20)] * n, (k, values)
            assert [v[4] for v in values] == ["nccl"] * n, (k, values)
            # the same processes and CUDA allocation across launcher processes
            assert [(v[2], v[3]) for v in values] == [(v[2], v[3]) for v in first], (k, values)
        workers = {v[3] for v in first}
        assert workers <= compute_app_pids(), "kept workers hold their context between launchers"
        keeper.send_signal(signal.SIGTERM)
        assert keeper.wait(WITHIN) == 0, log.read_text()
    finally:
        if keeper.poll() is None:
            os.killpg(keeper.pid, signal.SIGKILL)
            keeper.wait()
    extra = wait_memory_back(baseline)
    assert all(e <= GIB // 2 for e in extra), f"after the keeper ended: {extra} bytes used"
    left = compute_app_pids() - apps
    assert not left, f"after the keeper ended, pids {left} still hold a CUDA context"
    report(
        f"{n} kept NCCL worker(s) of a keeper, 3 launcher processes one after another: run "
        + ", ".join(f"{r['run']:.3f} s" for r in runs)
        + "; whole launcher process (attach, run, detach) "
        + ", ".join(f"{r['whole']:.2f} s" for r in runs)
    )
