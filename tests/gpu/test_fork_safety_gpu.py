"""Fork safety: the spawner (which imports torch and forks every worker) never initialises
CUDA, and a user module that initialises CUDA when it is imported still works."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
from gpu_helpers import compute_app_pids, need_gpus, script_env

import slurmrun

pytestmark = pytest.mark.gpu

OPTIONS = {"timeout": 300}
LIBCUDA = re.compile(r"/libcuda\.so")


def spawner_facts() -> dict[str, object]:
    """What a worker sees of itself and of its parent, the spawner, while it holds a CUDA
    context: the processes nvidia-smi lists as holding one, and the spawner's state at fork."""
    import torch
    import torch.distributed as dist

    # Before any CUDA call of this worker's own beyond the process group's set-up: had the
    # spawner initialised CUDA through torch, the fork would have left torch "in a bad fork".
    bad_fork = torch.cuda._is_in_bad_fork()
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    spawner = os.getppid()
    with open(f"/proc/{spawner}/comm") as f:
        name = f.read().strip()
    with open(f"/proc/{spawner}/maps") as f:
        libcuda = any(LIBCUDA.search(line) for line in f)
    return {
        "worker": os.getpid(),
        "spawner": spawner,
        "name": name,
        "bad_fork": bad_fork,
        "apps": sorted(compute_app_pids()),  # asked while this worker holds its context
        "spawner_maps_libcuda": libcuda,
    }


def test_the_spawner_never_initialises_cuda(report) -> None:
    need_gpus(1)
    # A warm launcher keeps its spawners: the second run looks at a spawner that already
    # forked a generation of CUDA workers.
    with slurmrun.Launcher(**OPTIONS) as launcher:
        for run in range(2):
            facts = launcher.run(spawner_facts).values()
            for f in facts:
                assert f["name"] == "slurmrun-spawn", f"the worker's parent is not the spawner: {f}"
                assert not f["bad_fork"], f"the spawner had initialised CUDA before the fork: {f}"
                assert f["worker"] in f["apps"], f"nvidia-smi must list a worker's context: {f}"
                assert f["spawner"] not in f["apps"], f"the spawner holds a CUDA context: {f}"
            report(
                f"run {run + 1}: nvidia-smi lists workers {sorted(f['worker'] for f in facts)}, "
                f"not the spawner(s) {sorted({f['spawner'] for f in facts})}; the spawner maps "
                f"libcuda: {sorted({f['spawner_maps_libcuda'] for f in facts})} (loading the "
                "library is not initialising CUDA; `import torch` alone may load it)"
            )


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
        env=script_env(),
    )
    assert out.returncode == 0, out.stderr[-4000:]
    total = n * (n + 1) / 2
    expected = [[total, r, r, 6.0] for r in range(n)]
    assert f"RESULTS {expected}" in out.stdout, out.stdout[-2000:]
