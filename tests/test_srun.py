"""The srun command lines we build, compared with golden files (set UPDATE_GOLDEN=1 to rewrite)."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from slurmrun import launcher, variables
from slurmrun.launcher import address
from slurmrun.launcher.agents import Srun, srun, srun_step
from slurmrun.launcher.agents.srun import job_nodes
from slurmrun.launcher.agents.srun_step import SrunAgents
from slurmrun.launcher.plan import Plan
from slurmrun.logs import LogDir
from slurmrun.slurm.job import SlurmAllocation

GOLDEN = Path(__file__).parent / "golden"
EXPORT = ["HOME", "PATH", "SLURMRUN_SECRET"]


def _alloc(gpus: list[int] | None, cpus: list[int]) -> SlurmAllocation:
    return SlurmAllocation(
        job_id="42",
        hostnames=["node1", "node2", "node3"],
        cpus_per_node=cpus,
        tasks_per_node=[1, 1, 1],
        gpus_per_node=gpus,
    )


CASES = {
    "cpu_three_nodes": (_alloc([0, 0, 0], [4, 4, 4]), ["node1", "node2", "node3"], "/logs"),
    "gpus_two_per_node": (_alloc([2, 2, 2], [8, 8, 8]), ["node1", "node2", "node3"], "/logs"),
    "subset_of_nodes": (_alloc([2, 2, 2], [8, 4, 8]), ["node3", "node2"], "/logs"),
    # SLURMRUN_LOG_DIR="": no file on the nodes, srun relays the agents' output.
    "no_node_logs": (_alloc([0, 0, 0], [4, 4, 4]), ["node1", "node2", "node3"], None),
    # "%" is srun's pattern character: a literal one is "%%".
    "percent_in_log_dir": (_alloc([0, 0, 0], [4, 4, 4]), ["node1"], "/logs/100%/x"),
}


def test_a_plans_task_order_is_slurms_and_its_nodes_carry_the_jobs_tasks():
    # srun numbers the agents' tasks in the job's node order, whatever order the hosts are in:
    # a failed task's number names its node through its step's task order (Srun.explain).
    alloc = SlurmAllocation(
        job_id="42",
        hostnames=["node1", "node2", "node3"],
        cpus_per_node=[4, 4, 4],
        tasks_per_node=[3, 2, 1],
        gpus_per_node=[0, 0, 0],
    )
    hosts = ["node3", "node1"]
    nodes = job_nodes(alloc, hosts)
    assert nodes.order == ("node1", "node3")
    assert nodes.tasks == (3, 1)
    assert Srun(nodes).step(hosts).task_order == ("node1", "node3")
    assert Srun(nodes).step(hosts).hostnames == ("node3", "node1")


@pytest.mark.parametrize("name", sorted(CASES))
def test_agents_step_command_matches_golden_file(name):
    alloc, hosts, log_dir = CASES[name]
    step = job_nodes(alloc, hosts).step(hosts)
    cmd = srun_step.agents_step_command(step, log_dir, EXPORT, srun="srun")
    assert cmd[-3:] == [sys.executable, "-m", "slurmrun.node.agent_main"]
    text = (
        shlex.join([*cmd[:-3], "PYTHON", "-m", "slurmrun.node.agent_main"]).replace(
            " --", " \\\n  --"
        )
        + "\n"
    )
    _golden(f"srun_{name}.txt", text)


def _golden(name: str, text: str) -> None:
    golden = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()


# What `srun -N1 -n1 --gpus-per-task=1 --mem-per-cpu=100 -c2 python train.py` inside
# `salloc -N3 --gpus-per-node=2 --ntasks-per-node=2` leaves in the launcher's environment.
DRIVER_STEP_ENV = {
    "HOME": "/root",
    "PATH": "/usr/bin",
    "SLURM_CONF": "/etc/slurm/slurm.conf",
    "SLURM_JOB_ID": "77",
    "SLURM_JOBID": "77",
    "SLURM_JOB_NAME": "interactive",
    "SLURM_JOB_NODELIST": "node[1-3]",
    "SLURM_JOB_NUM_NODES": "3",
    "SLURM_JOB_CPUS_PER_NODE": "4(x3)",
    "SLURM_JOB_PARTITION": "debug",
    "SLURM_SUBMIT_DIR": "/home/u",
    "SLURM_NODELIST": "node[1-3]",
    "SLURM_NNODES": "1",
    "SLURM_NTASKS": "1",
    "SLURM_NPROCS": "1",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_TASKS_PER_NODE": "1",
    "SLURM_CPUS_PER_TASK": "2",
    "SRUN_CPUS_PER_TASK": "2",
    "SLURM_GPUS_PER_TASK": "1",
    "SLURM_GPUS_PER_NODE": "2",
    "SLURM_MEM_PER_CPU": "100",
    "SLURM_CPUS_PER_GPU": "1",
    "SLURM_DISTRIBUTION": "cyclic",
    "SLURM_EXACT": "1",
    "SLURM_EXPORT_ENV": "NONE",
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_STEP_NUM_TASKS": "1",
    "SLURM_STEP_NODELIST": "node1",
    "SLURM_STEP_GPUS": "0",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_CPUS_ON_NODE": "4",
    "SLURM_GPUS_ON_NODE": "1",
    "CUDA_VISIBLE_DEVICES": "0",
    "SLURMD_NODENAME": "node1",
}


def test_srun_environment_keeps_the_job_and_drops_what_reshapes_the_step():
    env = srun_step.srun_environment(DRIVER_STEP_ENV)
    text = "".join(f"{k}={v}\n" for k, v in sorted(env.items()))
    _golden("srun_env_driver_step.txt", text)
    for name in ("SLURM_JOB_ID", "SLURM_CONF", "SLURM_JOB_NODELIST", "HOME", "PATH"):
        assert name in env
    for name in ("SLURM_CPUS_PER_TASK", "SLURM_NTASKS", "SLURM_GPUS_PER_TASK", "SLURM_MEM_PER_CPU"):
        assert name not in env


def test_srun_environment_in_a_batch_script_keeps_what_a_step_would_drop():
    # 26.05 sets SLURM_STEP_ID=-5 in a batch script (the batch step's id): not a step.
    env = {**DRIVER_STEP_ENV, "SLURM_STEP_ID": "-5", "SLURM_STEPID": "-5"}
    kept = srun_step.srun_environment(env)
    assert kept["SLURM_STEP_NODELIST"] == "node1"
    assert kept["SLURM_PROCID"] == "0"


@pytest.mark.parametrize("version", ["22.05", "24.11", "26.05"])
def test_srun_environment_drops_every_input_variable_of_each_slurm_versions_srun(version):
    # srun's INPUT ENVIRONMENT VARIABLES, from the man page of that version's Debian package
    # (24.11 added SLURM_TRES_PER_TASK, which salloc/sbatch -c N set: it conflicts with
    # --ntasks-per-gpu in a step; 26.05 SLURM_TRES_BIND, SLURM_OOMKILLSTEP).
    names = (GOLDEN / "slurm" / version / "srun_input_vars.txt").read_text().split()
    env = srun_step.srun_environment(dict.fromkeys(names, "1"))
    assert sorted(env) == sorted(srun_step.SRUN_KEEP_VARS & set(names))


def test_srun_environment_outside_a_step_keeps_the_batch_node_gpus():
    # In the batch script (no step), CUDA_VISIBLE_DEVICES is the job's on its node.
    env = {"SLURM_JOB_ID": "7", "CUDA_VISIBLE_DEVICES": "0,1", "SLURM_NTASKS": "2"}
    assert srun_step.srun_environment(env) == {"SLURM_JOB_ID": "7", "CUDA_VISIBLE_DEVICES": "0,1"}


def _launch_starter(monkeypatch, tmp_path, log_dir_keep=True):
    """The starter and srun environment `run_attempt` builds for a launch on the job's nodes."""
    if shutil.which("srun") is None:  # pragma: no cover - the SLURM client is installed here
        fake = tmp_path / "bin" / "srun"
        fake.parent.mkdir()
        fake.write_text("#!/bin/sh\nexit 1\n")
        fake.chmod(0o755)
        monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    for name, value in DRIVER_STEP_ENV.items():
        if name != "PATH":
            monkeypatch.setenv(name, value)
    cfg = launcher.Launcher(extra_env_vars={"FROM_MAPPING": "mapped value"})
    alloc = _alloc([2, 2, 2], [4, 4, 4])
    hosts = ["node1", "node2", "node3"]
    plan = Plan(
        hostnames=hosts, workers_per_host=None, alloc=alloc, agents=Srun.of_job(alloc, hosts, [])
    )
    secret = "5ec7e7" * 10
    log_dir = LogDir(str(tmp_path), keep=log_dir_keep)
    start = plan.start(cfg, log_dir, secret=secret, advertise="10.0.0.1", port="1234")
    starter, env = start.starter, start.env
    assert isinstance(starter, SrunAgents)
    return starter, env, secret


