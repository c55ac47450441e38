"""slurmrun.batch without a cluster: parsing SLURM's output, outcomes, handles, the dry run.

The squeue and sacct strings are what the test cluster printed (sacct: its error; the sacct
table is in the format ``sacct --parsable2`` documents, the test cluster having no accounting).
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

import slurmrun
from slurmrun.batch.call import Outcome
from slurmrun.batch.folder import JobFolder, base_folder
from slurmrun.batch.seal import job_key, new_nonce, write_sealed
from slurmrun.errors import RemoteTraceback
from slurmrun.slurm.queue import FINAL_STATES, normalise_state, parse_sacct, parse_squeue

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
    text = re.sub(r"sealed_job [0-9a-f]{32} ", "sealed_job NONCE ", text)
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


def test_requeue_options_are_checked_before_submitting():
    assert slurmrun.Requeue().sbatch_signal() == "USR2@90"
    assert slurmrun.Requeue(signal="SIGUSR1", signal_seconds=300).sbatch_signal() == "USR1@300"
    assert slurmrun.Requeue().grace == 60.0
    assert slurmrun.Requeue(signal_seconds=20).grace == 10.0
    with pytest.raises(ValueError, match="'USR1' or 'USR2'"):
        slurmrun.Requeue(signal="TERM")
    with pytest.raises(ValueError, match="max_requeues must be an int >= 0"):
        slurmrun.Requeue(max_requeues=-1)
    with pytest.raises(TypeError, match="requeue must be a bool or a Requeue"):
        slurmrun.submit(print, requeue="yes", dry_run=True)  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="args_list is empty"):
        slurmrun.submit_array(print, [])


def test_array_dry_run_shows_the_array_and_submits_nothing(tmp_path):
    folder = tmp_path / "jobs"
    dry = slurmrun.submit_array(
        print, [(1,), (2,), (3,)], nodes=2, max_parallel=2, folder=folder, dry_run=True
    )
    script = str(dry)
    for line in ("--array=0-2%2", "--nodes=2", "--requeue", "--signal=USR2@90"):
        assert f"#SBATCH {line}\n" in script
    assert f"#SBATCH --output={folder}/%A_%a/%A_%a_0_log.out\n" in script
    assert dry.parameters["map_count"] == 3
    assert not folder.exists()
    with pytest.raises(TypeError, match=r"args_list\[1\] could not be pickled .*_thread.lock"):
        slurmrun.submit_array(print, [(1,), (threading.Lock(),)], folder=folder, dry_run=True)


@pytest.mark.parametrize("name", ["nodes", "cpus_per_worker"])
def test_a_count_of_zero_is_refused_not_taken_as_not_given(name):
    with pytest.raises(ValueError, match=f"{name} must be a positive int, got 0"):
        slurmrun.submit(print, dry_run=True, **{name: 0})
    with pytest.raises(ValueError, match=f"{name} must be a positive int, got 0"):
        slurmrun.submit_array(print, [(1,)], dry_run=True, **{name: 0})


def test_a_launchers_workers_per_host_are_the_jobs_tasks(tmp_path):
    launcher = slurmrun.Launcher(workers_per_host=3)
    dry = slurmrun.submit(print, launcher=launcher, nodes=2, folder=tmp_path, dry_run=True)
    assert "#SBATCH --ntasks-per-node=3\n" in str(dry)
    with pytest.raises(ValueError, match="every node of a submitted job runs the same number"):
        slurmrun.submit(print, launcher=slurmrun.Launcher(workers_per_host=[1, 2]), dry_run=True)
    with pytest.raises(ValueError, match="not both"):
        slurmrun.submit(print, launcher=launcher, workers_per_node=2, dry_run=True)


@pytest.mark.parametrize(
    ("options", "job", "message"),
    [
        ({"min_hosts": 2}, {"nodes": 3}, "min_hosts=2 restarts without a host that is lost"),
        ({"hosts": 2}, {"nodes": 3}, r"hosts=2 \(with spares\) restarts without a host"),
        ({"min_hosts": 4, "max_restarts": 1}, {"nodes": 3}, "min_hosts must be an int from 1"),
        ({"hosts": 4, "max_restarts": 1}, {"nodes": 3}, "hosts must be an int from 1 to the 3"),
        ({"srun_args": ("--nodes=2",)}, {}, "conflicts with slurmrun's own --nodes"),
    ],
)
def test_what_a_launch_would_refuse_in_the_job_is_refused_before_submitting(
    monkeypatch, tmp_path, options, job, message
):
    """Issue 45 (4): the launch's own checks run on the login node, not in the job."""
    hide_slurm(monkeypatch, tmp_path)  # refused before SLURM is asked: it need not be here
    launcher = slurmrun.Launcher(**options)
    for dry_run in (True, False):  # no SLURM is needed to refuse it
        with pytest.raises(slurmrun.OptionsValueError, match=message):
            slurmrun.submit(
                print, launcher=launcher, folder=tmp_path / "jobs", dry_run=dry_run, **job
            )
        with pytest.raises(slurmrun.OptionsValueError, match=message):
            slurmrun.submit_array(
                print, [(1,)], launcher=launcher, folder=tmp_path / "jobs", dry_run=dry_run, **job
            )
    assert not (tmp_path / "jobs").exists()


