"""``slurmrun info``: outside SLURM, with job environments, its warnings, and ``--json``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from slurmrun import allocation
from slurmrun.cli import info
from tests.test_dry_run import JOB, UPDATE, _environ, normalise

GOLDEN = Path(__file__).parent / "golden"


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.write_text(text)
    assert text == path.read_text()


def _machine_neutral(text: str, data: dict) -> str:
    """Replaces what this machine says of itself (and the local plan's CPU count)."""
    text = re.sub(r"(?m)^  this process: .*$", "  this process:     <this machine>", text)
    if data["slurm"] is None:  # the local agent's workers: one per usable CPU
        cpus = allocation.usable_cpu_count()
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
