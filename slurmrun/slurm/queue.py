"""The states of SLURM jobs, for many jobs in one query (squeue, else sacct).

squeue answers from the controller's memory: every job still queued or running, and ended
jobs for ``MinJobAge`` seconds (300 by default) after they end. sacct answers from the
accounting database, which many clusters (and the test cluster) do not have, and which is
the expensive one to ask: it is asked only about the jobs that squeue no longer knows, once
for all of them, and not again in this process once it said accounting is disabled.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable

from slurmrun.slurm.cluster import unresolved_controllers

__all__ = [
    "ACTIVE_STATES",
    "FINAL_STATES",
    "UNKNOWN",
    "normalise_state",
    "parse_sacct",
    "parse_squeue",
    "query_states",
    "run_query",
]

UNKNOWN = "UNKNOWN"
FINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "REVOKED",
        "SPECIAL_EXIT",
        "TIMEOUT",
    }
)
"""States a job does not leave (unless requeued: then SLURM reports it PENDING again)."""
ACTIVE_STATES = frozenset(
    {
        "COMPLETING",
        "CONFIGURING",
        "PENDING",
        "REQUEUED",
        "REQUEUE_FED",
        "REQUEUE_HOLD",
        "RESIZING",
        "RUNNING",
        "SIGNALING",
        "STAGE_OUT",
        "STOPPED",
        "SUSPENDED",
    }
)
QUERY_TIMEOUT = 20.0
# sacct said "accounting storage is disabled" (or is not installed): not asked again.
_SACCT: dict[str, bool] = {"usable": True}


def normalise_state(text: str) -> str:
    """SLURM's state name from what squeue, sacct or scontrol print.

    ``CANCELLED by 0`` (sacct) is ``CANCELLED``; ``CANCELLED+`` (sacct, truncated) too.
    """
    word = text.strip().split(" ", 1)[0].rstrip("+")
    return word.upper() if word else UNKNOWN


def parse_squeue(text: str) -> dict[str, str]:
    """``{job id: state}`` from ``squeue --array --noheader --format=%i|%T`` output."""
    states: dict[str, str] = {}
    for line in text.splitlines():
        job_id, sep, state = line.strip().partition("|")
        if sep and job_id:
            states[job_id] = normalise_state(state)
    return states


def parse_sacct(text: str) -> dict[str, str]:
    """``{job id: state}`` from ``sacct --noheader --parsable2 -X --format=JobID,State``.

    With ``-X`` sacct prints one line per job (no steps); a requeued job may print one line
    per run: the last one is the current run.
    """
    states: dict[str, str] = {}
    for line in text.splitlines():
        job_id, sep, state = line.strip().partition("|")
        if sep and job_id and "." not in job_id:
            states[job_id] = normalise_state(state)
    return states


def run_query(
    argv: list[str], timeout: float = QUERY_TIMEOUT
) -> subprocess.CompletedProcess[str] | None:
    """Runs a SLURM query command (squeue, sacct); None if it could not run or took too long."""
    try:
        return subprocess.run(
            argv,
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None


def _squeue(job_ids: list[str]) -> dict[str, str]:
    if shutil.which("squeue") is None:
        return {}
    # --array: one line per array element; without it squeue folds an array's pending
    # elements into one line ("53_[0-2]|PENDING") that names none of them.
    done = run_query(
        [
            "squeue",
            "--array",
            "--noheader",
            "--states=all",
            f"--jobs={','.join(job_ids)}",
            "--format=%i|%T",
        ]
    )
    # rc 1 with "Invalid job id specified": none of the ids is in the controller's memory.
    return parse_squeue(done.stdout) if done is not None else {}


def _sacct(job_ids: list[str]) -> dict[str, str]:
    if not _SACCT["usable"] or shutil.which("sacct") is None:
        return {}
    done = run_query(
        [
            "sacct",
            "--noheader",
            "--parsable2",
            "--allocations",
            f"--jobs={','.join(job_ids)}",
            "--format=JobID,State",
        ]
    )
    if done is None:
        return {}
    if done.returncode != 0:
        if "disabled" in done.stderr or "not configured" in done.stderr:
            _SACCT["usable"] = False
        return {}
    return parse_sacct(done.stdout)


def query_states(job_ids: Iterable[str]) -> dict[str, str]:
    """The states of `job_ids`: one squeue for all, then one sacct for those squeue lost.

    Args:
        job_ids: SLURM job ids (``"123"``, or ``"123_4"`` for an array task).

    Returns:
        ``{job id: state}`` for the jobs SLURM knows; the others are missing (the caller
        falls back on what the job left in its folder).
    """
    wanted = list(dict.fromkeys(str(j) for j in job_ids))
    if not wanted or unresolved_controllers():  # squeue and sacct would retry for 10 s each
        return {}
    states = _squeue(wanted)
    lost = [j for j in wanted if j not in states]
    if lost:
        states.update(_sacct(lost))
    return {j: states[j] for j in wanted if j in states}