def hide_slurm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A PATH without SLURM's commands: what would be submitted cannot be."""
    bare = tmp_path / "bin"
    bare.mkdir()
    monkeypatch.setenv("PATH", str(bare))


def test_cli_submit_refuses_a_launch_the_job_would_refuse_before_submitting(
    monkeypatch, tmp_path, capsys
):
    """Issue 45 (4): ``--min-hosts`` without ``--max-restarts`` is exit 2, nothing submitted."""
    from slurmrun.cli.main import main

    hide_slurm(monkeypatch, tmp_path)
    script = tmp_path / "train.py"
    script.write_text("raise AssertionError('must not run')\n")
    folder = ["--folder", str(tmp_path / "jobs")]
    for dry_run in ([], ["--dry-run"]):
        assert (
            main(["submit", *dry_run, *folder, "--nodes", "3", "--min-hosts", "2", str(script)])
            == 2
        )
        err = capsys.readouterr().err
        assert "slurmrun submit: error: min_hosts=2 restarts without a host that is lost" in err
        assert "set max_restarts >= 1" in err
    assert not (tmp_path / "jobs").exists()


def ended_without_a_result(folder: Path, job_id: str, state: str, err: str) -> None:
    """A job's folder as a job that ended `state` before writing its result leaves it."""
    files = JobFolder.of(folder, job_id)
    files.path.mkdir(parents=True)
    # The call as slurmrun seals it (what it holds is not read: the job ended without a result).
    write_sealed(files.submitted_pickle, b"", key=job_key(create=True), nonce=new_nonce())
    files.stderr.write_text(err)
    files.cache_state(state)


def test_status_prints_the_whole_outcome_of_a_job(monkeypatch, tmp_path, capsys):
    """Issue 45 (6d): not its first line only (which ends at "the end of its output (...):")."""
    from slurmrun.cli.main import main

    hide_slurm(monkeypatch, tmp_path)  # SLURM has forgotten the job: its folder tells
    folder = tmp_path / "jobs"
    ended_without_a_result(folder, "14", "CANCELLED", "srun: error: node2: task 0\nKilled\n")
    assert main(["status", "14", "--folder", str(folder)]) == 0
    err = JobFolder.of(folder, "14").stderr
    assert capsys.readouterr().out.splitlines() == [
        "14 CANCELLED",
        f"failed: JobFailedError: job 14 ended CANCELLED without a result; the end of its "
        f"output ({err}):",
        "srun: error: node2: task 0",
        "Killed",
    ]


