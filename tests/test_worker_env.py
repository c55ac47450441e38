"""The world a worker's environment describes (slurmrun/worker_env.py), on localhost.

The same on the real cluster, with srun's own variables: tests/slurm/test_worker_env_slurm.py;
with the frameworks that read them: tests/slurm/test_frameworks_*.
"""

from __future__ import annotations

import json
import os

import pytest

import slurmrun
from slurmrun import worker_env
from slurmrun.worker_env import RankPlace, compress_counts, preview, worker_changes

TORCHRUN = [
    *("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE"),
    *("LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"),
    *("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"),
    *("TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING"),
]


def seen_world():
    import torch
    import torch.distributed as dist

    env = {k: v for k, v in os.environ.items() if k in TORCHRUN or k.startswith(("SLURM_", "PMI"))}
    return {
        "env": env,
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "threads": torch.get_num_threads(),
        "torchelastic": dist.is_torchelastic_launched(),
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
    }


def test_every_worker_gets_torchruns_whole_contract():
    result = slurmrun.launch(
        seen_world,
        hostnames=["localhost", "localhost"],
        workers_per_host=[2, 1],
        backend="gloo",
        max_restarts=1,
    )
    expected_local = [(0, 0, 2), (1, 0, 2), (0, 1, 1)]  # (local rank, node, local world)
    for rank, seen in enumerate(result.values()):
        env = seen["env"]
        assert sorted(env) == sorted(TORCHRUN), "no SLURM or PMI variable off SLURM"
        local_rank, node, local_world = expected_local[rank]
        assert env["RANK"] == env["ROLE_RANK"] == str(rank) == str(seen["rank"])
        assert env["WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "3" == str(seen["world"])
        assert (env["LOCAL_RANK"], env["GROUP_RANK"]) == (str(local_rank), str(node))
        assert env["LOCAL_WORLD_SIZE"] == str(local_world)
        assert env["GROUP_WORLD_SIZE"] == "2"
        assert env["ROLE_NAME"] == "default"
        assert env["TORCHELASTIC_RUN_ID"] == "none"  # torchrun's without --rdzv-id
        assert (env["TORCHELASTIC_RESTART_COUNT"], env["TORCHELASTIC_MAX_RESTARTS"]) == ("0", "1")
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        assert seen["torchelastic"], "torch.distributed.is_torchelastic_launched()"
        # torchrun's OMP_NUM_THREADS=1 where a node runs several workers, and torch obeys it
        # although the spawner imported it before the variable was set
        if local_world > 1:
            assert (seen["omp"], seen["threads"]) == ("1", 1)
        else:
            assert seen["omp"] is None


def test_a_given_omp_num_threads_wins_and_torch_follows_it():
    result = slurmrun.launch(
        seen_world, workers_per_host=2, backend="gloo", extra_env_vars={"OMP_NUM_THREADS": "3"}
    )
    assert [(s["omp"], s["threads"]) for s in result.values()] == [("3", 3), ("3", 3)]


def test_slurm_task_variables_are_made_true_per_worker_and_pmi_ones_removed():
    # An agent whose environment comes from a SLURM step of one task per node, as srun's is:
    # here given to local agents, so the workers rewrite them as they do under srun.
    step = {
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_TASKS_PER_NODE": "1(x2)",
        "SLURM_GTIDS": "0",
        "SLURM_CPUS_PER_TASK": "2",
        "PMI_RANK": "0",
        "PMIX_RANK": "0",
    }
    job = json.dumps({"SLURM_JOB_NAME": "train", "SLURM_JOB_NUM_NODES": "2"})
    result = slurmrun.launch(
        seen_world,
        hostnames=["localhost", "localhost"],
        workers_per_host=[2, 1],
        backend="gloo",
        extra_env_vars={**step, "SLURMRUN_JOB_ENV": job},
    )
    gtids = ["0,1", "0,1", "2"]
    for rank, seen in enumerate(result.values()):
        env = seen["env"]
        node = 0 if rank < 2 else 1
        assert env["SLURM_PROCID"] == str(rank)
        assert env["SLURM_LOCALID"] == env["LOCAL_RANK"]
        assert env["SLURM_NODEID"] == str(node)
        assert env["SLURM_GTIDS"] == gtids[rank]
        assert env["SLURM_NTASKS"] == env["SLURM_NPROCS"] == env["SLURM_STEP_NUM_TASKS"] == "3"
        assert env["SLURM_TASKS_PER_NODE"] == env["SLURM_STEP_TASKS_PER_NODE"] == "2,1"
        assert env["SLURM_NNODES"] == env["SLURM_STEP_NUM_NODES"] == "2"
        assert "SLURM_NTASKS_PER_NODE" not in env, "srun sets it only for an even layout"
        assert int(env["SLURM_TASK_PID"]) > 1
        assert (env["SLURM_JOB_NAME"], env["SLURM_JOB_NUM_NODES"]) == ("train", "2")
        assert "SLURM_CPUS_PER_TASK" not in env, "the agents' step's, not the job's"
        assert not [k for k in env if k.startswith("PMI")]
        assert env["TORCHELASTIC_RUN_ID"] == "77"


def _place(rank: int, local_rank: int, counts: list[int]) -> RankPlace:
    return RankPlace(
        rank=rank,
        local_rank=local_rank,
        world_size=sum(counts),
        local_world_size=counts[0],
        node_rank=0,
        master_addr="10.0.0.1",
        master_port=29500,
        tasks_per_node=compress_counts(counts),
    )


@pytest.mark.parametrize(
    ("counts", "text"),
    [([2], "2"), ([2, 2], "2(x2)"), ([4, 4, 4, 2], "4(x3),2"), ([1, 2, 1], "1,2,1")],
)
def test_counts_are_compressed_as_slurm_writes_them(counts, text):
    assert compress_counts(counts) == text
    assert worker_env.expand_counts(text, "x") == counts


def test_the_jobs_values_replace_the_agents_steps_and_the_absent_ones_go():
    environ = {"SLURM_JOB_ID": "5", "SLURM_JOB_NAME": "slurmrun-agents", "SLURM_MEM_PER_CPU": "9"}
    job = worker_env.job_vars({"SLURM_JOB_NAME": "train.sh", "SLURM_CPUS_PER_TASK": "4"})
    values, removed = worker_changes(environ, _place(1, 1, [2, 2]), job, pid=4242)
    assert (values["SLURM_JOB_NAME"], values["SLURM_CPUS_PER_TASK"]) == ("train.sh", "4")
    assert removed == ["SLURM_MEM_PER_CPU"]
    assert values["SLURM_NTASKS_PER_NODE"] == "2"
    # Outside srun agents (no job variables carried), the worker's own stay as they are.
    values, removed = worker_changes(environ, _place(1, 1, [2, 2]), None, pid=4242)
    assert "SLURM_JOB_NAME" not in values and removed == []


def test_a_dry_run_shows_what_each_worker_adds():
    plan = slurmrun.Launcher(workers_per_host=2, backend="gloo").dry_run(seen_world)
    shown = dict(plan.worker_env)
    assert set(TORCHRUN) <= set(shown)
    assert (shown["RANK"], shown["WORLD_SIZE"], shown["OMP_NUM_THREADS"]) == ("0", "2", "1")
    assert shown["MASTER_PORT"].startswith("<")
    assert "each worker adds" in str(plan)
    values, _ = preview({"SLURM_JOB_ID": "9", "HF_TOKEN": "x"}, [2, 2])
    assert dict(values)["SLURM_TASKS_PER_NODE"] == "2(x2)"


def test_the_agents_way_back_to_its_launcher_is_not_a_workers():
    # A launch the worker starts (a submitted job's function that maps) would listen there.
    environ = {"SLURMRUN_LAUNCHER_ADDR": "10.0.0.1", "SLURMRUN_LAUNCHER_PORT": "35007", "A": "1"}
    _, removed = worker_changes(environ, _place(0, 0, [1]), None, pid=4242)
    assert sorted(removed) == ["SLURMRUN_LAUNCHER_ADDR", "SLURMRUN_LAUNCHER_PORT"]
