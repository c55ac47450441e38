"""``slurmrun submit|status|logs|cancel|jobs``: script mode as batch jobs, from a login node.

``slurmrun submit [options] SCRIPT.py [args...]`` submits what ``slurmrun SCRIPT.py`` runs
(`slurmrun.cli.script.run_script` on every worker) through `slurmrun.submit` and prints the
job id; the other verbs work on the jobs submitted into ``--folder``. Exit status: 0; 2 for
bad options; 1 for a job that was not submitted into the folder (or a failed ``scancel``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
import time
from typing import Any

__all__ = ["VERBS", "main", "parse_time"]

VERBS = ("submit", "status", "logs", "cancel", "jobs")
DEFAULT_FOLDER = "slurmrun_jobs"
FOLLOW_POLL = 1.0


def parse_time(text: str) -> int:
    """Minutes from sbatch's ``--time`` forms: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM]``.

    Raises:
        argparse.ArgumentTypeError: any other text, or zero.
    """
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"invalid time {text!r} (MM, HH:MM:SS or D-HH:MM)")
    days, a, b, c = (int(g) if g is not None else None for g in match.groups())
    assert a is not None  # noqa: S101 - the pattern requires it
    if days is not None:  # D-HH, D-HH:MM, D-HH:MM:SS
        seconds = days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    elif c is not None:  # HH:MM:SS
        seconds = a * 3600 + (b or 0) * 60 + c
    elif b is not None:  # MM:SS
        seconds = a * 60 + b
    else:
        seconds = a * 60
    minutes = -(-seconds // 60)
    if minutes < 1:
        raise argparse.ArgumentTypeError(f"invalid time {text!r}: at least one minute")
    return minutes


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slurmrun",
        description="Submit script mode as a SLURM batch job, and follow the jobs submitted.",
    )
    verbs = parser.add_subparsers(dest="verb", required=True)
    folder_help = f"the folder jobs are submitted into (default: ./{DEFAULT_FOLDER})"

    submit = verbs.add_parser(
        "submit",
        help="submit SCRIPT.py as a batch job; prints the job id",
        description="Submits `slurmrun SCRIPT.py [args]` as a batch job; prints its job id.",
    )
    submit.add_argument("--nodes", type=_positive, default=1)
    submit.add_argument("--gpus-per-node", type=_positive, default=None)
    submit.add_argument("--workers-per-node", type=_positive, default=None)
    submit.add_argument("--cpus-per-worker", type=_positive, default=1)
    submit.add_argument("--partition", default=None)
    submit.add_argument("--account", default=None)
    submit.add_argument(
        "--time", type=parse_time, default=60, help="time limit (minutes, or HH:MM:SS)"
    )
    submit.add_argument("--job-name", default="slurmrun")
    submit.add_argument("--no-requeue", action="store_true", help="never requeue the job")
    submit.add_argument("--folder", default=DEFAULT_FOLDER, help=folder_help)
    submit.add_argument("--dry-run", action="store_true", help="print the batch script only")
    submit.add_argument("script", help="the script every worker runs as __main__")
    submit.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")

    for verb, text in (
        ("status", "print a job's state (and its outcome once it ended)"),
        ("cancel", "cancel a job"),
    ):
        sub = verbs.add_parser(verb, help=text, description=text)
        sub.add_argument("job_id")
        sub.add_argument("--folder", default=DEFAULT_FOLDER, help=folder_help)
    logs = verbs.add_parser(
        "logs", help="print a worker's output", description="print a worker's output"
    )
    logs.add_argument("job_id")
    logs.add_argument("--rank", type=int, default=0)
    logs.add_argument("--follow", "-f", action="store_true", help="until the job ends")
    logs.add_argument("--folder", default=DEFAULT_FOLDER, help=folder_help)
    listing = verbs.add_parser("jobs", help="list the jobs submitted", description="list jobs")
    listing.add_argument("--folder", default=DEFAULT_FOLDER, help=folder_help)
    return parser


def main(argv: list[str]) -> int:
    """Runs one verb (``argv[0]``); returns the exit status."""
    args = _parser().parse_args(argv)  # exits with 2 on bad options
    verb: Any = {
        "submit": _submit,
        "status": _status,
        "logs": _logs,
        "cancel": _cancel,
        "jobs": _jobs,
    }[args.verb]
    try:
        return int(verb(args))
    except FileNotFoundError as e:  # attach: no such job in the folder
        print(f"slurmrun {args.verb}: {e}", file=sys.stderr)
        return 1


def _submit(args: argparse.Namespace) -> int:
    from slurmrun.batch.submit import submit  # noqa: PLC0415 - only this verb pays for it
    from slurmrun.cli.script import run_script  # noqa: PLC0415
    from slurmrun.launcher import Launcher  # noqa: PLC0415

    if not os.path.isfile(args.script):
        print(
            f"slurmrun submit: error: can't open file {os.path.abspath(args.script)!r}",
            file=sys.stderr,
        )
        return 2
    target = os.path.abspath(args.script)
    params: dict[str, Any] = {"job_name": args.job_name}
    for name in ("partition", "account"):
        if getattr(args, name) is not None:
            params[name] = getattr(args, name)
    options: dict[str, Any] = {
        "launcher": Launcher(backend=None),  # as `slurmrun SCRIPT.py`: the script's own group
        "folder": args.folder,
        "nodes": args.nodes,
        "gpus_per_node": args.gpus_per_node,
        "workers_per_node": args.workers_per_node,
        "cpus_per_worker": args.cpus_per_worker,
        "time_min": args.time,
        "slurm_parameters": params,
        "requeue": not args.no_requeue,
    }
    call = (target, list(args.args))
    if args.dry_run:
        print(submit(run_script, call, {"module": False}, dry_run=True, **options))
        return 0
    job = submit(run_script, call, {"module": False}, **options)
    meta = job.files.meta()
    meta["function"] = " ".join(["script", args.script, *args.args])
    job.files.write_meta(meta)
    print(job.job_id)
    return 0


def _handle(args: argparse.Namespace) -> Any:
    from slurmrun.batch.handle import attach  # noqa: PLC0415

    return attach(args.job_id, folder=args.folder)


def _status(args: argparse.Namespace) -> int:
    from slurmrun.batch.state import FINAL_STATES  # noqa: PLC0415

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
    except Exception as e:  # what the launch raised, or JobFailedError
        first = str(e).splitlines()[0] if str(e) else ""
        return f"failed: {type(e).__name__}: {first}"
    return f"every rank finished ({len(result.values())} workers)"


def _logs(args: argparse.Namespace) -> int:
    from slurmrun.batch.state import FINAL_STATES  # noqa: PLC0415

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