def test_a_scripts_exit_status_keeps_the_rank_that_exited_through_the_job(tmp_path):
    """Issue 45 (6d): ``exit status 3 on node1:0; its log: ...``, not ``exit status 3 on``."""
    from slurmrun.cli.jobs import failure_text
    from slurmrun.cli.script import ScriptExit

    error = ScriptExit(3)
    error.add_note(f"slurmrun: raised on node1:0; its log: {tmp_path / 'rank0.log'}")
    # What the job returns, pickled into its result file and read by `status`.
    outcome = pickle.loads(pickle.dumps(Outcome.of_error(error)))
    with pytest.raises(ScriptExit) as info:
        outcome.unwrap()
    assert info.value.__notes__ == error.__notes__  # the job's pickle kept where it exited
    assert failure_text(info.value) == f"exit status 3 on node1:0; its log: {tmp_path}/rank0.log"
    try:
        raise RuntimeError("two lines\nof message")  # noqa: TRY301 - as the job's launch does
    except RuntimeError as e:
        e.add_note("slurmrun: raised on node2:1")
        outcome = pickle.loads(pickle.dumps(Outcome.of_error(e)))
    with pytest.raises(RuntimeError) as info:
        outcome.unwrap()
    text = failure_text(info.value).splitlines()
    assert text[:3] == [
        "failed: RuntimeError: two lines",
        "of message",
        "Traceback (most recent call last):",  # the job's, as `slurmrun SCRIPT.py` prints it
    ]
    assert text[-1] == "slurmrun: raised on node2:1"


