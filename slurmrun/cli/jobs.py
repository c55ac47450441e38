"""``slurmrun submit|status|logs|cancel|jobs``: script mode as batch jobs, from a login node.

``slurmrun submit [submit options] [launcher options] SCRIPT.py [args...]`` (or ``-m
MODULE``) submits what ``slurmrun SCRIPT.py`` runs (`slurmrun.cli.script.run_script` on every
worker) through `slurmrun.submit` and prints the job id; the other verbs work on the jobs
submitted into ``--folder``. Exit status: 0; 2 for bad options; 1 for a job that was not
submitted (sbatch refused it), or not submitted into the folder (or a failed ``scancel``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
import textwrap
import time
from typing import Any

__all__ = ["VERBS", "main", "parse_time"]

VERBS = ("submit", "status", "logs", "cancel", "jobs")
DEFAULT_FOLDER = "slurmrun_jobs"
FOLDER_HELP = f"the folder jobs are submitted into (default: ./{DEFAULT_FOLDER})"
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


SUBMIT_USAGE = """\
slurmrun submit [-h] [--dry-run] [SUBMIT OPTIONS] [LAUNCHER OPTIONS] SCRIPT.py [ARGS...]
       slurmrun submit [-h] [--dry-run] [SUBMIT OPTIONS] [LAUNCHER OPTIONS] -m MODULE [ARGS...]"""

SUBMIT_EPILOG = """\
Launcher options: those of `slurmrun SCRIPT.py` (`slurmrun --help`): {options}. As there, the
script makes its own process group unless --backend asks for one, everything from SCRIPT.py
(or -m MODULE) on belongs to the script, and `--` may end the options. --dry-run prints the
batch script and submits nothing."""


def _submit_parser() -> tuple[argparse.ArgumentParser, dict[str, bool]]:
    """`slurmrun submit`'s own options, and for each whether it takes a value."""
    from slurmrun.cli.main import launcher_options  # noqa: PLC0415

    parser = argparse.ArgumentParser(
        prog="slurmrun submit",
        usage=SUBMIT_USAGE,
        description="Submits `slurmrun SCRIPT.py [ARGS]` as a batch job; prints its job id.",
        epilog=textwrap.fill(
            SUBMIT_EPILOG.format(options=", ".join(launcher_options())), break_on_hyphens=False
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # --time must not take --timeout's place, nor --t either
    )
    own: dict[str, bool] = {}

    def add(flag: str, **kwargs: Any) -> None:
        parser.add_argument(flag, **kwargs)
        own[flag] = kwargs.get("action") != "store_true"

    add("--nodes", type=_positive, default=1)
    add("--gpus-per-node", type=_positive, default=None)
    add("--workers-per-node", type=_positive, default=None, help="default: GPUs per node, or 1")
    add("--cpus-per-worker", type=_positive, default=1)
    add("--mem", default=None, help="memory per node, as sbatch takes it (e.g. 64G)")
    add("--partition", default=None)
    add("--account", default=None)
    add("--time", type=parse_time, default=60, help="time limit (minutes, or HH:MM:SS)")
    add("--job-name", default="slurmrun")
    add("--resources", default=None, help="a named preset of an installed package")
    add(
        "--sbatch",
        action="append",
        type=_sbatch_option,
        default=[],
        metavar="NAME[=VALUE]",
        help="any other sbatch option, once each (--sbatch constraint=a100 --sbatch exclusive)",
    )
    add("--no-requeue", action="store_true", help="never requeue the job")
    add("--folder", default=DEFAULT_FOLDER, help=FOLDER_HELP)
    return parser, own


def _sbatch_option(text: str) -> tuple[str, str | bool]:
    """``NAME=VALUE`` (or a bare ``NAME`` flag) as submitit's ``additional_parameters`` item."""
    name, sep, value = text.partition("=")
    name = name.strip().lstrip("-").replace("-", "_")
    if not name or not all(c.isalnum() or c == "_" for c in name):
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE (e.g. constraint=a100)")
    return name, value if sep else True


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
    if argv[:1] == ["submit"]:
        return _submit(argv[1:])
    args = _parser().parse_args(argv)  # exits with 2 on bad options
    verb: Any = {
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
    except KeyboardInterrupt:  # Ctrl-C ends `logs --follow` (the job runs on)
        return 130


def _submit_error(message: str) -> int:
    print(f"usage: {SUBMIT_USAGE}\nslurmrun submit: error: {message}", file=sys.stderr)
    return 2


def _submit(argv: list[str]) -> int:
    from slurmrun.cli.main import UsageError, check_target, parse_launcher, split_command  # noqa: PLC0415

    parser, own = _submit_parser()
    try:
        cmd = split_command(argv, own)
    except UsageError as e:
        return _submit_error(str(e))
    if "-h" in cmd.launcher_args or "--help" in cmd.launcher_args:
        parser.print_help()
        return 0
    args = parser.parse_args(cmd.own_args)  # exits with 2 on bad options
    launcher = parse_launcher(cmd.launcher_args, prog="slurmrun submit")
    try:
        check_target(cmd)
    except UsageError as e:
        return _submit_error(str(e))
    return _submit_job(args, cmd, launcher)


def _submit_job(args: argparse.Namespace, cmd: Any, launcher: Any) -> int:
    from submitit.core.utils import FailedJobError  # noqa: PLC0415

    from slurmrun.batch.submit import submit  # noqa: PLC0415 - only this verb pays for it
    from slurmrun.cli.script import run_script  # noqa: PLC0415

    params: dict[str, Any] = {"job_name": args.job_name}
    for name in ("partition", "account", "mem"):
        if getattr(args, name) is not None:
            params[name] = getattr(args, name)
    if args.sbatch:
        params["additional_parameters"] = dict(args.sbatch)
    options: dict[str, Any] = {
        "launcher": launcher,
        "folder": args.folder,
        "nodes": args.nodes,
        "gpus_per_node": args.gpus_per_node,
        "workers_per_node": args.workers_per_node,
        "cpus_per_worker": args.cpus_per_worker,
        "time_min": args.time,
        "slurm_parameters": params,
        "requeue": not args.no_requeue,
        "resources": args.resources,
    }
    target = cmd.target if cmd.module else os.path.abspath(cmd.target)
    call = (target, list(cmd.script_args))
    kwargs = {"module": cmd.module}
    try:
        if cmd.dry_run:
            script = submit(run_script, call, kwargs, dry_run=True, **options)
        else:
            job = submit(run_script, call, kwargs, **options)
    except (ValueError, TypeError) as e:
        return _submit_error(str(e))
    except (OSError, FailedJobError) as e:
        print(f"slurmrun submit: {e}", file=sys.stderr)
        return 1
    if cmd.dry_run:
        print(f"{script}\n{_what_runs(launcher, cmd)}")
        return 0
    meta = job.files.meta()
    kind = "module" if cmd.module else "script"
    meta["function"] = " ".join([kind, cmd.target, *cmd.script_args])
    job.files.write_meta(meta)
    print(job.job_id)
    return 0


def _what_runs(launcher: Any, cmd: Any) -> str:
    """The dry run's last lines: the launch the job's batch step runs."""
    import dataclasses  # noqa: PLC0415
    import shlex  # noqa: PLC0415

    from slurmrun.launcher import Launcher  # noqa: PLC0415

    default = Launcher()
    changed = ", ".join(
        f"{f.name}={getattr(launcher, f.name)!r}"
        for f in dataclasses.fields(launcher)
        if getattr(launcher, f.name) != getattr(default, f.name)
    )
    target = ["-m", cmd.target] if cmd.module else [os.path.abspath(cmd.target)]
    return (
        f"# The job's batch step launches with slurmrun.Launcher({changed}); every worker runs:\n"
        f"#   {shlex.join([*target, *cmd.script_args])}"
    )


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
