"""``slurmrun [launcher options] SCRIPT.py [args...]`` (or ``-m MODULE``): the command's run.

The launcher options are the fields of `slurmrun.Launcher`
(`slurmrun.cli.command.parse_launcher`); everything from the script's path (or ``-m MODULE``)
on belongs to the script, as with ``python`` and ``torchrun``. `main` parses them, and
`run_command` runs the script on every worker through `slurmrun.cli.script.run_script` (or,
for ``--dry-run``, shows the plan) and turns what happened into the command's exit status: a
rank's own ``sys.exit`` status, 1 for a raised exception, 128+N for a worker killed by signal
N, 2 for bad options. See ``docs/cli.md``.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
from typing import TYPE_CHECKING, Any

from slurmrun.cli.command import UsageError, check_target, parse_launcher, split_command
from slurmrun.cli.helptext import help_text, usage_text
from slurmrun.cli.map_command import MAP_OPTIONS, Sweep, read_sweep, run_map_command
from slurmrun.cli.script import ScriptExit, run_script
from slurmrun.errors import OptionsError, RemoteTraceback, WorkerFailedError
from slurmrun.variables import PRELOAD_VAR
from slurmrun.versions import slurmrun_version

if TYPE_CHECKING:
    from slurmrun.cli.command import Command
    from slurmrun.launcher.driver import Launcher

__all__ = ["SIGTERM_STATUS", "main", "run_command", "usage_error"]

SIGTERM_STATUS = 143  # 128 + SIGTERM, as a shell reports a process SIGTERM ended


def main(argv: list[str]) -> int:
    """``slurmrun [OPTIONS] SCRIPT [ARGS...]``; returns its exit status.

    Args:
        argv: the arguments after the program's name.

    Returns:
        0 when every rank finished (and after ``--help``, ``--version``); the first failing
        rank's ``sys.exit`` status; 1 when a rank raised; 128+N for a worker killed by signal
        N; 130 on Ctrl-C; 2 for bad options (``slurmrun: error: ...``, as argparse).
    """
    try:
        cmd = split_command(argv, own=MAP_OPTIONS)
    except UsageError as e:
        return usage_error(str(e))
    # Only before the script: `slurmrun train.py --help` gives --help to the script.
    if {"-h", "--help", "--version"} & set(cmd.launcher_args):
        asked_help = {"-h", "--help"} & set(cmd.launcher_args)
        print(help_text() if asked_help else f"slurmrun {slurmrun_version()}")
        return 0
    try:
        launcher = parse_launcher(cmd.launcher_args, words=cmd.words)
        check_target(cmd)
        sweep = read_sweep(cmd.own_args)
    except UsageError as e:
        return usage_error(str(e))
    return run_command(launcher, cmd, sweep)


def usage_error(message: str) -> int:
    """Prints the usage and `message` as argparse would; returns 2, a usage error's status."""
    print(f"{usage_text()}\nslurmrun: error: {message}", file=sys.stderr)
    return 2


def run_command(launcher: Launcher, cmd: Command, sweep: Sweep | None = None) -> int:
    """Runs (or, for ``--dry-run``, shows) the script on every worker; returns the exit status.

    With a `sweep` (``--map``'s), the script runs once per line of its file instead, packed
    on the slots (`slurmrun.cli.map_command`).
    """
    target = cmd.target if cmd.module else os.path.abspath(cmd.target)
    func_args = (target, cmd.script_args)
    func_kwargs = {"module": cmd.module}
    if cmd.dry_run:
        return _dry_run(launcher, func_args, func_kwargs, sweep)
    # Workers need torch (the script imports it) even without a pre-initialised group: the
    # spawner imports it once per node, before forking them.
    os.environ.setdefault(PRELOAD_VAR, "torch")
    try:
        status = 0
        if sweep is None:
            launcher.run(run_script, func_args, func_kwargs)
        else:
            status = run_map_command(launcher, cmd, target, sweep)
    except OptionsError as e:  # checked before anything starts
        return usage_error(str(e))
    except KeyboardInterrupt:
        print("slurmrun: interrupted; every agent and worker was stopped", file=sys.stderr)
        return 130
    except SystemExit as e:
        # SIGTERM (the launcher's handler exits with 143): a command run in a job step is
        # terminated with the job's other steps when SLURM preempts the job.
        if e.code == SIGTERM_STATUS:
            return _requeue_if_preempted(SIGTERM_STATUS)
        raise
    except Exception as e:
        return _requeue_if_preempted(_report_failure(e))
    return status


