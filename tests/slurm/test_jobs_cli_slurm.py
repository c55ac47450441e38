"""`slurmrun submit`, `status`, `logs`, `cancel` and `jobs` on the real cluster."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.slurm.slurm_helpers import wait_for

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """\
import os
import sys
import time

import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
names = [None] * dist.get_world_size()
dist.all_gather_object(names, os.environ["SLURMD_NODENAME"])
print(f"rank {rank} on {names[rank]} args {sys.argv[1:]}", flush=True)
if sys.argv[1:] == ["--talk"]:
    for i in range(600):
        print(f"rank {rank} line {i}", flush=True)
        time.sleep(0.2)
dist.destroy_process_group()
"""


def slurmrun(tmp_path: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "slurmrun", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
        env=env,
        check=False,
    )


def _wait_completed(tmp_path: Path, job_id: str, what: str = "completion") -> None:
    wait_for(
        lambda: "COMPLETED" in slurmrun(tmp_path, "status", job_id).stdout, 120, what, every=0.5
    )


@pytest.fixture
def script(tmp_path: Path) -> str:
    (tmp_path / "train.py").write_text(SCRIPT)
    return "train.py"


def test_submit_a_map_of_a_scripts_lines(slurm_cluster, tmp_path):
    """`slurmrun submit --map ARGS_FILE`: one job runs the script once per line, per GPU."""
    (tmp_path / "train.py").write_text(
        "import os, sys\n"
        "name = f'run{sys.argv[2]}.txt'\n"
        "with open(name, 'w') as f:\n"
        "    f.write(os.environ['SLURMD_NODENAME'] + ' ' + os.environ['CUDA_VISIBLE_DEVICES'])\n"
        "sys.exit(int(sys.argv[2] == '3') * 7)\n"
    )
    (tmp_path / "args.txt").write_text("".join(f"--k {k}\n" for k in range(4)))
    head = ["submit", "--map", "args.txt", "--nodes", "2", "--gpus-per-node", "2"]
    done = slurmrun(tmp_path, *head, "--time", "0:05:00", "train.py")
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    assert f"submitted job {job_id} (a map of 4 items) to cluster" in done.stderr
    try:
        _wait_completed(tmp_path, job_id)  # the job ends well: its outcome says which failed
    finally:
        slurmrun(tmp_path, "cancel", job_id)
    status = slurmrun(tmp_path, "status", job_id).stdout
    assert "failed: MapFailedError: 1 of 4 items failed" in status, status
    assert "item 3: ScriptExit" in status, status
    runs = [(tmp_path / f"run{k}.txt").read_text().split() for k in range(4)]
    assert {node for node, _ in runs} <= {"node1", "node2"}, runs
    assert {gpu for _, gpu in runs} <= {"0", "1"}, "one GPU a run"
    assert "map args.txt script train.py" in slurmrun(tmp_path, "jobs").stdout


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_submit_status_logs_jobs(slurm_cluster, tmp_path, script):
    done = slurmrun(tmp_path, "submit", "--nodes", "2", "--time", "0:05:00", script, "--lr", "3")
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    assert job_id.isdigit()
    assert f"submitted job {job_id} to cluster slurmtest, partition debug\n" in done.stderr
    try:
        _wait_completed(tmp_path, job_id)
    finally:
        slurmrun(tmp_path, "cancel", job_id)
    status = slurmrun(tmp_path, "status", job_id)
    assert status.stdout.splitlines() == [f"{job_id} COMPLETED", "every rank finished (2 workers)"]
    for rank, node in ((0, "node1"), (1, "node2")):
        logs = slurmrun(tmp_path, "logs", job_id, "--rank", str(rank))
        assert logs.returncode == 0
        assert f"rank {rank} on {node} args ['--lr', '3']" in logs.stdout
    listed = slurmrun(tmp_path, "jobs").stdout.splitlines()
    assert listed[0].split() == ["JOBID", "STATE", "SUBMITTED", "WHAT"]
    assert listed[1].split()[:2] == [job_id, "COMPLETED"]
    assert listed[1].endswith("script train.py --lr 3")


def test_follow_ends_with_the_job_and_cancel_stops_it(slurm_cluster, tmp_path, script):
    folder = str(tmp_path / "elsewhere")
    done = slurmrun(tmp_path, "submit", "--nodes", "2", "--folder", folder, script, "--talk")
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    follow = subprocess.Popen(
        [sys.executable, "-m", "slurmrun", "logs", job_id, "--rank", "1", "-f", "--folder", folder],
        stdout=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    try:
        assert follow.stdout is not None
        for line in follow.stdout:  # bounded: the job talks, else its time limit ends it
            if "rank 1 line 3" in line:
                break
        assert slurmrun(tmp_path, "status", job_id).returncode == 1  # not in ./slurmrun_jobs
        # Ctrl-C ends another follower quietly; the job runs on.
        other = subprocess.Popen(
            [sys.executable, "-m", "slurmrun", "logs", job_id, "-f", "--folder", folder],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env=env,
        )
        assert other.stdout is not None
        other.stdout.readline()  # it follows: the job's output came
        other.send_signal(signal.SIGINT)
        _, err = other.communicate(timeout=30)
        assert (other.returncode, err) == (130, "")
        cancel = slurmrun(tmp_path, "cancel", job_id, "--folder", folder)
        assert cancel.returncode == 0, cancel.stderr
        rest, _ = follow.communicate(timeout=60)  # --follow returns once the job has ended
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()
            slurmrun(tmp_path, "cancel", job_id, "--folder", folder)
    assert follow.returncode == 0
    assert "rank 0" not in rest
    status = slurmrun(tmp_path, "status", job_id, "--folder", folder).stdout
    assert status.startswith(f"{job_id} CANCELLED\nfailed: JobFailedError: job {job_id} ended")


def test_dry_run_submits_nothing(slurm_cluster, tmp_path, script):
    done = slurmrun(tmp_path, "submit", "--nodes", "3", "--partition", "debug", "--dry-run", script)
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --nodes=3" in done.stdout
    assert "#SBATCH --partition=debug" in done.stdout
    assert not (tmp_path / "slurmrun_jobs").exists()
    assert textwrap.dedent(slurmrun(tmp_path, "jobs").stdout).split() == [
        "JOBID",
        "STATE",
        "SUBMITTED",
        "WHAT",
    ]


MODULE = """\
import os
import sys

