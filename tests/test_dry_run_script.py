"""A dry run's batch script (`slurmrun.batch.sbatch`) is the one submitit submits.

slurmrun renders it itself, as submitit has no public call for it; this compares the two
(through submitit's private renderer, here only) so that a submitit that writes its scripts
otherwise fails here, not in a user's dry run.
"""

from __future__ import annotations

import shlex
import shutil
import sys
from pathlib import Path

import pytest

from slurmrun.batch.sbatch import batch_script

pytestmark = pytest.mark.skipif(
    shutil.which("srun") is None, reason="submitit's SlurmExecutor needs srun"
)

BASE = {"nodes": 2, "ntasks_per_node": 3, "cpus_per_task": 2, "time": 30, "use_srun": False}
CASES = {
    "a job": {**BASE, "job_name": "slurmrun", "additional_parameters": {"requeue": True}},
    "an array": {**BASE, "map_count": 5, "array_parallelism": 2},
    "an array of fewer than its parallelism": {**BASE, "map_count": 3},
    "gpus, memory, a partition": {**BASE, "gpus_per_node": 8, "mem": "64G", "partition": "a b"},
    "a requeue signal": {**BASE, "signal_delay_s": 300, "additional_parameters": {"x_y": "1"}},
    "stderr to stdout": {**BASE, "stderr_to_stdout": True},
    "srun": {"use_srun": True, "srun_args": ["--cpu-bind=none"], "exclusive": True},
    "srun, stderr to stdout": {"use_srun": True, "stderr_to_stdout": True},
    "setup and teardown": {**BASE, "setup": ["module load x"], "teardown": ["echo done"]},
    "submitit's defaults": {},
}


@pytest.mark.parametrize("parameters", CASES.values(), ids=CASES.keys())
def test_the_dry_run_script_is_submitits(parameters, tmp_path):
    from submitit.slurm.slurm import _make_sbatch_string

    folder = Path(tmp_path) / "jobs" / "%j"
    command = f"{shlex.quote(sys.executable)} -u -m submitit.core._submit {folder}"
    expected = _make_sbatch_string(command=command, folder=folder, **parameters)
    assert batch_script(parameters, folder, shlex.quote(sys.executable)) == expected


def test_the_dry_run_renders_what_the_executor_holds(tmp_path):
    import submitit

    executor = submitit.SlurmExecutor(folder=tmp_path / "%j")
    executor.update_parameters(**CASES["gpus, memory, a partition"])
    script = batch_script(executor.parameters, executor.folder, executor.python)
    expected = executor._make_submission_file_text(executor._submitit_command_str, "x")
    assert script == expected
