"""Fork safety: the spawner (which imports torch and forks every worker) never initialises
CUDA, and a user module that initialises CUDA when it is imported still works."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from gpu_helpers import compute_app_pids, need_gpus

import slurmrun

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
OPTIONS = {"timeout": 300}
# The driver library, mapped by cuInit; libcudart and libtorch_cuda are mapped by `import torch`.
LIBCUDA = re.compile(r"/libcuda\.so")


def spawner_facts() -> dict[str, object]:
    """What the worker sees of its parent, the spawner, after its own CUDA work."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    spawner = os.getppid()
    with open(f"/proc/{spawner}/comm") as f:
        name = f.read().strip()
    with open(f"/proc/{spawner}/maps") as f:
        libcuda = sorted({line.split()[-1] for line in f if LIBCUDA.search(line)})
    with open(f"/proc/{os.getpid()}/maps") as f:
        mine = any(LIBCUDA.search(line) for line in f)
    return {"spawner": spawner, "name": name, "libcuda": libcuda, "worker_has_libcuda": mine}


def test_the_spawner_never_initialises_cuda() -> None:
    need_gpus(1)
    # A warm launcher keeps its spawners: the second run looks at a spawner that already
    # forked a generation of CUDA workers.
    with slurmrun.Launcher(**OPTIONS) as launcher:
        for _ in range(2):
            facts = launcher.run(spawner_facts).values()
            for f in facts:
                assert f["name"] == "slurmrun-spawn", f"the worker's parent is not the spawner: {f}"
                assert f["worker_has_libcuda"], "the check must see libcuda where CUDA is used"
                assert f["libcuda"] == [], f"the spawner mapped the CUDA driver: {f}"
            apps = compute_app_pids()
            assert not apps & {f["spawner"] for f in facts}, "nvidia-smi lists a spawner"


CUDA_AT_IMPORT = textwrap.dedent(
    """
    import os

    import torch

    # CUDA initialised when the module is imported: in the launcher (the script imports it)
    # and in every worker (unpickling the function imports it there).
    ON_GPU = torch.arange(4.0, device="cuda")


    def work():
        import torch.distributed as dist

        t = torch.ones(1, device="cuda") * (dist.get_rank() + 1)
        dist.all_reduce(t)
        return [t.item(), torch.cuda.current_device(), int(os.environ["LOCAL_RANK"]),
                float(ON_GPU.sum().item())]
    """
)

DRIVER = textwrap.dedent(
    """
    import cudamod
    import slurmrun

    result = slurmrun.launch(cudamod.work, timeout=300)
    print("RESULTS", result.values())
    """
)


@pytest.mark.timeout(900)
def test_a_module_that_initialises_cuda_at_import_works(tmp_path) -> None:
    n = need_gpus(1)
    (tmp_path / "cudamod.py").write_text(CUDA_AT_IMPORT)
    (tmp_path / "driver.py").write_text(DRIVER)
    out = subprocess.run(
        [sys.executable, "driver.py"],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stderr[-4000:]
    total = n * (n + 1) / 2
    expected = [[total, r, r, 6.0] for r in range(n)]
    assert f"RESULTS {expected}" in out.stdout, out.stdout[-2000:]
