"""Launcher.dry_run: the printed plan (golden files; UPDATE_GOLDEN=1 rewrites), its checks, and
that it starts nothing and agrees with what run starts."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
import threading
from pathlib import Path

import psutil
import pytest

import slurmrun
from slurmrun.devices import usable_cpu_count
from slurmrun.errors import AgentFailedError
from slurmrun.launcher.agents.srun_step import SrunAgents
from slurmrun.launcher.dryrun import plan_dry_run
from slurmrun.launcher.elastic import without_lost_host
from slurmrun.launcher.plan import make_plan
from slurmrun.logs import LogDir

GOLDEN = Path(__file__).parent / "golden"
UPDATE = bool(os.environ.get("UPDATE_GOLDEN"))  # read before tests replace the environment
SECRET_VALUE = "0ddba11" * 8

# A 3-node CPU job seen from its own shell (salloc or the batch script).
JOB = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "node[1-3]",
    "SLURM_JOB_NUM_NODES": "3",
    "SLURM_JOB_CPUS_PER_NODE": "4(x3)",
    "SLURM_TASKS_PER_NODE": "2(x3)",
}


def _environ(monkeypatch, tmp_path, **variables):
    """The launcher's whole environment: only these variables (and PATH, HOME)."""
    for name in list(os.environ):
        monkeypatch.delenv(name)
    srun = shutil.which("srun", path="/usr/bin:/bin")
    path = "/usr/bin:/bin"
    if srun is None:  # pragma: no cover - the SLURM client is installed where tests run
        fake = tmp_path / "bin" / "srun"
        fake.parent.mkdir()
        fake.write_text("#!/bin/sh\nexit 1\n")
        fake.chmod(0o755)
        path = f"{fake.parent}:{path}"
    base = {"PATH": path, "HOME": "/home/u", "SLURMRUN_LOG_DIR": "/logs"}
    for name, value in {**base, **variables}.items():
        monkeypatch.setenv(name, value)


