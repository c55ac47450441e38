"""The launcher inside a job step, one-node jobs, the agents' srun environment, log files.

A driver started with ``srun -N1 -n1 python train.py`` (in ``salloc`` or a batch script) must
launch on every node of the job exactly as from the job's own shell; variables of the
driver's step must not reshape the agents' step; a step of several tasks is refused.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from tests.slurm.conftest import JOB_NAME, REPO

# The drivers import this checkout's slurmrun, whatever is installed.
ENV = {"PYTHONPATH": str(REPO)}
EXPORT = f"export PYTHONPATH={REPO}\n"

WHERE = """
import json, os, sys
import slurmrun

def where():
    import torch
    import torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    return {
        "node": os.environ.get("SLURMD_NODENAME"),
        "job": os.environ.get("SLURM_JOB_ID"),
        "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "extra": os.environ.get("FROM_MAPPING"),
        "world": int(os.environ["WORLD_SIZE"]),
        "sum": t.item(),
    }
"""

EMIT = """
result = slurmrun.launch(where, timeout=60, **KWARGS)
print("RESULT " + json.dumps(result.return_values), flush=True)
"""


def _script(tmp_path: Path, body: str = EMIT, kwargs: str = "{}", name: str = "drv.py") -> Path:
    path = tmp_path / name
    path.write_text(WHERE + f"KWARGS = {kwargs}\n" + textwrap.dedent(body))
    return path


def _results(text: str, context: str) -> list[list[dict]]:
    for line in text.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise AssertionError(f"no RESULT line in:\n{context}")


def _salloc(run_cmd, salloc_args, argv, timeout=90.0, check=True):
    return run_cmd(
        ["salloc", f"--job-name={JOB_NAME}", "--time=3", *salloc_args, *argv],
        timeout=timeout,
        check=check,
        env=ENV,
    )


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_salloc_srun_one_task_launches_on_every_node(run_cmd, tmp_path, node_processes):
    path = _script(tmp_path)
    cp = _salloc(run_cmd, ["-N2"], ["srun", "-N1", "-n1", sys.executable, str(path)])
    values = _results(cp.stdout, cp.stdout + cp.stderr)
    assert [[v["node"] for v in host] for host in values] == [["node1"], ["node2"]]
    assert {v["sum"] for host in values for v in host} == {2.0}
    assert node_processes() == {}


def test_sbatch_srun_one_task_launches_on_every_node_with_the_jobs_gpus(sbatch, tmp_path):
    # The driver's step holds one GPU of node1 and CPUs of its own; the agents' step
    # overlaps it and gets what the job has on every node.
    path = _script(tmp_path)
    job = sbatch(
        f"#SBATCH -N3 --gpus-per-node=2\n{EXPORT}srun -N1 -n1 --gpus=1 {sys.executable} {path}\n",
        timeout=120,
    )
    values = _results(job.output, job.output)
    assert [[v["node"] for v in host] for host in values] == [
        ["node1", "node1"],
        ["node2", "node2"],
        ["node3", "node3"],
    ]
    assert {v["cuda"] for host in values for v in host} == {"0,1"}
    assert {v["sum"] for host in values for v in host} == {6.0}


def test_cpu_job_in_a_step_runs_the_jobs_tasks_per_node(run_cmd, tmp_path):
    # In the step, SLURM_TASKS_PER_NODE is "1"; the job's layout (2,1) comes from scontrol.
    path = _script(tmp_path)
    cp = _salloc(run_cmd, ["-N2", "-n3"], ["srun", "-N1", "-n1", sys.executable, str(path)])
    values = _results(cp.stdout, cp.stdout + cp.stderr)
    assert [len(host) for host in values] == [2, 1]


TWO_TASKS = """
try:
    slurmrun.launch(where, timeout=60)
except RuntimeError as e:
    print("ERROR", os.environ["SLURM_PROCID"], e, flush=True)
    sys.exit(3)
"""


def test_two_tasks_of_one_step_are_refused_before_anything_starts(sbatch, tmp_path):
    path = _script(tmp_path, TWO_TASKS)
    job = sbatch(f"#SBATCH -N2\n{EXPORT}srun {sys.executable} {path}\n", timeout=60, check=False)
    assert job.returncode != 0
    errors = [line for line in job.output.splitlines() if line.startswith("ERROR")]
    assert sorted(line.split()[1] for line in errors) == ["0", "1"], job.output
    for line in errors:
        assert f"SLURM step {job.job_id}.0, which has 2 tasks" in line
        assert "`python train.py`" in line
        assert "srun -N1 -n1" in line
    assert "RESULT" not in job.output


LEAKED = (
    """
