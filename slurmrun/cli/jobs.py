"""``slurmrun status|logs|cancel|jobs``: following the jobs of ``slurmrun submit``.

They work on the jobs submitted into ``--folder`` (`slurmrun.cli.submit`). Exit status: 0;
2 for bad options; 1 for a job that was not submitted into the folder (or a failed
``scancel``), or whose files fail their seal (`slurmrun.errors.JobFolderTamperedError`);
130 when Ctrl-C ends ``logs --follow``.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from typing import Any

from slurmrun.cli.command import DEFAULT_FOLDER, FOLDER_HELP
from slurmrun.errors import JobFolderTamperedError, JobKeyError

__all__ = ["main"]

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
    try:
        return int(verb(args))
    except (FileNotFoundError, JobFolderTamperedError, JobKeyError) as e:
        # attach: no such job in the folder; or a file of the job fails its seal
        print(f"slurmrun {args.verb}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C ends `logs --follow` (the job runs on)
        return 130


def _handle(args: argparse.Namespace) -> Any:
    from slurmrun.batch.handle import attach  # noqa: PLC0415

    return attach(args.job_id, folder=args.folder)


def _status(args: argparse.Namespace) -> int:
    from slurmrun.slurm.queue import FINAL_STATES  # noqa: PLC0415

    job = _handle(args)
    state = job.state
    print(f"{job.job_id} {state}")
    if state in FINAL_STATES:
        print(_outcome(job, state))
    return 0


def _outcome(job: Any, state: str) -> str:
    """One line on how a job that ended went."""
    from slurmrun.cli.script import ScriptExit  # noqa: PLC0415

    try:
        result = job.result(timeout=0)
    except ScriptExit as e:
        where = " ".join(
            str(n).removeprefix("slurmrun: raised on ") for n in getattr(e, "__notes__", ())
        )
        return f"exit status {e.code} on {where}".rstrip()
    except (JobFolderTamperedError, JobKeyError):
        raise  # not an outcome of the job: main says it, and exits 1
    except Exception as e:  # what the launch raised, or JobFailedError
        first = str(e).splitlines()[0] if str(e) else ""
        return f"failed: {type(e).__name__}: {first}"
    return f"every rank finished ({len(result.values())} workers)"


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
    return 0