def _dry_run(
    launcher: Launcher,
    func_args: tuple[Any, ...],
    func_kwargs: dict[str, Any],
    sweep: Sweep | None,
) -> int:
    """Prints the plan, or (status 1) the one-line error that `run` would raise before starting."""
    try:
        plan = launcher.dry_run(run_script, func_args, func_kwargs)
    except OptionsError as e:
        return usage_error(str(e))
    except Exception as e:  # a host it cannot resolve, a node not in the job...
        return _report_failure(e)
    target, args = func_args
    if func_kwargs["module"]:
        what = f"{shlex.join(['-m', target, *args])} (module mode: as python -m would"
    else:
        what = f"{shlex.join([target, *args])} (script mode: as python would"
    if sweep is not None:
        what += f", once per line of --map's file: {len(sweep.lines)} items, packed on the slots"
    print(dataclasses.replace(plan, workers_run=f"{what}, sys.argv set)"))
    return 0


def _requeue_if_preempted(status: int) -> int:
    """Requeues this job if SLURM preempts it (the launch failed for that); returns `status`.

    With a partition's ``GraceTime``, SLURM terminates a preempted job's steps while its batch
    script runs on: were this command to return, the script would go on in a cut-short run
    (and end the job COMPLETED, before SLURM 24.05). So it requeues the job now, as SLURM
    would at the grace's end (only a requeueable job), and SLURM ends this process
    (`requeue_this_job`; from 24.05 on by ending the batch script, which SLURM requeues).
    """
    from slurmrun.batch.requeue import requeue_this_job  # noqa: PLC0415
    from slurmrun.slurm.job import own_job_id  # noqa: PLC0415
    from slurmrun.slurm.job_end import preemption  # noqa: PLC0415

    job_id = own_job_id()
    preempted = preemption(job_id) if job_id else None
    if preempted is None:
        return status
    if not preempted.requeueable:
        print(f"slurmrun: job {job_id} was preempted (not requeueable)", file=sys.stderr)
        return status
    print(
        f"slurmrun: job {job_id} was preempted at {preempted.time}: requeueing it",
        file=sys.stderr,
        flush=True,
    )
    print(f"slurmrun: {requeue_this_job(preempted.job_id)}", file=sys.stderr)
    return status


def _report_failure(e: Exception) -> int:
    """Prints why the launch failed (a rank's traceback, a dead worker...); returns the status."""
    notes = [str(n) for n in getattr(e, "__notes__", ())]
    where = " ".join(n.removeprefix("slurmrun: raised on ") for n in notes)
    if isinstance(e, ScriptExit):
        print(f"slurmrun: exit status {e.code} on {where}", file=sys.stderr)
        return e.code
    if isinstance(e.__cause__, RemoteTraceback):
        print(e.__cause__.text.rstrip(), file=sys.stderr)
        for note in notes:
            print(note, file=sys.stderr)
        return 1
    print(f"slurmrun: {type(e).__name__}: {e}", file=sys.stderr)
    for note in notes:
        print(note, file=sys.stderr)
    log_file = getattr(e, "log_file", None)  # WorkerFailedError, AgentFailedError
    if log_file and log_file not in str(e):
        print(f"slurmrun: its log: {log_file}", file=sys.stderr)
    if isinstance(e, WorkerFailedError) and e.exitcode:
        return 128 - e.exitcode if e.exitcode < 0 else e.exitcode
    return 1
