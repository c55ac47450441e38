"""Learned preloads on a GPU: what the last run's workers imported is imported by the spawner
for the next run, but never a package that initialises CUDA when imported (the spawner forks
every worker: a CUDA context there would leave each child in a bad fork)."""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from gpu_helpers import compute_app_pids, need_gpus

import slurmrun

pytestmark = pytest.mark.gpu

OPTIONS: dict[str, Any] = {"timeout": 300}
LEARN_WITHIN = 120.0
NAMES = ["plain_gpu_pkg", "cuda_at_import"]


def loaded_then_import(names: list[str]) -> dict[str, Any]:
    """Which of `names` were loaded when this worker started, its spawner's facts, and CUDA
    working in this worker after the imports."""
    import torch

    found = {name: name in sys.modules for name in names}
    bad_fork = torch.cuda._is_in_bad_fork()
    for name in names:
        importlib.import_module(name)
    t = torch.ones(2, device="cuda")
    torch.cuda.synchronize()
    return {
        **found,
        "bad_fork": bad_fork,
        "cuda_sum": float(t.sum().item()),
        "spawner": os.getppid(),
        "apps": sorted(compute_app_pids()),
    }


@pytest.mark.timeout(900)
def test_the_spawner_learns_packages_but_never_one_that_initialises_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, report
) -> None:
    need_gpus(1)
    packages = tmp_path / "site-packages"  # learned preloads are installed packages only
    packages.mkdir()
    (packages / "plain_gpu_pkg.py").write_text("VALUE = 1\n")
    (packages / "cuda_at_import.py").write_text(
        "import torch\n\nON_GPU = torch.ones(1, device='cuda')\n"
    )
    monkeypatch.syspath_prepend(str(packages))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(packages), os.environ.get("PYTHONPATH", "")])
    )
    runs = 0
    deadline = time.monotonic() + LEARN_WITHIN
    with slurmrun.Launcher(**OPTIONS) as launcher:
        while True:
            answers = launcher.run(loaded_then_import, (NAMES,)).values()
            runs += 1
            for a in answers:
                assert not a["bad_fork"], f"run {runs}: the spawner had initialised CUDA: {a}"
                assert not a["cuda_at_import"], f"run {runs}: the spawner imported it: {a}"
                assert a["cuda_sum"] == 2.0, a
                assert a["spawner"] not in a["apps"], f"run {runs}: the spawner holds CUDA: {a}"
            if runs > 1 and all(a["plain_gpu_pkg"] for a in answers):
                break
            assert time.monotonic() < deadline, f"nothing learned after {runs} runs: {answers}"
            time.sleep(0.2)
    report(
        f"learned preloads: plain_gpu_pkg preloaded by run {runs}; cuda_at_import never "
        "(the probe saw it initialise CUDA); no worker in a bad fork, no spawner holding CUDA"
    )
