"""The jobs of this pytest session on the test cluster: whose they are, and cancelling them.

Kept out of conftest.py, which pytest loads as a plugin (``conftest``) while test modules
import it as ``tests.slurm.conftest``: two copies. This module is imported by one name only,
so the session's state that a fixture sets (its folder, the jobs kept across tests) is the
one every helper reads, whichever copy calls it.
"""

from __future__ import annotations

import os
import subprocess
import time

__all__ = ["_cancel", "_jobs", "_ours", "_session", "_shared_jobs", "_wait_no_jobs"]

# The session's base folder ("dir"): a job or process started under it is this session's.
_session: dict[str, str] = {}
# Jobs a module's fixture keeps across its tests (a reservation its tests share): the
# clean-state check after each test leaves them, their batch step and their agents alone, not
# their workers (`share_job`).
_shared_jobs: set[str] = set()


def _ours(path: str) -> bool:
    root = _session.get("dir")
    return root is not None and (path == root or path.startswith(root + os.sep))


def _jobs() -> list[str]:
    """This session's jobs still in the queue, as "id name state nodes"."""
    cp = subprocess.run(
        ["squeue", "-h", "-o", "%A %j %T %N %Z"],
        check=False,
        capture_output=True,
        text=True,
        timeout=10,
    )
    lines = (line.rsplit(" ", 1) for line in cp.stdout.splitlines() if " " in line)
    return [job for job, workdir in lines if _ours(workdir) and job.split()[0] not in _shared_jobs]


def _cancel(jobs: list[str]) -> None:
    if jobs:
        subprocess.run(["scancel", *(j.split()[0] for j in jobs)], timeout=10, check=False)


def _wait_no_jobs(wait: float) -> list[str]:
    deadline = time.monotonic() + wait
    while (jobs := _jobs()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return jobs