def test_the_secret_never_goes_on_the_srun_command_line(monkeypatch, tmp_path):
    starter, env, secret = _launch_starter(monkeypatch, tmp_path)
    assert all(secret not in part for part in starter.command)
    assert env["SLURMRUN_SECRET"] == secret  # srun copies the value from its environment
    export = next(p for p in starter.command if p.startswith("--export="))
    names = export.removeprefix("--export=").split(",")
    assert "SLURMRUN_SECRET" in names
    # The log directory's mark is named here; its value is set when the starter starts.
    assert all(name in env for name in names if name != variables.LOG_DIR_MARK_VAR)


def test_the_launch_environment_has_the_mapping_and_not_the_driver_step(monkeypatch, tmp_path):
    starter, env, _ = _launch_starter(monkeypatch, tmp_path)
    export = next(p for p in starter.command if p.startswith("--export="))
    assert "FROM_MAPPING" in export.split("=", 1)[1].split(",")
    assert env["FROM_MAPPING"] == "mapped value"
    assert env[variables.JOB_TASKS_VAR] == "1,1,1"  # the job's tasks per node, not the step's
    for name in ("SLURM_CPUS_PER_TASK", "SLURM_GPUS_PER_TASK", "SLURM_MEM_PER_CPU", "SLURM_NTASKS"):
        assert name not in env
    assert any(p.startswith("--output=") for p in starter.command)


