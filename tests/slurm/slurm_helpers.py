"""Helpers of the SLURM tests that are plain functions, not fixtures (those are in conftest.py).

Imported as ``from tests.slurm.slurm_helpers import ...``, as the tests import conftest's.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import pytest


def wait_for(
    predicate: Callable[[], object],
    timeout: float,
    what: str,
    *,
    every: float = 0.2,
    job_id: str | None = None,
    output: Callable[[], str] | None = None,
) -> None:
    """Polls `predicate` every `every` s until it is true; fails the test after `timeout` s.

    The failure says that `what` did not happen; with `job_id`, the job is cancelled first, and
    with `output`, what it returns (the job's output) is shown.
    """
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            message = f"{what} did not happen within {timeout} s"
            if job_id is not None:
                subprocess.run(["scancel", job_id], check=False, timeout=30)
                message += f" (job {job_id} cancelled)"
            if output is not None:
                message += f"\n--- job output\n{output()}"
            pytest.fail(message)
        time.sleep(every)