import torch.distributed as dist

assert dist.is_initialized(), "--backend gloo: the group is made before the module runs"
rank = dist.get_rank()
print(f"rank {rank}/{dist.get_world_size()} on {os.environ['SLURMD_NODENAME']} "
      f"msg={os.environ.get('MSG')!r} args {sys.argv[1:]} as {__name__}", flush=True)
"""


def test_submit_a_module_with_launcher_options(slurm_cluster, tmp_path):
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "__init__.py").write_text("")
    (tmp_path / "proj" / "train.py").write_text(MODULE)
    argv = [
        "submit", "--nodes", "3", "--workers-per-node", "2", "--backend", "gloo",
        "--extra-env-vars", "MSG=hello world", "--timeout", "60", "--time", "5",
        "-m", "proj.train", "--nodes", "9",
    ]  # fmt: skip
    done = slurmrun(tmp_path, *argv)
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    try:
        _wait_completed(tmp_path, job_id)
    finally:
        slurmrun(tmp_path, "cancel", job_id)
    status = slurmrun(tmp_path, "status", job_id).stdout.splitlines()
    assert status == [f"{job_id} COMPLETED", "every rank finished (6 workers)"]
    for rank, node in ((0, "node1"), (3, "node2"), (5, "node3")):
        logs = slurmrun(tmp_path, "logs", job_id, "--rank", str(rank)).stdout
        said = f"rank {rank}/6 on {node} msg='hello world' args ['--nodes', '9'] as __main__"
        assert said in logs
    listed = slurmrun(tmp_path, "jobs").stdout.splitlines()
    assert listed[1].endswith("module proj.train --nodes 9")


def test_submit_says_which_cluster_and_partition_took_the_job(slurm_cluster, tmp_path, script):
    # A login node's SLURM configuration may name another cluster than meant: the line says.
    # The job waits an hour to start, and is cancelled: it costs the cluster nothing.
    argv = ["submit", "--partition", "urgent", "--sbatch", "begin=now+3600", script]
    done = slurmrun(tmp_path, *argv)
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    try:
        assert done.stderr == f"submitted job {job_id} to cluster slurmtest, partition urgent\n"
    finally:
        slurmrun(tmp_path, "cancel", job_id)


@pytest.mark.parametrize("array", [False, True])
def test_a_job_sbatch_refuses_exits_1_with_its_reason(slurm_cluster, tmp_path, script, array):
    (tmp_path / "sweep.txt").write_text("--lr 1\n--lr 2\n")
    more = ["--array", "sweep.txt"] if array else []
    done = slurmrun(tmp_path, "submit", *more, "--sbatch", "constraint=nosuch", script)
    assert done.returncode == 1
    reason = "sbatch: error: Batch job submission failed: Invalid feature specification"
    assert done.stderr.count(reason) == 1, done.stderr
    assert "slurmrun submit: sbatch refused the job; nothing was submitted" in done.stderr
    assert done.stdout == ""
    assert not (tmp_path / "slurmrun_jobs").exists()  # nor the files submitit wrote for it


def test_submit_an_array_of_script_runs(slurm_cluster, tmp_path, script):
    (tmp_path / "sweep.txt").write_text("--lr 0.1\n# skipped\n--lr 0.2 --tag 'a b'\n")
    argv = ["submit", "--nodes", "2", "--time", "5", "--array", "sweep.txt", "--max-parallel", "1"]
    done = slurmrun(tmp_path, *argv, script, "--epochs", "2")
    assert done.returncode == 0, done.stderr
    ids = done.stdout.split()
    array = ids[0].split("_")[0]
    assert ids == [f"{array}_0", f"{array}_1"]
    where = "to cluster slurmtest, partition debug"
    assert f"submitted job array {array} (2 elements) {where}\n" in done.stderr
    try:
        for job_id in ids:
            _wait_completed(tmp_path, job_id, f"completion of {job_id}")
    finally:
        slurmrun(tmp_path, "cancel", ids[0])
        slurmrun(tmp_path, "cancel", ids[1])
    lines = (["--epochs", "2", "--lr", "0.1"], ["--epochs", "2", "--lr", "0.2", "--tag", "a b"])
    for job_id, args in zip(ids, lines, strict=True):
        nodes = set()  # two of the three: which, SLURM's choice (another test's job may run)
        for rank in (0, 1):
            logs = slurmrun(tmp_path, "logs", job_id, "--rank", str(rank)).stdout
            found = re.search(rf"rank {rank} on (node[123]) args (.*)", logs)
            assert found and found[2] == str(args), logs
            nodes.add(found[1])
        assert len(nodes) == 2, nodes
    listed = slurmrun(tmp_path, "jobs").stdout.splitlines()
    assert [row.split()[:2] for row in listed[1:]] == [[ids[0], "COMPLETED"], [ids[1], "COMPLETED"]]
    assert listed[2].endswith("script train.py --epochs 2 --lr 0.2 --tag 'a b'")


def test_a_launch_the_job_would_refuse_is_not_submitted(slurm_cluster, tmp_path, script):
    """Issue 45 (4): ``--min-hosts`` without ``--max-restarts`` fails before sbatch, not later."""
    done = slurmrun(tmp_path, "submit", "--nodes", "3", "--min-hosts", "2", script)
    assert done.returncode == 2, done.stderr
    assert "min_hosts=2 restarts without a host that is lost" in done.stderr
    assert "set max_restarts >= 1" in done.stderr
    assert done.stdout == ""
    assert not (tmp_path / "slurmrun_jobs").exists()
    queue = subprocess.run(
        ["squeue", "--states=all", "--noheader", "--format=%Z"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert str(tmp_path) not in queue.stdout  # no job of this directory, in any state


def test_an_arrays_status_names_its_tasks_and_says_a_scripts_whole_exit(slurm_cluster, tmp_path):
    """Issue 45 (6c, 6d, 6e, 6f) on a real array whose script exits 3."""
    (tmp_path / "exits.py").write_text("import sys\nprint('leaving', flush=True)\nsys.exit(3)\n")
    (tmp_path / "sweep.txt").write_text("a\nb\n")
    done = slurmrun(tmp_path, "submit", "--time", "5", "--array", "sweep.txt", "exits.py")
    assert done.returncode == 0, done.stderr
    ids = done.stdout.split()
    array = ids[0].partition("_")[0]
    try:
        for job_id in ids:
            _wait_completed(tmp_path, job_id, f"completion of {job_id}")
    finally:
        slurmrun(tmp_path, "cancel", ids[0])
        slurmrun(tmp_path, "cancel", ids[1])
    named = slurmrun(tmp_path, "status", array)
    assert named.returncode == 1
    assert named.stderr.rstrip().endswith(
        f"{array} is a job array, whose tasks are jobs of their own: {ids[0]}, {ids[1]} "
        f"(slurmrun status {ids[0]})"
    )
    status = slurmrun(tmp_path, "status", ids[0]).stdout.splitlines()
    assert status[0] == f"{ids[0]} COMPLETED"
    assert re.fullmatch(
        r"exit status 3 on rank 0 \(host node\d, local rank 0\)(; its log: .+)?", status[1]
    )
    assert len(status) == 2
    # No symlink left behind by the submission (one per job before).
    left = [p.name for p in (tmp_path / "slurmrun_jobs").iterdir() if p.name.startswith(".")]
    assert left == []
    read, write = os.pipe()
    os.close(read)  # `slurmrun status ... | head -0`: the reader has gone
    try:
        piped = subprocess.run(
            [sys.executable, "-m", "slurmrun", "status", ids[0]],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            check=False,
        )
    finally:
        os.close(write)
    assert (piped.returncode, piped.stderr) == (141, "")