# Input variables of srun, as a driver's own step (`srun --gpus=1 ...`) or the user leave
# them: srun would read each one for the agents' step if it inherited them. SLURM_GPUS=1
# asks one GPU for a 3-node step ("Invalid generic resource (gres) specification"), and
# SLURM_NTASKS_PER_GPU contradicts --ntasks-per-node (srun: fatal).
os.environ.update(
    SLURM_GPUS="1",
    SLURM_NTASKS_PER_GPU="1",
    SLURM_GPUS_PER_TASK="1",
    SLURM_CPUS_PER_GPU="1",
    SLURM_MEM_PER_CPU="1",
    SLURM_CPUS_PER_TASK="1",
    SLURM_NTASKS="1",
    SLURM_EXACT="1",
)
"""
    + EMIT
)


def test_srun_input_variables_of_the_driver_do_not_reshape_the_agents_step(run_cmd, tmp_path):
    path = _script(tmp_path, LEAKED)
    cp = _salloc(
        run_cmd,
        ["-N3", "--gpus-per-node=2"],
        ["srun", "-N1", "-n1", "--gpus=1", sys.executable, str(path)],
    )
    values = _results(cp.stdout, cp.stdout + cp.stderr)
    assert [len(host) for host in values] == [2, 2, 2]
    assert {v["cuda"] for host in values for v in host} == {"0,1"}


@pytest.mark.cluster_exclusive  # 3 of node1's 4 CPUs: another group's test would not fit there
def test_one_node_job_is_a_slurm_job(sbatch, tmp_path):
    path = _script(tmp_path, kwargs='{"extra_env_vars": {"FROM_MAPPING": "a=b,c"}}')
    job = sbatch(f"#SBATCH -N1 --ntasks-per-node=3\n{EXPORT}{sys.executable} {path}\n", timeout=90)
    values = _results(job.output, job.output)
    assert [len(host) for host in values] == [3]  # the job's tasks, not the machine's CPUs
    assert {v["job"] for v in values[0]} == {job.job_id}
    assert {v["node"] for v in values[0]} == {"node1"}
    assert {v["extra"] for v in values[0]} == {"a=b,c"}


NO_FILES = """
os.environ["SLURMRUN_LOG_DIR"] = ""
result = slurmrun.launch(where, timeout=60, extra_env_vars={"FROM_MAPPING": "given"})
print("RESULT " + json.dumps(result.return_values), flush=True)
"""


def _private_mount(directory: Path, command: str) -> list[str]:
    """Runs `command` in a mount namespace of its own, with a tmpfs over `directory`.

    The launcher then writes there while the nodes see the directory underneath: as with a
    directory that is not on a filesystem the nodes share.
    """
    inner = f"mount -t tmpfs slurmrun-test {directory} && {command}"
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", inner]


def test_empty_log_dir_needs_no_shared_filesystem(run_cmd, tmp_path):
    # SLURMRUN_LOG_DIR="": the launcher's temporary directory is in its private TMPDIR,
    # which no node can see; the nodes must not be told to write there.
    private = tmp_path / "private"
    private.mkdir()
    path = _script(tmp_path, NO_FILES)
    command = f"TMPDIR={private} exec {sys.executable} {path}"
    cp = _salloc(run_cmd, ["-N2"], _private_mount(private, command))
    values = _results(cp.stdout, cp.stdout + cp.stderr)
    assert [[v["extra"] for v in host] for host in values] == [["given"], ["given"]]
    assert list(private.iterdir()) == []  # the nodes wrote nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drv.py", "private"]


UNSHARED = """
try:
    slurmrun.launch(where, timeout=60)
except slurmrun.AgentFailedError as e:
    print("FAILED", e.hostname, json.dumps(str(e)), flush=True)
"""


def test_a_log_dir_the_nodes_cannot_see_fails_clearly(run_cmd, tmp_path):
    # The launcher writes its log directory in a private tmpfs that no node can see.
    base = tmp_path / "logs"
    base.mkdir()
    path = _script(tmp_path, UNSHARED)
    command = f"SLURMRUN_LOG_DIR={base} exec {sys.executable} {path}"
    cp = _salloc(run_cmd, ["-N2"], _private_mount(base, command))
    failed = [line for line in cp.stdout.splitlines() if line.startswith("FAILED")]
    assert failed, cp.stdout + cp.stderr
    _, host, message = failed[0].split(" ", 2)
    text = json.loads(message)
    assert host in ("node1", "node2")
    assert f"the agent on {host} could not start" in text
    assert f"{base}/" in text and f"{host}.agent.log" in text
    assert "SLURMRUN_LOG_DIR" in text and "shares" in text
    assert list(base.iterdir()) == []  # the nodes wrote nothing
