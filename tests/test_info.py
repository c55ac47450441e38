"""``slurmrun info``: outside SLURM, with job environments, its warnings, and ``--json``."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slurmrun.cli import info
from slurmrun.devices import usable_cpu_count
from slurmrun.slurm.job_end import JobEnd, job_end
from tests.test_dry_run import JOB, UPDATE, _environ, normalise

GOLDEN = Path(__file__).parent / "golden"


@pytest.fixture(autouse=True)
def _no_real_job_end(request, monkeypatch):
    """The fake job 4242 is nobody's: scontrol (which may be slow, or know a real 4242) is
    not asked how it ends nor the controller's version; the tests of those parts call
    `job_end` themselves, or give info a scontrol of their own."""
    monkeypatch.setattr(info, "job_end", lambda job_id, scontrol=None: None)
    monkeypatch.setattr(info, "scontrol", lambda args, timeout=10: None, raising=False)


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.write_text(text)
    assert text == path.read_text()


def _machine_neutral(text: str, data: dict) -> str:
    """Replaces what this machine says of itself (and the local plan's CPU count)."""
    text = re.sub(r"(?m)^  this process: .*$", "  this process:     <this machine>", text)
    if data["slurm"] is None:  # the local agent's workers: one per usable CPU
        cpus = usable_cpu_count()
        text = re.sub(rf"expected {cpus}\b", "expected NCPU", text)
    return text


def test_outside_slurm_says_so_and_shows_the_localhost_plan(monkeypatch, tmp_path, capsys):
    _environ(monkeypatch, tmp_path, CUDA_VISIBLE_DEVICES="")  # the same plan on GPU machines
    assert info.main([]) == 0
    text = capsys.readouterr().out
    data = info.gather()
    assert data["slurm"] is None
    assert data["launch"]["hosts"] == ["localhost"]
    assert data["warnings"] == []
    _golden("info_outside_slurm.txt", _machine_neutral(normalise(text), data))


def test_json_is_the_same_data(monkeypatch, tmp_path, capsys):
    _environ(monkeypatch, tmp_path, SLURMRUN_LAUNCHER_ADDR="10.0.0.1", **JOB)
    assert info.main(["--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = info.gather()
    for data in (printed, expected):  # log directories are named by the time
        data["launch"]["log_dir"] = None
        data["launch"]["commands"] = [
            [a for a in c if "--output" not in a] for c in data["launch"]["commands"]
        ]
    assert printed == expected


def test_job_shell_shows_each_figure_and_where_it_came_from(monkeypatch, tmp_path):
    env = {**JOB, "SLURM_GPUS_PER_NODE": "2", "SLURMRUN_LAUNCHER_ADDR": "10.0.0.1"}
    _environ(monkeypatch, tmp_path, **env)
    data = info.gather()
    slurm = data["slurm"]
    assert slurm["nodelist"] == "node[1-3]"
    assert slurm["hostnames"] == ["node1", "node2", "node3"]
    assert slurm["sources"] == {
        "job_id": "SLURM_JOB_ID",
        "hostnames": "SLURM_JOB_NODELIST",
        "cpus_per_node": "SLURM_JOB_CPUS_PER_NODE",
        "tasks_per_node": "SLURM_TASKS_PER_NODE",
        "gpus_per_node": "SLURM_GPUS_PER_NODE",
    }
    assert [n["gpus"] for n in slurm["nodes"]] == [2, 2, 2]
    assert data["launch"]["expected_workers"] == [2, 2, 2]
    assert data["warnings"] == []
    _golden("info_job_shell.txt", _machine_neutral(normalise(info.render(data)), data) + "\n")


def test_a_step_of_two_tasks_is_a_warning_and_the_plan_is_still_shown(monkeypatch, tmp_path):
    step = {"SLURM_STEP_ID": "3", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0"}
    # Job 4242 does not exist: scontrol answers nothing, and info carries on without it.
    _environ(monkeypatch, tmp_path, SLURMRUN_LAUNCHER_ADDR="10.0.0.1", **JOB, **step)
    data = info.gather()
    assert data["slurm"]["step"] == {"step_id": "4242.3", "num_tasks": 2, "proc_id": 0}
    (warning,) = data["warnings"]
    assert "4242.3 of 2 tasks" in warning
    assert data["launch"]["hosts"] == ["node1", "node2", "node3"]


def test_a_node_list_that_does_not_resolve_is_a_warning(monkeypatch, tmp_path):
    _environ(monkeypatch, tmp_path, **{**JOB, "SLURM_JOB_NODELIST": "nosuch[1-3].invalid"})
    data = info.gather()
    (warning,) = data["warnings"]
    assert "does not resolve" in warning
    assert "nosuch1.invalid" in warning
    assert data["launch"] is None
    assert "nosuch1.invalid" in info.render(data)


def test_malformed_slurm_variables_are_a_warning(monkeypatch, tmp_path):
    _environ(monkeypatch, tmp_path, **{**JOB, "SLURM_JOB_CPUS_PER_NODE": "four"})
    data = info.gather()
    assert data["slurm"] is None
    assert any("SLURM_JOB_CPUS_PER_NODE='four'" in w for w in data["warnings"])


def test_gpus_this_node_sees_but_the_agents_step_would_not_ask_for(monkeypatch, tmp_path):
    # The batch shell of a GPU job whose variables do not say GPUs per node (and scontrol does
    # not know job 4242): the agents' step would ask for none.
    env = {**JOB, "SLURMD_NODENAME": "node1", "CUDA_VISIBLE_DEVICES": "0,1"}
    _environ(monkeypatch, tmp_path, SLURMRUN_LAUNCHER_ADDR="10.0.0.1", **env)
    data = info.gather()
    (warning,) = data["warnings"]
    assert "node1: 2" in warning
    assert "would ask for none" in warning


def test_python_m_slurmrun_cli_info_runs(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    cp = subprocess.run(
        [sys.executable, "-m", "slurmrun.cli.info", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=env,
        cwd=tmp_path,
    )
    assert json.loads(cp.stdout)["slurm"] is None
    bad = subprocess.run(
        [sys.executable, "-m", "slurmrun.cli.info", "--nope"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    assert bad.returncode == 2
    assert "--nope" in bad.stderr


# What the test cluster's scontrol printed (2026-11-25), cut to the fields that matter.
SHOW_JOB = """\
JobId=66 JobName=job.sh
   UserId=root(0) GroupId=root(0) MCS_label=N/A
   JobState=RUNNING Reason=None Dependency=(null)
   Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0
   RunTime=00:00:03 TimeLimit=00:05:00 TimeMin=N/A
   SubmitTime=2026-11-25T10:17:33 EligibleTime=2026-11-25T10:17:33
   StartTime=2026-11-25T10:17:33 EndTime=2026-11-25T10:22:33 Deadline=N/A
   PreemptEligibleTime=2026-11-25T10:17:33 PreemptTime=None
   Partition=debug AllocNode:Sid=slurmctl:1
   NodeList=node[1-2]
"""
SHOW_PARTITION = (
    "PartitionName=debug AllowGroups=ALL Default=YES DefaultTime=NONE GraceTime=20 Hidden=NO "
    "Nodes=node[1-3] PriorityJobFactor=1 PriorityTier=1 OverTimeLimit=NONE "
    "PreemptMode=REQUEUE State=UP TotalCPUs=12 TotalNodes=3\n"
)
SHOW_CONFIG = (
    "Configuration data as of 2026-11-25T10:20:00\n"
    "KillOnBadExit           = 0\n"
    "KillWait                = 5 sec\n"
    "PreemptMode             = REQUEUE\n"
    "PreemptType             = preempt/partition_prio\n"
)


def _scontrol(outputs):
    def scontrol(args):
        return outputs.get(args[1])

    return scontrol


def test_job_end_reads_the_time_limit_killwait_and_the_partitions_grace():
    outputs = {"job": SHOW_JOB, "partition": SHOW_PARTITION, "config": SHOW_CONFIG}
    end = job_end("66", _scontrol(outputs))
    assert end == JobEnd(
        time_limit="00:05:00",
        end_time="2026-11-25T10:22:33",
        kill_wait=5,
        partition="debug",
        preempt_mode="REQUEUE",
        grace_time=20,
        preempt_type="preempt/partition_prio",
    )
    assert end.preemptible
    lines = info._ending_lines({**dataclasses.asdict(end), "preemptible": True})
    assert lines[0] == (
        "  time limit:       00:05:00, ends 2026-11-25T10:22:33; then SIGTERM, and SIGKILL 5 s "
        "later (KillWait)"
    )
    assert lines[1] == (
        "  preemption:       REQUEUE (partition debug); then SIGTERM, again 20 s later "
        "(GraceTime), and SIGKILL 5 s later (KillWait)"
    )
    qos = dataclasses.replace(end, preempt_type="preempt/qos")
    assert info._ending_lines({**dataclasses.asdict(qos), "preemptible": True})[1] == (
        "  preemption:       REQUEUE (partition debug); the job's QOS sets its GraceTime"
    )


def test_job_end_without_preemption_an_unlimited_job_or_an_unknown_one():
    job = SHOW_JOB.replace("TimeLimit=00:05:00", "TimeLimit=UNLIMITED").replace(
        "EndTime=2026-11-25T10:22:33", "EndTime=Unknown"
    )
    partition = SHOW_PARTITION.replace("PreemptMode=REQUEUE", "PreemptMode=OFF")
    end = job_end("66", _scontrol({"job": job, "partition": partition, "config": ""}))
    assert end is not None and not end.preemptible
    assert (end.time_limit, end.end_time, end.kill_wait) == ("UNLIMITED", None, None)
    lines = info._ending_lines({**dataclasses.asdict(end), "preemptible": False})
    assert lines[:2] == [
        "  time limit:       UNLIMITED; then SIGTERM, and SIGKILL ? s later (KillWait)",
        "  preemption:       none (OFF, ?)",
    ]
    assert job_end("4242", _scontrol({})) is None  # scontrol does not know the job
    # PreemptType=preempt/none: nothing preempts, whatever the mode says
    config = SHOW_CONFIG.replace("preempt/partition_prio", "preempt/none")
    outputs = {"job": SHOW_JOB, "partition": SHOW_PARTITION, "config": config}
    assert not job_end("66", _scontrol(outputs)).preemptible  # type: ignore[union-attr]


@pytest.mark.parametrize("version", ["22.05", "24.11", "26.05"])
def test_info_names_the_slurm_version_read_once_from_the_controllers_config(
    monkeypatch, tmp_path, version
):
    """Issue 50: the controller's SLURM_VERSION field (``scontrol show config``), which
    `job_end` reads too: scontrol is asked for it once."""
    slurm = GOLDEN / "slurm" / version
    outputs = {
        ("show", "job", "4242"): (slurm / "job_cpu.txt").read_text(),
        ("show", "partition", "debug"): (slurm / "partition.txt").read_text(),
        ("show", "config"): (slurm / "config.txt").read_text(),
    }
    asked: list[tuple[str, ...]] = []

    def scontrol(args, timeout=10):
        asked.append(tuple(args))
        return outputs.get(tuple(args))

    monkeypatch.setattr(info, "scontrol", scontrol, raising=False)
    monkeypatch.setattr(info, "job_end", job_end)
    env = {**JOB, "SLURM_GPUS_PER_NODE": "2", "SLURMRUN_LAUNCHER_ADDR": "10.0.0.1"}
    _environ(monkeypatch, tmp_path, **env)
    data = info.gather()
    expected = (slurm / "version.txt").read_text().split()[-1]  # "slurm-wlm 26.05.5"
    assert data["slurm"]["version"] == expected
    assert f"  SLURM version:    {expected} (scontrol show config: SLURM_VERSION)" in (
        info.render(data).splitlines()
    )
    assert data["slurm"]["ending"]["partition"] == "debug"  # job_end read the same config
    assert asked.count(("show", "config")) == 1


def test_info_says_when_the_slurm_version_is_unknown(monkeypatch, tmp_path):
    _environ(monkeypatch, tmp_path, SLURMRUN_LAUNCHER_ADDR="10.0.0.1", **JOB)
    data = info.gather()
    assert data["slurm"]["version"] is None
    assert "  SLURM version:    unknown (scontrol show config did not answer)" in (
        info.render(data).splitlines()
    )