def test_without_log_files_the_nodes_get_no_output_path(monkeypatch, tmp_path):
    starter, _, _ = _launch_starter(monkeypatch, tmp_path, log_dir_keep=False)
    assert not any(p.startswith("--output") for p in starter.command)
    assert starter.log_file(1) == starter.log_path  # agents' output is in srun's own


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts fds in /proc")
@pytest.mark.parametrize("log_dir_var", ["", "kept"])
def test_failing_to_start_agents_leaks_no_socket_and_no_temp_dir(
    monkeypatch, tmp_path, log_dir_var
):
    # A job on two other machines, and no srun on PATH: srun_agents raises before the launch.
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    for name in [k for k in os.environ if k.startswith("SLURM")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "far[1-2]")
    monkeypatch.setenv("SLURM_JOB_CPUS_PER_NODE", "1(x2)")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "1(x2)")
    monkeypatch.setenv("SLURMRUN_LAUNCHER_ADDR", "127.0.0.1")
    kept = tmp_path / "logs"
    monkeypatch.setenv("SLURMRUN_LOG_DIR", "" if not log_dir_var else str(kept))
    before = _open_fds()
    with pytest.raises(RuntimeError, match="srun was not found") as info:
        launcher.launch(int, backend=None, timeout=5)
    # While the error (and its traceback's frames) lives, as in a caller that keeps it:
    assert info.value is not None
    assert _open_fds() <= before  # the server socket is closed
    assert list(temp.iterdir()) == []  # the temporary log directory is gone


def test_agent_start_failure_names_the_node_and_the_path(tmp_path):
    log = tmp_path / "srun.log"
    log.write_text(
        "srun: error: task 1 launch failed: Slurmd could not connect IO\n"
        "srun: error: task 0 launch failed: Slurmd could not connect IO\n"
    )
    failure = srun.agent_start_failure(str(log), ["node2", "node3"], "/shared/logs")
    assert failure is not None
    host, message = failure
    assert host == "node3"
    assert "/shared/logs/node3.agent.log" in message
    assert "SLURMRUN_LOG_DIR" in message
    log.write_text("srun: error: node2: task 0: Killed\n")
    assert srun.agent_start_failure(str(log), ["node2"], "/shared/logs") is None
    assert srun.agent_start_failure(str(tmp_path / "missing"), ["node2"], "/x") is None


def test_a_node_srun_cannot_reach_is_the_one_blamed(tmp_path):
    # srun ends the whole step: the other agents' connections close too, and say nothing.
    log = tmp_path / "srun.log"
    log.write_text(
        "srun: error: Task launch for StepId=2.3 failed on node node2: Communication "
        "connection failure\nsrun: error: Application launch failed: Communication connection "
        "failure\nsrun: error: node1: task 0: Killed\n"
    )
    failure = srun.agent_start_failure(str(log), ["node1", "node2", "node3"], "/shared/logs")
    assert failure is not None
    host, message = failure
    assert host == "node2"
    assert "Communication connection failure" in message and "slurmd does not answer" in message


def test_address_toward_a_host_is_a_local_address():
    assert address.address_toward("127.0.0.1") == "127.0.0.1"


def test_address_toward_an_unknown_host_says_how_to_override():
    with pytest.raises(RuntimeError, match="SLURMRUN_LAUNCHER_ADDR"):
        address.address_toward("no-such-host.invalid")
