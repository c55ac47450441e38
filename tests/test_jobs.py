"""slurmrun.batch without a cluster: parsing SLURM's output, outcomes, handles, the dry run.

The squeue and sacct strings are what the test cluster printed (sacct: its error; the sacct
table is in the format ``sacct --parsable2`` documents, the test cluster having no accounting).
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import sys
from pathlib import Path

import pytest

import slurmrun
from slurmrun.batch.call import Outcome
from slurmrun.batch.folder import base_folder
from slurmrun.batch.state import FINAL_STATES, normalise_state, parse_sacct, parse_squeue
from slurmrun.errors import RemoteTraceback

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"

# squeue --noheader --states=all --jobs=305,306,99999 --format='%i|%T' (99999: unknown)
SQUEUE = "305|COMPLETED\n306|RUNNING\n289|CANCELLED\n"
# sacct --noheader --parsable2 --allocations --jobs=... --format=JobID,State
SACCT = "305|COMPLETED\n306|CANCELLED by 0\n307_2|TIMEOUT\n308|FAILED\n308.batch|FAILED\n"


def test_squeue_lines_give_each_jobs_state():
    assert parse_squeue(SQUEUE) == {"305": "COMPLETED", "306": "RUNNING", "289": "CANCELLED"}
    assert parse_squeue("") == {}
    assert parse_squeue("slurm_load_jobs error: Invalid job id specified\n") == {}


def test_sacct_lines_give_each_jobs_state_without_steps():
    assert parse_sacct(SACCT) == {
        "305": "COMPLETED",
        "306": "CANCELLED",
        "307_2": "TIMEOUT",
        "308": "FAILED",
    }


def test_state_names_are_slurms():
    assert normalise_state("CANCELLED by 1000") == "CANCELLED"
    assert normalise_state("CANCELLED+") == "CANCELLED"
    assert normalise_state("running") == "RUNNING"
    assert normalise_state("") == "UNKNOWN"
    assert {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED"} <= FINAL_STATES
    assert "RUNNING" not in FINAL_STATES


def _throw(exc: BaseException) -> None:
    raise exc


def _raised(exc: BaseException) -> Outcome:
    try:
        _throw(exc)
    except BaseException as e:
        return Outcome.of_error(e)
    raise AssertionError("unreachable")


def test_an_outcome_raises_the_launchs_own_exception_with_its_traceback():
    worker = KeyError("k")
    worker.__cause__ = RemoteTraceback("Traceback...\nKeyError: 'k'")
    outcome = pickle.loads(pickle.dumps(_raised(worker)))
    with pytest.raises(KeyError) as info:
        outcome.unwrap()
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "KeyError: 'k'" in str(info.value.__cause__)


class _NeedsTwo(Exception):
    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"{a}+{b}")


def test_an_exception_that_cannot_be_rebuilt_is_named():
    outcome = _raised(_NeedsTwo(1, 2))
    with pytest.raises(RuntimeError, match=r"raised .*_NeedsTwo: 1\+2") as info:
        outcome.unwrap()
    assert "_NeedsTwo" in str(info.value.__cause__)  # the job's traceback


def test_folders_and_handles(tmp_path):
    assert base_folder(tmp_path / "%j") == tmp_path
    with pytest.raises(ValueError, match="'%j' may only be the last part"):
        base_folder(tmp_path / "%j" / "x")
    with pytest.raises(FileNotFoundError, match="no job 123 was submitted into"):
        slurmrun.attach(123, folder=tmp_path)
    assert slurmrun.jobs(folder=tmp_path / "nothing") == []
    handle = slurmrun.SubmittedLaunch("123", tmp_path)
    assert pickle.loads(pickle.dumps(handle)) == handle
    assert handle.logs(rank=3) == ""


def _normalise(text: str, folder: Path) -> str:
    text = text.replace(str(folder), "FOLDER").replace(sys.executable, "PYTHON")
    return re.sub(r"^#SBATCH --wckey=.*\n", "", text, flags=re.M)


@pytest.mark.skipif(shutil.which("srun") is None, reason="submitit's SlurmExecutor needs srun")
def test_dry_run_script_matches_golden_file(tmp_path):
    dry = slurmrun.submit(
        print,
        nodes=2,
        workers_per_node=3,
        cpus_per_worker=2,
        time_min=30,
        folder=tmp_path / "jobs",
        slurm_parameters={"partition": "debug"},
        dry_run=True,
    )
    assert not (tmp_path / "jobs").exists()  # nothing submitted, nothing created
    text = _normalise(str(dry), tmp_path / "jobs")
    path = GOLDEN / "submit_dry_run_cpu_two_nodes.txt"
    if UPDATE:
        path.write_text(text)
    assert text == path.read_text()
