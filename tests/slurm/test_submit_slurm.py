"""slurmrun.submit: from the login side, through submitit and sbatch, onto every node."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import slurmrun

REPO = Path(__file__).resolve().parents[2]


def _wait(submitted, timeout: float):
    try:
        return submitted.result(timeout=timeout, poll=0.5)
    except TimeoutError:
        submitted.cancel()
        pytest.fail(f"{submitted.job_id} did not finish within {timeout} s:\n{submitted.logs(0)}")


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_submit_runs_the_launch_on_every_node_of_a_new_job(slurm_cluster, tmp_path):
    def where(scale):
        import os

        import torch
        import torch.distributed as dist

        t = torch.ones(1) * scale
        dist.all_reduce(t)
        return os.environ["SLURMD_NODENAME"], int(os.environ["RANK"]), t.item()

    job = slurmrun.submit(
        where,
        (2.0,),
        nodes=3,
        folder=tmp_path / "%j",
        time_min=3,
        slurm_parameters={"job_name": "slurmrun-test"},
    )
    result = _wait(job, timeout=120)
    assert result.hostnames == ["node1", "node2", "node3"]
    assert result.values() == [("node1", 0, 6.0), ("node2", 1, 6.0), ("node3", 2, 6.0)]


def test_a_function_shipped_by_value_keeps_its_file_line_and_source_in_the_traceback(
    slurm_cluster, tmp_path
):
    # A local function is pickled by value twice (to the job, then by the job's launcher to
    # its workers); cloudpickle 3 would name its file "<dynamic-code>" on the way.
    def fails_in_the_job():
        raise KeyError("raised in the job")  # the raising line

    job = slurmrun.submit(
        fails_in_the_job,
        nodes=1,
        folder=tmp_path / "%j",
        time_min=3,
        slurm_parameters={"job_name": "slurmrun-test"},
    )
    with pytest.raises(KeyError, match="raised in the job") as info:
        _wait(job, timeout=120)
    text = str(info.value.__cause__)
    line = fails_in_the_job.__code__.co_firstlineno + 1
    assert f'File "{__file__}", line {line}, in fails_in_the_job' in text, text
    assert 'raise KeyError("raised in the job")  # the raising line' in text, text


def test_submit_rejects_a_bad_call_before_submitting(slurm_cluster, tmp_path):
    with pytest.raises(ValueError, match="workers_per_host must be at least 1"):
        slurmrun.submit(print, launcher=slurmrun.Launcher(workers_per_host=0), folder=tmp_path)
    with pytest.raises(ValueError, match="nodes must be a positive int, got 0"):
        slurmrun.submit(print, nodes=0, folder=tmp_path)
    with pytest.raises(TypeError, match="func_args could not be pickled"):
        slurmrun.submit(print, (threading.Lock(),), folder=tmp_path)
    (tmp_path / "a-file").touch()
    with pytest.raises(OSError, match=r"cannot create the job folder .*a-file/jobs"):
        slurmrun.submit(print, folder=tmp_path / "a-file" / "jobs")
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]  # nothing was submitted


def test_a_sys_path_entry_missing_on_the_nodes_is_named(slurm_cluster, tmp_path, monkeypatch):
    project = tmp_path / "project"
    project.mkdir()
    (project / "vanishing_mod.py").write_text("def f():\n    return 1\n")
    monkeypatch.syspath_prepend(str(project))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    import vanishing_mod  # the project folder just written

    job = slurmrun.submit(
        vanishing_mod.f,
        folder=tmp_path / "jobs",
        time_min=3,
        slurm_parameters={"additional_parameters": {"hold": True}},
    )
    try:
        # The project is gone from where the job runs (here: gone before it starts).
        shutil.move(project, tmp_path / "elsewhere")
        subprocess.run(["scontrol", "release", job.job_id], check=True, timeout=30)
        with pytest.raises(ModuleNotFoundError, match=f"sys.path has {project}, which does not"):
            job.result(timeout=120, poll=0.5)
    finally:
        job.cancel()
        sys.modules.pop("vanishing_mod", None)
