"""``slurmrun status|logs|cancel|jobs``: following the jobs of ``slurmrun submit``.

They work on the jobs submitted into ``--folder`` (`slurmrun.cli.submitting`); ``jobs`` then
lists the user's reservations (`slurmrun.reserve`). Exit status: 0;
2 for bad options; 1 for a job that was not submitted into the folder, a folder that is
not the user's alone (`slurmrun.batch.JobFolderError`), a job whose files fail their seal
(`slurmrun.errors.JobFolderTamperedError`), or a failed ``scancel``; 130 when Ctrl-C ends
``logs --follow``.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from typing import Any

from slurmrun.cli.command import DEFAULT_FOLDER, FOLDER_HELP
from slurmrun.errors import JobFolderTamperedError, JobKeyError

__all__ = ["failure_text", "main"]

FOLLOW_POLL = 1.0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slurmrun",
        description="Follow the jobs submitted with `slurmrun submit`.",
    )
    verbs = parser.add_subparsers(dest="verb", required=True)
    for verb, text in (
        ("status", "print a job's state (and its outcome once it ended)"),
        ("cancel", "cancel a job"),
    ):
        sub = verbs.add_parser(verb, help=text, description=text)
        sub.add_argument("job_id")
        sub.add_argument("--folder", default=DEFAULT_FOLDER, help=FOLDER_HELP)
    logs = verbs.add_parser(
        "logs", help="print a worker's output", description="print a worker's output"
    )
    logs.add_argument("job_id")
    logs.add_argument("--rank", type=int, default=0)
    logs.add_argument("--follow", "-f", action="store_true", help="until the job ends")
    logs.add_argument("--folder", default=DEFAULT_FOLDER, help=FOLDER_HELP)
    listing = verbs.add_parser("jobs", help="list the jobs submitted", description="list jobs")
    listing.add_argument("--folder", default=DEFAULT_FOLDER, help=FOLDER_HELP)
    return parser


def main(argv: list[str]) -> int:
    """Runs one verb (``argv[0]``); returns the exit status."""
    args = _parser().parse_args(argv)  # exits with 2 on bad options
    verb: Any = {
        "status": _status,
        "logs": _logs,
        "cancel": _cancel,
        "jobs": _jobs,
    }[args.verb]
    from slurmrun.batch.folder import JobFolderError  # noqa: PLC0415 - light (no submitit)

    try:
        return int(verb(args))
    except FileNotFoundError as e:  # attach: no such job in the folder
        print(f"slurmrun {args.verb}: {e}{_array_tasks(args)}", file=sys.stderr)
        return 1
    except (JobFolderError, JobFolderTamperedError, JobKeyError) as e:
        # not the user's alone (nothing read), or a file of the job fails its seal
        print(f"slurmrun {args.verb}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C ends `logs --follow` (the job runs on)
        return 130


def _array_tasks(args: argparse.Namespace) -> str:
    """For the id of a job array, which of its tasks were submitted into the folder."""
    from slurmrun.batch.folder import submitted_jobs  # noqa: PLC0415

    tasks = [
        job.job_id
        for job in submitted_jobs(args.folder)
        if job.job_id.partition("_")[0] == args.job_id and "_" in job.job_id
    ]
    if not tasks:
        return ""
    shown = ", ".join(tasks[:5]) + (f" ... ({len(tasks)} tasks)" if len(tasks) > 5 else "")
    return (
        f". {args.job_id} is a job array, whose tasks are jobs of their own: {shown} "
        f"(slurmrun {args.verb} {tasks[0]})"
    )


def _handle(args: argparse.Namespace) -> Any:
    from slurmrun.batch.handle import attach  # noqa: PLC0415

    return attach(args.job_id, folder=args.folder)


def _status(args: argparse.Namespace) -> int:
    from slurmrun.batch.handle import SubmittedMap  # noqa: PLC0415
    from slurmrun.slurm.queue import FINAL_STATES  # noqa: PLC0415

    job = _handle(args)
    state = job.state
    print(f"{job.job_id} {state}")
    if isinstance(job, SubmittedMap) and state not in FINAL_STATES:
        done, items = job.progress()
        print(f"{done} of {items} items finished")
    if state in FINAL_STATES:
        try:
            result = job.result(timeout=0)
        except (JobFolderTamperedError, JobKeyError):
            raise  # not an outcome of the job: main says it, and exits 1
        except Exception as e:  # what the launch raised, or JobFailedError
            print(failure_text(e))
        else:
            if isinstance(result, list):  # a map's values
                print(f"every item finished ({len(result)} items)")
            else:
                print(f"every rank finished ({len(result.values())} workers)")
    return 0


def failure_text(error: BaseException) -> str:
    """How a job that ended failed, whole: what the launch raised (its every line), where.

    A script's exit status and the rank that exited; else the exception's type and message,
    the remote traceback when there is one (as ``slurmrun SCRIPT.py`` prints it), and the
    notes (which rank raised it, its log).
    """
    from slurmrun.cli.script import ScriptExit  # noqa: PLC0415
    from slurmrun.errors import RemoteTraceback  # noqa: PLC0415

    notes = [str(n) for n in getattr(error, "__notes__", ())]
    if isinstance(error, ScriptExit):
        where = " ".join(n.removeprefix("slurmrun: raised on ") for n in notes)
        return f"exit status {error.code}" + (f" on {where}" if where else "")
    lines = [f"failed: {type(error).__name__}: {error}".rstrip()]
    cause = error.__cause__
    if isinstance(cause, RemoteTraceback) and cause.text.strip():
        lines.append(cause.text.rstrip())
    return "\n".join([*lines, *notes])


def _logs(args: argparse.Namespace) -> int:
    from slurmrun.slurm.queue import FINAL_STATES  # noqa: PLC0415

    job = _handle(args)
    shown = 0
    while True:
        ended = args.follow and job.state in FINAL_STATES  # before reading: nothing is missed
        text = job.logs(rank=args.rank)
        sys.stdout.write(text[shown:])
        sys.stdout.flush()
        shown = len(text)
        if not args.follow or ended:
            return 0
        time.sleep(FOLLOW_POLL)


def _cancel(args: argparse.Namespace) -> int:
    import subprocess  # noqa: PLC0415

    job = _handle(args)
    try:
        job.cancel()
    except subprocess.CalledProcessError as e:
        print(f"slurmrun cancel: scancel {job.job_id} failed: {e.stderr!r}", file=sys.stderr)
        return 1
    print(f"{job.job_id} cancelled")
    return 0


def _jobs(args: argparse.Namespace) -> int:
    from slurmrun.batch.listing import jobs  # noqa: PLC0415

    rows = [("JOBID", "STATE", "SUBMITTED", "WHAT")]
    for info in jobs(folder=args.folder):
        when = "?"
        if info.submitted is not None:
            when = datetime.datetime.fromtimestamp(info.submitted).strftime("%Y-%m-%d %H:%M:%S")
        rows.append((info.job_id, info.state, when, info.function))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print(
            "  ".join([*(c.ljust(w) for c, w in zip(row, widths, strict=False)), row[3]]).rstrip()
        )
    _reservations()
    return 0


def _reservations() -> None:
    """This user's reservations (`slurmrun.reserve`), after the jobs, if there are any."""
    from slurmrun.batch.reserve import reservations  # noqa: PLC0415

    found = reservations()
    if not found:
        return
    rows = [("RESERVATION", "STATE", "NODES", "TIME LEFT", "LAUNCHER")]
    for info in found:
        who = info.attached or f"none for {info.idle_for:.0f} s"
        rows.append((info.job_id, info.state, ",".join(info.hostnames), info.time_left, who))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    print()
    for row in rows:
        print("  ".join([*(c.ljust(w) for c, w in zip(row, widths, strict=False)), row[4]]))
