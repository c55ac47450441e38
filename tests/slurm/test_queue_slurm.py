"""Job states from squeue on the real cluster (slurmrun.slurm.queue): pending array elements."""

from __future__ import annotations

import pytest

from slurmrun.slurm.queue import query_states
from tests.slurm.slurm_helpers import wait_for


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_a_pending_arrays_elements_are_pending_not_unknown(run_cmd):
    # Held, the elements stay pending: squeue folds them into one line ("53_[0-2]|PENDING")
    # unless asked with --array.
    submitted = run_cmd(["sbatch", "--parsable", "--hold", "--array=0-2", "--wrap=true"])
    array = submitted.stdout.strip().split(";")[0]
    elements = [f"{array}_{i}" for i in range(3)]
    try:
        assert query_states(elements) == dict.fromkeys(elements, "PENDING")
    finally:
        run_cmd(["scancel", array])
        wait_for(lambda: "PENDING" not in query_states(elements).values(), 30, "the array's end")