def test_the_id_of_a_job_array_names_its_tasks(monkeypatch, tmp_path, capsys):
    """Issue 45 (6c): ``slurmrun status 19`` of an array suggests ``19_0``, ``19_1``."""
    from slurmrun.cli.main import main

    hide_slurm(monkeypatch, tmp_path)
    folder = tmp_path / "jobs"
    for job_id in ("19_1", "19_0", "190"):
        ended_without_a_result(folder, job_id, "COMPLETED", "")
    for verb in ("status", "logs", "cancel"):
        assert main([verb, "19", "--folder", str(folder)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"slurmrun {verb}: no job 19 was submitted into {folder}")
        assert err.endswith(
            f". 19 is a job array, whose tasks are jobs of their own: 19_0, 19_1 "
            f"(slurmrun {verb} 19_0)\n"
        )
    assert main(["status", "18", "--folder", str(folder)]) == 1
    assert "job array" not in capsys.readouterr().err


def test_requeue_count_and_request_outside_a_job(monkeypatch, tmp_path):
    from slurmrun.batch import requeue_count

    monkeypatch.delenv("SLURMRUN_REQUEUE_COUNT", raising=False)
    monkeypatch.delenv("SLURMRUN_REQUEUE_FLAG", raising=False)
    assert requeue_count() == 0
    assert not slurmrun.requeue_requested()
    monkeypatch.setenv("SLURMRUN_REQUEUE_COUNT", "2")
    monkeypatch.setenv("SLURMRUN_REQUEUE_FLAG", str(tmp_path / "requeue.2"))
    assert requeue_count() == 2
    assert not slurmrun.requeue_requested()
    (tmp_path / "requeue.2").touch()
    assert slurmrun.requeue_requested()


@pytest.mark.skipif(shutil.which("srun") is None, reason="submitit's SlurmExecutor needs srun")
def test_dry_run_without_requeue_and_with_another_signal(tmp_path):
    never = str(slurmrun.submit(print, folder=tmp_path, requeue=False, dry_run=True))
    assert "#SBATCH --no-requeue\n" in never
    assert "#SBATCH --requeue\n" not in never
    usr1 = str(
        slurmrun.submit(print, folder=tmp_path, requeue=slurmrun.Requeue("USR1", 300), dry_run=True)
    )
    assert "#SBATCH --requeue\n" in usr1
    assert "#SBATCH --signal=USR1@300\n" in usr1


def test_cli_time_forms():
    from slurmrun.cli.submitting import parse_time

    assert [parse_time(t) for t in ("30", "5:30", "1:00:00", "2-0", "1-02:30")] == [
        30,
        6,
        60,
        2880,
        1590,
    ]
    for bad in ("0", "1h", "", "0:00:10x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_time(bad)


def test_cli_exit_statuses_without_a_cluster(tmp_path, capsys):
    from slurmrun.cli.main import main

    folder = str(tmp_path / "jobs")
    assert main(["status", "123", "--folder", folder]) == 1
    assert "no job 123 was submitted into" in capsys.readouterr().err
    assert main(["logs", "123", "--folder", folder]) == 1
    assert main(["cancel", "123", "--folder", folder]) == 1
    assert main(["jobs", "--folder", folder]) == 0
    assert capsys.readouterr().out.split() == ["JOBID", "STATE", "SUBMITTED", "WHAT"]
    assert main(["submit", str(tmp_path / "missing.py")]) == 2
    for bad in (["submit", "--nodes", "0", "x.py"], ["status"], ["logs", "1", "--rank", "a"]):
        with pytest.raises(SystemExit) as info:
            main(bad)
        assert info.value.code == 2


def test_cli_submit_takes_launcher_options_a_module_and_any_sbatch_option(tmp_path, capsys):
    from slurmrun.cli.main import main

    argv = [
        "submit", "--dry-run", "--nodes", "2", "--backend", "gloo", "--mem", "8G",
        "--extra-env-vars", "NCCL_DEBUG=INFO", "MY_*", "--sbatch", "constraint=a100",
        "--timeout=30", "--sbatch", "--exclusive", "--folder", str(tmp_path / "jobs"),
        "-m", "json.tool", "--nodes", "5",
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    for line in ("--nodes=2", "--mem=8G", "--constraint=a100", "--exclusive"):
        assert f"#SBATCH {line}\n" in out
    assert out.endswith(
        "# The job's batch step launches with slurmrun.Launcher(backend='gloo', timeout=30.0, "
        "extra_env_vars=('NCCL_DEBUG=INFO', 'MY_*')); every worker runs:\n"
        "#   -m json.tool --nodes 5\n"
    )
    assert not (tmp_path / "jobs").exists()


def test_cli_submit_refuses_bad_options_before_submitting(tmp_path, capsys):
    from slurmrun.cli.main import main

    script = tmp_path / "train.py"
    script.write_text("raise AssertionError('must not run')\n")
    folder = ["--folder", str(tmp_path / "jobs")]
    for argv, message in (
        (["--workers-per-host", "3"], "workers are its tasks; ask for them with --workers-per"),
        (["--hostnames", "node1", "node2"], "runs on the nodes SLURM gives it"),
        (["--timeout", "0"], "timeout must be a positive number"),
        (["-m"], "-m must be followed by the script or module"),
        ([], "no script given"),
    ):
        tail = [] if argv[-1:] == ["-m"] else [str(script)] * (argv != [])
        assert main(["submit", *folder, *argv, *tail]) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert main(["submit", *folder, "-m", "no_such_module_here"]) == 2
    assert "No module named 'no_such_module_here'" in capsys.readouterr().err
    for argv in (["--sbatch", "=x"], ["--time", "1h"]):  # the verb's own: argparse exits
        with pytest.raises(SystemExit) as info:
            main(["submit", *folder, *argv, str(script)])
        assert info.value.code == 2, argv
    assert main(["submit", *folder, "--backend", "fast", str(script)]) == 2
    assert "slurmrun submit: error: argument --backend: invalid value 'fast'" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "jobs").exists()


def test_cli_submit_help_lists_its_own_and_the_launchers_options(capsys):
    from slurmrun.cli.main import main

    assert main(["submit", "--nodes", "2", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--nodes", "--mem", "--sbatch", "--resources", "-m MODULE"):
        assert option in out
    for option in ("--backend", "--timeout", "--extra-env-vars", "--max-restarts"):
        assert option in out
    assert "--log-handlers" not in out


def test_cli_submit_array_runs_a_line_of_the_file_per_element(tmp_path, capsys):
    from slurmrun.cli.main import main

    sweep = tmp_path / "sweep.txt"
    # A byte-order mark, comments, a blank line; quotes.
    sweep.write_text('\ufeff# the sweep\n--lr 0.1  # the best\n\n  --lr 0.2 --tag "a b"\n')
    folder = ["--folder", str(tmp_path / "jobs")]
    argv = ["submit", "--dry-run", *folder, "--array", str(sweep), "--max-parallel", "1"]
    assert main([*argv, "-m", "json.tool", "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --array=0-1%1\n" in out
    assert out.endswith(
        "every worker runs:\n"
        "#   element 0: -m json.tool --epochs 2 --lr 0.1\n"
        "#   element 1: -m json.tool --epochs 2 --lr 0.2 --tag 'a b'\n"
    )
    assert not (tmp_path / "jobs").exists()


def test_cli_submit_array_refuses_a_bad_file_before_submitting(tmp_path, capsys):
    from slurmrun.cli.main import main

    script = tmp_path / "train.py"
    script.write_text("raise AssertionError('must not run')\n")
    (tmp_path / "empty.txt").write_text("\n# only a comment\n")
    (tmp_path / "quote.txt").write_text('--lr 0.1\n--tag "a b\n')
    (tmp_path / "latin1.txt").write_bytes(b"--name caf\xe9\n")
    folder = ["--folder", str(tmp_path / "jobs")]
    for argv, message in (
        (["--array", str(tmp_path / "missing.txt")], "No such file or directory"),
        (["--array", str(tmp_path / "empty.txt")], "has no line of arguments"),
        (["--array", str(tmp_path / "quote.txt")], "line 2: No closing quotation"),
        (["--array", str(tmp_path / "latin1.txt")], "can't decode byte 0xe9"),
        (["--max-parallel", "2"], "--max-parallel needs --array FILE"),
    ):
        assert main(["submit", *folder, *argv, str(script)]) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert not (tmp_path / "jobs").exists()


def test_cli_submit_map_shows_each_item_and_refuses_bad_options(tmp_path, capsys):
    from slurmrun.cli.main import main

    (tmp_path / "args.txt").write_text("--lr 0.1\n# skipped\n--lr 0.2 --tag 'a b'\n")
    folder = ["--folder", str(tmp_path / "jobs")]
    argv = ["submit", "--dry-run", *folder, "--map", str(tmp_path / "args.txt"), "--nodes", "2"]
    more = ["--workers-per-node", "2", "--workers-per-item", "2"]
    assert main([*argv, *more, "-m", "json.tool", "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --nodes=2\n" in out
    assert "--array" not in out
    assert out.endswith(
        "# The job's batch step maps 2 items on every slot of its nodes:\n"
        "#   item 0: -m json.tool --epochs 2 --lr 0.1\n"
        "#   item 1: -m json.tool --epochs 2 --lr 0.2 --tag 'a b'\n"
    )
    script = tmp_path / "train.py"
    script.write_text("raise AssertionError('must not run')\n")
    args = ["--map", str(tmp_path / "args.txt")]
    for argv, message in (
        (["--retries", "1"], "--retries goes with --map ARGS_FILE"),
        ([*args, "--array", str(tmp_path / "args.txt")], "--map and --array: give one"),
        (["--map", str(tmp_path / "missing.txt")], "no such file"),
        ([*args, "--workers-per-item", "3", "--gpus-per-node", "2"], "the job runs 2 workers a"),
    ):
        assert main(["submit", *folder, *argv, str(script)]) == 2, argv
        assert message in capsys.readouterr().err, argv
    for argv in (["--retries", "-1"], ["--item-timeout", "0"], ["--workers-per-item", "0"]):
        with pytest.raises(SystemExit) as info:  # the verb's own: argparse exits
            main(["submit", *folder, *args, *argv, str(script)])
        assert info.value.code == 2, argv
    assert not (tmp_path / "jobs").exists()


def test_a_map_failed_error_pickles_with_every_items_remote_traceback():
    from slurmrun.errors import MapFailedError, RemoteTraceback
    from slurmrun.pickling import dumps_inband, loads

    failed = ValueError("bad item")
    failed.__cause__ = RemoteTraceback("Traceback ...\nValueError: bad item\n")
    error = MapFailedError("1 of 2 items failed", results=[4, failed], failed=[1])
    error.add_note("slurmrun: a note")
    back = loads(dumps_inband(error))
    assert isinstance(back, MapFailedError)
    assert str(back) == "1 of 2 items failed"
    assert back.failed == [1]
    assert back.results[0] == 4
    assert isinstance(back.results[1], ValueError)
    assert isinstance(back.results[1].__cause__, RemoteTraceback)
    assert back.results[1].__cause__.text == "Traceback ...\nValueError: bad item\n"
    assert back.__notes__ == ["slurmrun: a note"]


REPO = Path(__file__).resolve().parents[1]
REQUEUED = """
from slurmrun.batch.requeue import requeue_this_job
print(requeue_this_job("7"), flush=True)  # returns only on a failed requeue
"""


def test_a_requeued_run_outlives_slurms_sigterm_and_ends_with_the_script_around_it(tmp_path):
    """SLURM's requeue SIGTERMs the job's processes, this one before the shell that waits for it:
    dying of it first let the batch script go on to its next command in the cut-short run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ready = tmp_path / "requeued"
    scontrol = bin_dir / "scontrol"  # the requeue itself, as SLURM answers it (tested on the
    scontrol.write_text(f"#!/bin/sh\ntouch {ready}\n")  # cluster: test_preemption_slurm.py)
    scontrol.chmod(0o755)
    (tmp_path / "requeued.py").write_text(REQUEUED)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    script = f"{shlex.quote(sys.executable)} requeued.py\necho 'the next command ran'\n"
    shell = subprocess.Popen(
        ["bash", "-c", script], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < deadline, "the requeue was not asked for"
            time.sleep(0.05)
        (run,) = psutil.Process(shell.pid).children()
        run.send_signal(signal.SIGTERM)  # SLURM's order: the run first, then its shell
        time.sleep(0.5)
        assert run.is_running() and run.status() != psutil.STATUS_ZOMBIE
        shell.send_signal(signal.SIGTERM)
        assert shell.wait(timeout=10) == -signal.SIGTERM
        run.wait(timeout=5)  # gone with its shell, not left for SLURM to find (else it raises)
    finally:
        shell.kill()
        out, _ = shell.communicate(timeout=10)
    assert "the next command ran" not in out


SLURM_GOLDEN = Path(__file__).parent / "golden" / "slurm"
FAKE_SCONTROL = """#!/bin/sh
case "$1 $2" in
  "show job") cat {folder}/job.txt ;;
  "show config") cat {golden}/config.txt ;;
  "show partition") cat {golden}/partition.txt ;;
  *) echo "scontrol $*" >> {folder}/asked ;;
esac
"""


@pytest.mark.parametrize(
    ("version", "asked"),
    [("22.05", "scontrol requeue 7"), ("24.11", "scancel --batch --signal=KILL 7")],
)
def test_a_preempted_run_ends_its_batch_script_where_slurm_requeues_it_then(
    tmp_path, version, asked
):
    """SLURM 24.05+ requeues a job preempted with a GraceTime when its batch script ends; a
    `scontrol requeue` in the grace leaves its preemption mark, and 24.11 requeues the next run
    too (it ran three times). There the run ends its batch script and asks for no requeue."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    now = time.strftime("%Y-%m-%dT%H:%M:%S")  # SLURM prints local time
    job = (SLURM_GOLDEN / version / "job_cpu.txt").read_text()
    (tmp_path / "job.txt").write_text(job.replace("PreemptTime=None", f"PreemptTime={now}"))
    fake = FAKE_SCONTROL.format(folder=tmp_path, golden=SLURM_GOLDEN / version)
    for name, text in (
        ("scontrol", fake),
        ("scancel", f'#!/bin/sh\necho "scancel $*" >> {tmp_path}/asked\n'),
    ):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "requeued.py").write_text(REQUEUED)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    run = subprocess.Popen([sys.executable, "requeued.py"], cwd=tmp_path, env=env, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "asked").exists():
            assert run.poll() is None, "it ended without asking SLURM for anything"
            assert time.monotonic() < deadline, "SLURM was asked for nothing"
            time.sleep(0.05)
        time.sleep(0.2)
    finally:
        run.kill()  # SLURM's part: it would end this run now
        run.wait(timeout=10)
    assert (tmp_path / "asked").read_text() == f"{asked}\n"