def normalise(text: str) -> str:
    """Replaces what varies between machines and runs: interpreter, srun, times, cwd."""
    srun = shutil.which("srun")
    text = text.replace(sys.executable, "PYTHON")
    if srun:
        text = text.replace(srun, "srun")
    text = text.replace(os.getcwd(), "CWD")
    return re.sub(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d-\d{6}", "<time>", text)


def golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.write_text(text)
    assert text == path.read_text()


def work() -> int:
    return int(os.environ["RANK"])


CASES = {
    # The job's nodes from its shell: one srun step, the job's tasks per node as workers.
    "cpu_three_nodes": (JOB, {}),
    # GPUs per node, a fixed port and address, a mapping of extra variables, fixed workers.
    "gpus_fixed_port": (
        {
            **JOB,
            "SLURM_GPUS_PER_NODE": "a100:2",
            "SLURMRUN_LAUNCHER_PORT": "29400",
            "SLURMRUN_LAUNCHER_ADDR": "10.1.2.3",
            "NCCL_DEBUG": "WARN",
        },
        {"extra_env_vars": {"MY_FLAG": "1"}, "hostnames": ["node3", "node1"]},
    ),
    # Outside SLURM: local agents, one command each; log files off.
    "localhost_two_agents": (
        {"SLURMRUN_LOG_DIR": ""},
        {"hostnames": ["localhost", "localhost"], "workers_per_host": [2, 1], "backend": None},
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_dry_run_text_matches_golden_file(monkeypatch, tmp_path, name):
    env, options = CASES[name]
    _environ(monkeypatch, tmp_path, **{"SLURMRUN_LAUNCHER_ADDR": "10.0.0.1", **env})
    plan = slurmrun.Launcher(**options).dry_run(work)
    golden(f"dry_run_{name}.txt", normalise(str(plan)) + "\n")
    assert json.loads(plan.to_json()) == plan.as_dict()


def test_dry_run_shows_no_secret_value_and_names_the_variables_agents_get(monkeypatch, tmp_path):
    # A secret inherited from an outer launch must not show either.
    # The address is given: node1 resolves only while the test cluster is up.
    _environ(
        monkeypatch,
        tmp_path,
        SLURMRUN_SECRET=SECRET_VALUE,
        MY_TOKEN="t0ken",
        SLURMRUN_LAUNCHER_ADDR="10.0.0.1",
        **JOB,
    )
    plan = slurmrun.Launcher(extra_env_vars=("MY_*",)).dry_run(work)
    for text in (str(plan), plan.to_json()):
        assert SECRET_VALUE not in text
        assert "t0ken" not in text
    assert {"SLURMRUN_SECRET", "MY_TOKEN", "PATH", "SLURMRUN_JOB_TASKS_PER_NODE"} <= set(
        plan.env_names
    )
    (command,) = plan.commands
    assert f"--export={','.join(plan.env_names)}" in command
    assert plan.expected_workers == (2, 2, 2)
    assert plan.world_size is None
    assert plan.expected_world_size == 6


def _error(call):
    try:
        call()
    except Exception as e:
        return type(e), str(e)
    raise AssertionError("no error")


def _unpicklable():
    lock = threading.Lock()
    return lambda: lock


BAD = {
    "workers_per_host_zero": ({}, {"workers_per_host": 0}, work),
    "hostnames_mismatch": ({}, {"hostnames": ["a", "b"], "workers_per_host": [1]}, work),
    "slurm_outside_a_job": ({}, {"hostnames": "slurm"}, work),
    "other_machines_outside_slurm": ({}, {"hostnames": ["elsewhere"]}, work),
    "not_a_node_of_the_job": (JOB, {"hostnames": ["node9"]}, work),
    "bad_port": ({"SLURMRUN_LAUNCHER_PORT": "http"}, {}, work),
    "bad_log_level": ({"SLURMRUN_LOG_LEVEL": "LOUD"}, {}, work),
    "unpicklable": ({}, {}, _unpicklable()),
    "not_callable": ({}, {}, 42),
    "unresolvable_first_node": (
        {**JOB, "SLURM_JOB_NODELIST": "nosuch[1-3].invalid"},
        {},
        work,
    ),
    "two_task_step": (
        {**JOB, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"},
        {},
        work,
    ),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_dry_run_refuses_what_run_refuses_with_the_same_error(monkeypatch, tmp_path, name):
    env, options, func = BAD[name]
    _environ(monkeypatch, tmp_path, **env)
    launcher = slurmrun.Launcher(**options)
    expected = _error(lambda: launcher.run(func))
    assert _error(lambda: launcher.dry_run(func)) == expected
    assert psutil.Process().children() == []


def test_dry_run_starts_nothing(monkeypatch, tmp_path):
    logs = tmp_path / "logs"
    _environ(
        monkeypatch, tmp_path, SLURMRUN_LOG_DIR=str(logs), SLURMRUN_LAUNCHER_ADDR="10.0.0.1", **JOB
    )
    before = {c.fd for c in psutil.Process().net_connections()}
    plan = slurmrun.Launcher().dry_run(work)
    assert plan.log_dir is not None
    assert plan.log_dir.startswith(str(logs))
    assert not logs.exists()
    assert psutil.Process().children() == []
    assert {c.fd for c in psutil.Process().net_connections()} == before


def test_dry_run_expects_the_workers_a_local_launch_starts(monkeypatch):
    # No SLURM: the agent decides (one per usable CPU here); the dry run predicts it with the
    # agents' own rule and this machine's CPUs.
    for name in [n for n in os.environ if n.startswith("SLURM")]:
        monkeypatch.delenv(name)
    launcher = slurmrun.Launcher(backend=None, timeout=60)
    plan = launcher.dry_run(socket.gethostname)
    result = launcher.run(lambda: int(os.environ["WORLD_SIZE"]))
    ranks = [len(host) for host in result.return_values]
    assert plan.hosts == ("localhost",)
    assert list(plan.expected_workers) == ranks
    assert plan.expected_workers == (usable_cpu_count(),)
    assert {v for host in result.return_values for v in host} == {plan.expected_world_size}


def test_cli_dry_run_with_an_unresolvable_host_says_so_in_one_line(monkeypatch, tmp_path, capsys):
    from slurmrun.cli.main import main

    _environ(monkeypatch, tmp_path)
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    status = main(["--dry-run", "--hostnames", "nosuchhost.invalid", str(script)])
    err = capsys.readouterr().err
    assert status == 1
    assert "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line.startswith("slurmrun: RuntimeError: cannot resolve node 'nosuchhost.invalid'")
    assert "set SLURMRUN_LAUNCHER_ADDR" in line


# `scontrol show job -d 4242` for JOB, with GPUs per node that no variable of JOB tells.
SCONTROL_JOB = """JobId=4242 JobName=train
   NumNodes=3 NumCPUs=12 NumTasks=6 CPUs/Task=1 ReqB:S:C:T=0:0:*:*
   NtasksPerN:B:S:C=2:0:*:*
     Nodes=node[1-2] CPU_IDs=0-3 Mem=0 GRES=gpu:2(IDX:0-1)
     Nodes=node3 CPU_IDs=0-3 Mem=0 GRES=gpu:1(IDX:0)
"""
DRIVER_STEP = {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}


@pytest.mark.skipif(sys.platform == "win32", reason="uses shell scripts as scontrol and srun")
@pytest.mark.parametrize("where", ["job_shell", "driver_step"])
def test_scontrol_is_asked_once_by_plan_dry_run_agent_starts_and_a_smaller_restart(
    monkeypatch, tmp_path, where
):
    # What run does after make_plan: a dry run, one agents' start per attempt, the plan without a
    # lost node; none of them asks SLURM for the job's facts again (the fake scontrol counts its
    # calls, one line each).
    fake = tmp_path / "fakebin"
    fake.mkdir()
    calls = tmp_path / "calls"
    (tmp_path / "job.txt").write_text(SCONTROL_JOB)
    (fake / "scontrol").write_text(f'#!/bin/sh\necho "$*" >> "{calls}"\ncat "{tmp_path}/job.txt"\n')
    (fake / "srun").write_text("#!/bin/sh\nexit 1\n")
    for script in fake.iterdir():
        script.chmod(0o755)
    step = DRIVER_STEP if where == "driver_step" else {}
    # The launcher's address is given: the job's nodes need not resolve on this machine.
    _environ(
        monkeypatch,
        tmp_path,
        PATH=f"{fake}:/usr/bin:/bin",
        SLURMRUN_LAUNCHER_ADDR="127.0.0.1",
        **JOB,
        **step,
    )
    cfg = slurmrun.Launcher(min_hosts=2, max_restarts=1)
    log_dir = LogDir(str(tmp_path / "logs"), keep=True)
    plan = make_plan(cfg)
    dry = plan_dry_run(cfg, plan)
    starts = [
        plan.start(cfg, log_dir, secret="s", advertise="10.0.0.1", port="1").starter
        for _attempt in range(2)
    ]
    # The next attempt's plan after node3 is lost: its step from the facts read at planning.
    lost = AgentFailedError("the agent on node3 sent nothing for 5 s", hostname="node3")
    smaller = without_lost_host(cfg, plan, lost)
    # the job's facts once; after the failure, only which nodes SLURM marks down (none here)
    assert calls.read_text().splitlines() == ["show job -d 4242", "show node node1,node2,node3"]
    assert smaller is not None
    step = smaller.agents.step(smaller.hostnames)
    assert step.gpus_per_node == 2  # node1 and node2 have 2 each: node3 had 1
    assert step.hostnames == step.task_order == ("node1", "node2")
    # scontrol's answer reaches the step: the fewest GPUs of any node, asked on every node.
    (command,) = dry.commands
    assert "--gres=gpu:1" in command
    assert all(isinstance(s, SrunAgents) and "--gres=gpu:1" in s.command for s in starts)
    assert dry.expected_workers == (1, 1, 1)


def test_every_hostname_given_spares_too_must_be_a_node_of_the_job(monkeypatch, tmp_path):
    _environ(monkeypatch, tmp_path, SLURMRUN_LAUNCHER_ADDR="127.0.0.1", **JOB)
    good = slurmrun.Launcher(hostnames=["node1", "node2", "node3"], hosts=2, max_restarts=1)
    assert good.dry_run(print).spares == ("node3",)
    bad = slurmrun.Launcher(hostnames=["node1", "node2", "elsewhere"], hosts=2, max_restarts=1)
    with pytest.raises(slurmrun.OptionsValueError, match=r"\['elsewhere'\] are not nodes of SLURM"):
        bad.dry_run(print)
