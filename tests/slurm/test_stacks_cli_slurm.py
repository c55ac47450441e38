"""``slurmrun stacks JOB_ID`` from the login side reaches a launcher in a running batch job.

The job's launcher (a `ControlServer`, as a launch starts one) runs in the batch script on
node1, beside a step of the job that holds all its CPUs and GPUs without ``--overlap``; the
command, on ``vm``, finds no launcher of the job there and runs itself on the batch host
through ``srun --jobid=JOB_ID --overlap``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.slurm.conftest import JOB_NAME, REPO, scontrol_job, wait_job

LAUNCHER = textwrap.dedent(
    """
    import os, pathlib, socket, time
    import slurmrun
    from slurmrun.stacks.control import ControlServer

    job = os.environ["SLURM_JOB_ID"]

    def handler(op, args):
        return f"stacks of {job}: {op} {args['timeout']:g} s on {socket.gethostname()}"

    server = ControlServer(handler, what="launcher.py", job_id=job)
    server.start()
    print("slurmrun:", slurmrun.__file__, "socket:", server.socket, flush=True)
    pathlib.Path("ready").touch()
    deadline = time.monotonic() + 60
    while not pathlib.Path("done").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    server.close()
    """
)
HOLD = (  # a step of the job on all its CPUs and GPUs, as a user's own srun may be
    "import pathlib, time; pathlib.Path('held').touch(); deadline = time.monotonic() + 60\n"
    "while not pathlib.Path('done').exists() and time.monotonic() < deadline: time.sleep(0.1)"
)


def _submit(tmp_path: Path) -> str:
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    (tmp_path / "job.sh").write_text(
        f"#!/bin/bash\nexport PYTHONPATH={REPO}\n"
        f"srun --nodes=1 --ntasks=1 --cpus-per-task=4 --gres=gpu:2 {sys.executable} -c "
        f'"{HOLD}" &\n'
        f"{sys.executable} launcher.py\nwait\n"
    )
    done = subprocess.run(
        ["sbatch", "--parsable", f"--job-name={JOB_NAME}", "--time=3", "--nodes=1",
         "--ntasks=1", "--cpus-per-task=4", "--gres=gpu:2", f"--output={tmp_path / 'job.out'}",
         str(tmp_path / "job.sh")],
        check=True, capture_output=True, text=True, timeout=30, cwd=tmp_path,
    )  # fmt: skip
    return done.stdout.strip().split(";")[0]


def _wait_ready(tmp_path: Path, job_id: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not all((tmp_path / name).exists() for name in ("ready", "held")):
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], check=False, timeout=30)
            out = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
            pytest.fail(f"job {job_id} not ready within {timeout} s (cancelled)\n{out}")
        time.sleep(0.2)


def _stacks(run_cmd, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "slurmrun", "stacks", *args]
    return run_cmd(argv, timeout=90, check=False, env={"PYTHONPATH": str(REPO)})


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
@pytest.mark.cluster_exclusive  # a whole node (4 CPUs, 2 GPUs): it would wait for other groups
def test_stacks_of_a_job_reaches_its_launcher_on_the_batch_host(slurm_cluster, tmp_path, run_cmd):
    job_id = _submit(tmp_path)
    try:
        _wait_ready(tmp_path, job_id)
        assert scontrol_job(job_id)["JobState"] == "RUNNING"
        out = _stacks(run_cmd, job_id, "--timeout", "10")
        assert (out.returncode, out.stderr) == (0, ""), out
        assert out.stdout == f"stacks of {job_id}: stacks 10 s on node1\n"
        nobody = _stacks(run_cmd, job_id, "--pid", "1")  # --pid goes along to node1
        assert nobody.returncode == 1
        assert "slurmrun stacks: error: no slurmrun launch of yours has pid 1 on node1" in (
            nobody.stderr
        )
    finally:
        (tmp_path / "done").touch()
    fields = wait_job(job_id, 60, tmp_path / "job.out")
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0")
    assert f"slurmrun: {REPO}/slurmrun/__init__.py socket: " in (tmp_path / "job.out").read_text()
    ended = _stacks(run_cmd, job_id)
    assert (ended.returncode, ended.stdout) == (1, "")
    assert ended.stderr == (
        f"slurmrun stacks: error: job {job_id} is COMPLETED, not RUNNING: no launcher of it runs\n"
    )


def test_stacks_of_an_unknown_job_says_so(slurm_cluster, run_cmd):
    out = _stacks(run_cmd, "999999")
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr == (
        "slurmrun stacks: error: SLURM does not know job 999999 (scontrol show job 999999 "
        "failed); squeue --me lists your jobs\n"
    )
