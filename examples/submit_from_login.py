"""Submit a launch from a login node and wait for it: `python examples/submit_from_login.py`.

`slurmrun.submit` writes a batch job (through submitit) that runs one task per node; the
first task launches on every node of the job. `.result()` waits and returns the
`LaunchResult`, or raises what the launch raised.
"""

from __future__ import annotations

import os

import slurmrun


def where(scale: float) -> tuple[str, int, float]:
    """Each worker's node, rank, and an all_reduce over every worker."""
    import torch
    import torch.distributed as dist

    total = torch.ones(1) * scale
    dist.all_reduce(total)
    return os.environ.get("SLURMD_NODENAME", "?"), dist.get_rank(), total.item()


if __name__ == "__main__":
    job = slurmrun.submit(
        where,
        (1.0,),
        nodes=int(os.environ.get("SUBMIT_NODES", "2")),
        time_min=5,
        folder="slurmrun_jobs/%j",
        slurm_parameters={"job_name": os.environ.get("SUBMIT_JOB_NAME", "slurmrun-example")},
    )
    print(f"submitted job {job.job_id}")
    result = job.result(timeout=float(os.environ.get("SUBMIT_TIMEOUT", "600")))
    for node, rank, total in result.values():
        print(f"rank {rank} on {node}: all_reduce gave {total}")
