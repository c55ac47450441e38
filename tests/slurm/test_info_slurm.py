"""``python -m slurmrun.cli.info`` on the real cluster: salloc, sbatch, inside a step, 2 tasks."""

from __future__ import annotations

import json
import sys

import pytest

from tests.slurm.conftest import JOB_NAME, REPO, wait_job

# This checkout's slurmrun, whatever is installed.
ENV = {"PYTHONPATH": str(REPO)}
INFO = [sys.executable, "-m", "slurmrun.cli.info"]


def _salloc(run_cmd, salloc_args, argv, timeout=60.0):
    return run_cmd(
        ["salloc", f"--job-name={JOB_NAME}", "--time=2", *salloc_args, *argv],
        timeout=timeout,
        env=ENV,
    )


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_info_in_salloc_shows_the_job_and_the_srun_plan(run_cmd, node_processes):
    data = json.loads(_salloc(run_cmd, ["-N3"], [*INFO, "--json"]).stdout)
    slurm = data["slurm"]
    assert slurm["hostnames"] == ["node1", "node2", "node3"]
    assert slurm["step"] is None
    assert slurm["sources"]["hostnames"] == "SLURM_JOB_NODELIST"
    launch = data["launch"]
    assert launch["agents"] == "srun"
    assert launch["job_id"] == slurm["job_id"]
    assert "--nodes=3" in launch["commands"][0]
    assert data["warnings"] == []
    # how SLURM ends the job: the test cluster's KillWait=5, debug's PreemptMode and GraceTime
    assert {k: v for k, v in slurm["ending"].items() if k != "end_time"} == {
        "time_limit": "00:02:00",
        "kill_wait": 5,
        "partition": "debug",
        "preempt_mode": "REQUEUE",
        "grace_time": 0,
        "preempt_type": "preempt/partition_prio",
        "preemptible": True,
    }
    assert slurm["ending"]["end_time"][:4].isdigit()
    # the controller's version: the same as scontrol's own here (issue 50)
    assert slurm["version"] == run_cmd(["scontrol", "--version"]).stdout.split()[-1]
    text = _salloc(run_cmd, ["-N3"], INFO).stdout
    assert "SLURM job" in text
    assert "node[1-3] (from SLURM_JOB_NODELIST)" in text
    assert "time limit:       00:02:00, ends " in text
    assert "then SIGTERM, and SIGKILL 5 s later (KillWait)" in text
    assert "preemption:       REQUEUE (partition debug), GraceTime 0: ended at once" in text
    assert node_processes() == {}


def test_info_in_sbatch_runs_on_the_batch_node(sbatch, node_processes):
    result = sbatch(f"export PYTHONPATH={REPO}\n{' '.join(INFO)} --json\n", args=["-N2"])
    data = json.loads(result.output)
    assert data["this_process"]["hostname"] == "node1"
    assert data["this_process"]["node_of_the_job"] is True
    assert data["slurm"]["step"] is None
    assert data["launch"]["hosts"] == ["node1", "node2"]
    assert data["warnings"] == []
    assert node_processes() == {}


def test_info_inside_a_step_reads_the_job_from_scontrol(run_cmd, node_processes):
    cp = _salloc(run_cmd, ["-N2", "--gpus-per-node=2"], ["srun", "-N1", "-n1", *INFO, "--json"])
    data = json.loads(cp.stdout)
    slurm = data["slurm"]
    assert slurm["step"]["num_tasks"] == 1
    assert [n["gpus"] for n in slurm["nodes"]] == [2, 2]
    assert slurm["sources"]["gpus_per_node"] == "scontrol show job -d"
    assert "--gres=gpu:2" in data["launch"]["commands"][0]
    assert data["launch"]["expected_workers"] == [2, 2]
    assert data["warnings"] == []
    assert node_processes() == {}


def _counts(compressed: str) -> list[int]:
    """``3,1`` or ``2(x2)`` (SLURM_TASKS_PER_NODE) as ``[3, 1]`` or ``[2, 2]``."""
    counts: list[int] = []
    for part in compressed.split(","):
        count, _, times = part.partition("(x")
        counts += [int(count)] * int(times.rstrip(")") or 1)
    return counts


def test_info_inside_a_step_reads_no_word_of_the_users_command_line(
    run_cmd, tmp_path, node_processes
):
    # Issue 50: scontrol shows the user's command line (22.05 a batch script's arguments in
    # Command=, 26.05 the whole submit line in SubmitLine=); its words that look like the
    # job's fields are not the job's.
    script = tmp_path / "job.sh"
    script.write_text(
        f"#!/bin/bash\nexport PYTHONPATH={REPO}\n"
        f'echo "$SLURM_TASKS_PER_NODE" > {tmp_path}/tasks\n'
        f"srun -N1 -n1 {' '.join(INFO)} --json > {tmp_path}/info.json\n"
    )
    out = tmp_path / "job.out"
    words = ["NumTasks=3", "Nodes=node1", "GRES=gpu:8"]
    shape = ["-N2", "-n4", "--gpus-per-node=1"]
    argv = ["sbatch", "--parsable", f"--job-name={JOB_NAME}", "--time=2", f"--output={out}"]
    job_id = run_cmd([*argv, *shape, str(script), *words]).stdout.strip().split(";")[0]
    assert wait_job(job_id, 60, out)["ExitCode"] == "0:0", out.read_text()
    nodes = json.loads((tmp_path / "info.json").read_text())["slurm"]["nodes"]
    tasks = _counts((tmp_path / "tasks").read_text().strip())  # as SLURM set it in the job
    assert [(n["tasks"], n["gpus"]) for n in nodes] == [(t, 1) for t in tasks]
    assert sum(tasks) == 4
    assert node_processes() == {}


def test_info_in_a_step_of_two_tasks_warns(run_cmd, tmp_path, node_processes):
    # Each task writes its own file (two JSON documents on one stdout would interleave).
    script = f"{' '.join(INFO)} --json > {tmp_path}/info.$SLURM_PROCID.json"
    _salloc(run_cmd, ["-N2"], ["srun", "-N2", "-n2", "bash", "-c", script])
    for task in (0, 1):
        data = json.loads((tmp_path / f"info.{task}.json").read_text())
        assert data["slurm"]["step"]["num_tasks"] == 2
        assert any("of 2 tasks" in w for w in data["warnings"])
        assert data["launch"]["hosts"] == ["node1", "node2"]
    assert node_processes() == {}


def test_dry_run_predicts_what_run_starts_on_the_cluster(run_in_allocation, node_processes):
    script = """
    import json, os
    import slurmrun

    launcher = slurmrun.Launcher(timeout=60)
    plan = launcher.dry_run(lambda: None)
    result = launcher.run(lambda: os.environ["SLURMD_NODENAME"])
    print("PLAN " + plan.to_json(indent=None))
    print("RUN " + json.dumps(result.return_values))
    """
    cp = run_in_allocation(["-N2", "--ntasks-per-node=2"], script, timeout=90, env=ENV)
    lines = dict(line.split(" ", 1) for line in cp.stdout.splitlines() if " " in line)
    plan, ran = json.loads(lines["PLAN"]), json.loads(lines["RUN"])
    assert plan["hosts"] == ["node1", "node2"]
    assert [len(host) for host in ran] == plan["expected_workers"] == [2, 2]
    assert [host[0] for host in ran] == plan["hosts"]
    assert node_processes() == {}
