"""Debugging a run on the 3-node cluster from one terminal: pdb on node2, stacks, stalls, Ctrl-C.

The launcher runs under ``salloc`` in a pseudo-terminal (pexpect), as a person runs it; a
second "terminal" is a plain subprocess on the login side.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pexpect
import pytest

from tests.slurm.conftest import JOB_NAME, wait_job

REPO = Path(__file__).resolve().parents[2]
LIMIT = 120


def _env(tmp_path: Path, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}
    if "SLURM_CONF" in os.environ:
        env["SLURM_CONF"] = os.environ["SLURM_CONF"]
    env["PYTHONPATH"] = str(REPO)
    env["SLURMRUN_LOG_DIR"] = str(tmp_path / "logs")
    env.pop("PYTHONBREAKPOINT", None)
    return env | more


def _salloc(tmp_path: Path, *slurmrun_args: str, **env: str) -> pexpect.spawn:
    argv = [f"--job-name={JOB_NAME}", "--time=3", "-N3"]
    argv += [sys.executable, "-m", "slurmrun", *slurmrun_args]
    child = pexpect.spawn(
        "salloc",
        argv,
        cwd=str(tmp_path),
        env=_env(tmp_path, **env),
        encoding="utf-8",
        timeout=LIMIT,
        dimensions=(50, 220),
    )
    child.logfile_read = open(tmp_path / "terminal.txt", "w")  # noqa: SIM115 - closed by pexpect
    return child


def _finish(child: pexpect.spawn) -> int:
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus is not None, child.signalstatus
    return child.exitstatus


def _slurmrun(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slurmrun", *args],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=LIMIT,
        check=False,
    )


BREAKPOINT = """
import os, socket
rank = int(os.environ["RANK"])
here = (socket.gethostname(), rank, os.environ["SLURM_PROCID"])
if rank == 3:
    breakpoint()
print(f"rank {rank} done", flush=True)
"""


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_breakpoint_on_a_rank_of_node2_opens_pdb_in_the_salloc_terminal(
    tmp_path: Path, node_processes
) -> None:
    (tmp_path / "script.py").write_text(BREAKPOINT)
    child = _salloc(tmp_path, "--workers-per-host", "2", "--backend", "None", "script.py")
    try:
        child.expect_exact("(Pdb) [node2 rank 3] ")
        child.sendline("p here")
        child.expect_exact("('node2', 3, '3')")
        child.sendline("c")
        assert _finish(child) == 0
    finally:
        child.close(force=True)
    assert "rank 0 done" in (tmp_path / "terminal.txt").read_text()
    assert node_processes() == {}


# Rank 3 (node2's second worker) sleeps; every other rank waits for it in all_reduce.
HANG = """
import os, time
from pathlib import Path
import torch
import torch.distributed as dist

def sleepy(release):
    while not release.exists():
        time.sleep(0.2)

rank = dist.get_rank()
print("started", flush=True)
if rank == 3:
    sleepy(Path("release"))
dist.all_reduce(torch.ones(1))
print("reduced", flush=True)
"""
SLEEPY_LINE = 9  # time.sleep in sleepy
REDUCE_LINE = 15  # dist.all_reduce


def _groups(text: str) -> None:
    assert "ranks 0-2, 4-5: waiting: all_reduce (distributed_c10d.py:" in text, text
    assert f"(hang.py:{REDUCE_LINE})" in text, text
    line = f"rank 3 (node2): working: sleepy (hang.py:{SLEEPY_LINE}) <- <module> (hang.py:14)"
    assert line in text, text


def test_stacks_from_another_shell_a_stall_and_ctrl_c_on_a_hung_collective(
    tmp_path: Path, node_processes
) -> None:
    (tmp_path / "hang.py").write_text(HANG)
    events = tmp_path / "events.jsonl"
    child = _salloc(
        tmp_path,
        "--workers-per-host", "2", "--backend", "gloo", "--stall-timeout", "4", "hang.py",
        SLURMRUN_EVENTS_FILE=str(events),
    )  # fmt: skip
    try:
        child.expect_exact("started")
        # The stall: every rank's stacks, once, grouped.
        child.expect_exact("no rank wrote output, returned or failed for 4 s")
        child.expect_exact("(every thread's stacks: ")
        _groups(child.before)
        # Another shell on the login host: `slurmrun stacks` finds the user's launcher.
        shown = _slurmrun(tmp_path, "stacks")
        assert shown.returncode == 0, shown.stderr
        _groups(shown.stdout)
        assert "Thread MainThread (most recent call last):" in shown.stdout
        # Ctrl-C: the stacks first, then the workers stop.
        child.sendintr()
        child.expect_exact("Ctrl-C: where each rank was:")
        child.expect_exact("(every thread's stacks: ")
        _groups(child.before)
        assert _finish(child) == 130
    finally:
        child.close(force=True)
    kinds = [json.loads(line)["kind"] for line in events.read_text().splitlines()]
    assert kinds.count("stalled") == 1, kinds
    reports = sorted((tmp_path / "logs").glob("2*/stacks/stacks-*.txt"))
    assert len(reports) == 3, reports  # the stall, the other shell's request, Ctrl-C
    assert node_processes() == {}


BATCH = """#!/bin/bash
#SBATCH -N3
export PYTHONPATH={repo}
export SLURMRUN_LOG_DIR={tmp}/logs
{python} -m slurmrun --workers-per-host 2 --backend gloo hang.py
"""


def test_stacks_of_a_submitted_job_by_its_id(tmp_path: Path, node_processes) -> None:
    # The job's launcher runs on node1: `slurmrun stacks JOB_ID` reaches it through an srun
    # step into the job.
    (tmp_path / "hang.py").write_text(HANG)
    script = tmp_path / "job.sh"
    script.write_text(BATCH.format(repo=REPO, tmp=tmp_path, python=sys.executable))
    out = tmp_path / "job.out"
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--job-name={JOB_NAME}", "--time=3", f"--output={out}",
         str(script)],
        cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    job_id = submitted.stdout.strip().split(";")[0]
    try:
        deadline = time.monotonic() + 60
        while "started" not in (out.read_text() if out.exists() else ""):
            assert time.monotonic() < deadline, out.read_text() if out.exists() else "no output"
            time.sleep(0.3)
        shown = _slurmrun(tmp_path, "stacks", job_id)
        assert shown.returncode == 0, shown.stdout + shown.stderr
        _groups(shown.stdout)
    finally:
        (tmp_path / "release").touch()
    fields = wait_job(job_id, 60, out)
    assert fields["JobState"] == "COMPLETED", out.read_text()
    assert node_processes() == {}
