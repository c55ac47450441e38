"""slurmrun.submit: from the login side, through submitit and sbatch, onto every node."""

from __future__ import annotations

import pytest

import slurmrun


def _wait(submitted, timeout: float):
    try:
        return submitted.result(timeout=timeout, poll=0.5)
    except TimeoutError:
        submitted.cancel()
        pytest.fail(
            f"{submitted.job_id} did not finish within {timeout} s:\n{submitted.job.stderr()}"
        )


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


def test_submit_rejects_a_bad_call_before_submitting(slurm_cluster, tmp_path):
    with pytest.raises(ValueError, match="workers_per_host must be at least 1"):
        slurmrun.submit(print, launcher=slurmrun.Launcher(workers_per_host=0), folder=tmp_path)
    assert not list(tmp_path.iterdir())
