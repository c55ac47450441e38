"""``slurmrun submit``: script mode (``slurmrun SCRIPT.py``) as a batch job, or an array of them.

``slurmrun submit [submit options] [launcher options] SCRIPT.py [args...]`` (or ``-m
MODULE``) submits what ``slurmrun SCRIPT.py`` runs (`slurmrun.cli.script.run_script` on every
worker) through `slurmrun.submit` and prints the job id; with ``--array FILE``, one job array
through `slurmrun.submit_array`, whose element K adds the K-th line of arguments of FILE to
the script's, and prints one id per element. ``slurmrun status|logs|cancel|jobs``
(`slurmrun.cli.jobs`) follow them; stderr says which cluster and partition took them. Exit
status: 0; 2 for bad options (nothing submitted); 1 when SLURM is not reachable from here or
sbatch refused the job (what is wrong is printed).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import textwrap
from typing import TYPE_CHECKING, Any, TypeVar

from slurmrun.cli.command import (
    DEFAULT_FOLDER,
    FOLDER_HELP,
    UsageError,
    check_target,
    launcher_options,
    parse_launcher,
    split_command,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from slurmrun.batch.job_resources import JobOptions
    from slurmrun.cli.map_command import Sweep

T = TypeVar("T")

__all__ = ["main", "parse_time", "read_array_file"]


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
       slurmrun submit [-h] [--dry-run] [SUBMIT OPTIONS] [LAUNCHER OPTIONS] -m MODULE [ARGS...]
       slurmrun submit --array FILE [--max-parallel N] [...] SCRIPT.py [ARGS...]
       slurmrun submit --map ARGS_FILE [--workers-per-item N] [...] SCRIPT.py [ARGS...]"""

SUBMIT_EPILOG = """\
Launcher options: those of `slurmrun SCRIPT.py` (`slurmrun --help`): {options}. As there, the
script makes its own process group unless --backend asks for one, everything from SCRIPT.py
(or -m MODULE) on belongs to the script, and `--` may end the options. --dry-run prints the
batch script and submits nothing."""


def _submit_parser() -> tuple[argparse.ArgumentParser, dict[str, bool]]:
    """`slurmrun submit`'s own options, and for each whether it takes a value."""
    parser = argparse.ArgumentParser(
        prog="slurmrun submit",
        usage=SUBMIT_USAGE,
        description=(
            "Submits `slurmrun SCRIPT.py [ARGS]` as a batch job and prints its job id; with "
            "--array FILE, a job array whose element K adds FILE's K-th line of arguments to "
            "ARGS (# starts a comment; empty lines are skipped), and prints an id per element; "
            "with --map ARGS_FILE, one job that runs `slurmrun --map ARGS_FILE SCRIPT.py "
            "[ARGS]`: the script once per line, packed on every slot of the job's nodes."
        ),
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

    add("--nodes", type=_positive, default=None, help="default: the preset's, or 1")
    add("--gpus-per-node", type=_positive, default=None)
    add("--workers-per-node", type=_positive, default=None, help="default: GPUs per node, or 1")
    add("--cpus-per-worker", type=_positive, default=None, help="default: the preset's, or 1")
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
    add(
        "--array",
        default=None,
        metavar="FILE",
        help="submit a job array: element K adds FILE's K-th line of arguments to the script's",
    )
    add("--max-parallel", type=_positive, default=None, help="with --array: elements at once")
    add(
        "--map",
        default=None,
        metavar="ARGS_FILE",
        help="one job that runs the script once per line of ARGS_FILE on every slot (a sweep)",
    )
    add("--workers-per-item", type=_positive, default=None, help="with --map: a slot's workers")
    add(
        "--retries",
        type=_whole,
        default=None,
        help="with --map: how many times a failed line is tried again",
    )
    add(
        "--item-timeout",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="with --map: seconds a line may run",
    )
    add("--no-requeue", action="store_true", help="never requeue the job")
    add("--folder", default=DEFAULT_FOLDER, help=FOLDER_HELP)
    return parser, own


def _whole(text: str) -> int:
    from slurmrun.cli.map_command import whole_number  # noqa: PLC0415

    try:
        return whole_number(text, 0)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _seconds(text: str) -> float:
    from slurmrun.cli.map_command import positive_seconds  # noqa: PLC0415

    try:
        return positive_seconds(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _sbatch_option(text: str) -> tuple[str, str | bool]:
    """``NAME=VALUE`` (or a bare ``NAME`` flag) as submitit's ``additional_parameters`` item."""
    name, sep, value = text.partition("=")
    name = name.strip().lstrip("-").replace("-", "_")
    if not name or not all(c.isalnum() or c == "_" for c in name):
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE (e.g. constraint=a100)")
    return name, value if sep else True


def _submit_error(message: str) -> int:
    print(f"usage: {SUBMIT_USAGE}\nslurmrun submit: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    """``slurmrun submit ...`` (`argv`: after ``submit``); returns the exit status."""
    parser, own = _submit_parser()
    try:
        cmd = split_command(argv, own)
    except UsageError as e:
        return _submit_error(str(e))
    if "-h" in cmd.launcher_args or "--help" in cmd.launcher_args:
        parser.print_help()
        return 0
    args = parser.parse_args(cmd.own_args)  # exits with 2 on bad options
    try:
        launcher = parse_launcher(cmd.launcher_args, prog="slurmrun submit", words=cmd.words)
        check_target(cmd)
        _check_job_launcher(launcher)
        elements = None if args.array is None else read_array_file(args.array)
        sweep = _sweep(args)
    except UsageError as e:
        return _submit_error(str(e))
    if args.max_parallel is not None and elements is None:
        return _submit_error("--max-parallel needs --array FILE")
    if sweep is not None:
        return _submit_map(args, cmd, launcher, sweep)
    return _submit_job(args, cmd, launcher, elements)


def _sweep(args: argparse.Namespace) -> Sweep | None:
    """``--map``'s lines and options; None without ``--map``.

    Raises:
        UsageError: a map's option without ``--map``, ``--map`` with ``--array``, or a bad
            file (`read_args_file`).
    """
    from slurmrun.cli.map_command import Sweep, read_args_file  # noqa: PLC0415

    options = {"--workers-per-item": args.workers_per_item, "--retries": args.retries}
    options["--item-timeout"] = args.item_timeout
    if args.map is None:
        given = [name for name, value in options.items() if value is not None]
        if given:
            raise UsageError(f"{given[0]} goes with --map ARGS_FILE (a map's option)")
        return None
    if args.array is not None:
        raise UsageError(
            "--map and --array: give one (--map runs every line in one job, on every slot of "
            "its nodes; --array submits a job per line)"
        )
    return Sweep(
        read_args_file(args.map),
        workers_per_item=args.workers_per_item or 1,
        retries=args.retries or 0,
        item_timeout=args.item_timeout,
    )


def _check_job_launcher(launcher: Any) -> None:
    """Refuses the launcher options that a batch job decides (its nodes, its tasks)."""
    if launcher.hostnames != "auto":
        raise UsageError(
            f"--hostnames {launcher.hostnames!r}: a submitted job runs on the nodes SLURM gives "
            "it; ask for them with --nodes (and --sbatch nodelist=... or constraint=...)"
        )
    if launcher.workers_per_host != "auto":
        raise UsageError(
            f"--workers-per-host {launcher.workers_per_host!r}: a submitted job's workers are "
            "its tasks; ask for them with --workers-per-node"
        )


def read_array_file(path: str) -> list[list[str]]:
    """The arguments of each element of ``--array FILE``: one line of FILE each.

    A line is split into words as a shell splits them (quotes; no expansion); ``#`` starts a
    comment, and lines left empty are skipped.

    Raises:
        UsageError: the file cannot be read, a line cannot be split, or no line is left.
    """
    try:
        with open(path, encoding="utf-8-sig") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else e
        raise UsageError(f"--array {path}: {reason}") from e
    elements = []
    for number, line in enumerate(lines, 1):
        try:
            words = shlex.split(line, comments=True)
        except ValueError as e:
            raise UsageError(f"--array {path}, line {number}: {e}: {line!r}") from e
        if words:
            elements.append(words)
    if not elements:
        raise UsageError(f"--array {path} has no line of arguments: there is nothing to submit")
    return elements


def _submit_job(
    args: argparse.Namespace, cmd: Any, launcher: Any, elements: list[list[str]] | None
) -> int:
    from slurmrun.batch import submit, submit_array  # noqa: PLC0415 - only this verb pays for it
    from slurmrun.cli.script import run_script  # noqa: PLC0415

    job = _job_options(args)
    target = ["-m", cmd.target] if cmd.module else [os.path.abspath(cmd.target)]
    kwargs = {"module": cmd.module}
    lines = [[*cmd.script_args, *more] for more in elements or [[]]]  # each element's argv
    calls = [(target[-1], argv) for argv in lines]
    common: dict[str, Any] = {"launcher": launcher, "folder": args.folder, "dry_run": cmd.dry_run}
    if elements is None:
        made = _submitted(lambda: submit(run_script, calls[0], kwargs, **common, **job))
    else:
        made = _submitted(
            lambda: submit_array(
                run_script, calls, kwargs, max_parallel=args.max_parallel, **common, **job
            )
        )
    if isinstance(made, int):
        return made
    if cmd.dry_run:
        print(f"{made}\n{_what_runs(launcher, target, lines, elements is not None)}")
        return 0
    kind = "module" if cmd.module else "script"
    jobs = made if elements is not None else [made]
    what = "job" if elements is None else "job array"
    _print_submitted(jobs, what, "" if elements is None else f" ({len(jobs)} elements)")
    for job_handle, argv in zip(jobs, lines, strict=True):
        meta = job_handle.files.meta()
        meta["function"] = shlex.join([kind, cmd.target, *argv])
        job_handle.files.write_meta(meta)
    return 0


def _submit_map(args: argparse.Namespace, cmd: Any, launcher: Any, sweep: Sweep) -> int:
    """``slurmrun submit --map``: one job whose batch step maps the script over the lines."""
    import functools  # noqa: PLC0415

    from slurmrun.batch import submit_map  # noqa: PLC0415 - only this verb pays for it
    from slurmrun.cli.script import run_item  # noqa: PLC0415

    target = cmd.target if cmd.module else os.path.abspath(cmd.target)
    own_group = launcher.backend is None  # the script makes its own: ended after each item
    func = functools.partial(run_item, target, cmd.script_args, cmd.module, own_group)
    made = _submitted(
        lambda: submit_map(
            func,
            [line.words for line in sweep.lines],
            workers_per_item=sweep.workers_per_item,
            retries=sweep.retries,
            item_timeout=sweep.item_timeout,
            launcher=launcher,
            folder=args.folder,
            dry_run=cmd.dry_run,
            **_job_options(args),
        )
    )
    if isinstance(made, int):
        return made
    words = ["-m", cmd.target] if cmd.module else [target]
    if cmd.dry_run:
        runs = [
            f"#   item {k}: {shlex.join([*words, *cmd.script_args, *line.words])}"
            for k, line in enumerate(sweep.lines)
        ]
        head = f"# The job's batch step maps {len(runs)} items on every slot of its nodes:"
        print("\n".join([str(made), head, *runs]))
        return 0
    _print_submitted([made], "job", f" (a map of {len(sweep.lines)} items)")
    meta = made.files.meta()
    kind = "module" if cmd.module else "script"
    meta["function"] = shlex.join(["map", args.map, kind, cmd.target, *cmd.script_args])
    made.files.write_meta(meta)
    return 0


def _submitted(make: Callable[[], T]) -> T | int:
    """What `make` submitted, or the command's exit status when it could not submit."""
    from submitit.core.utils import FailedJobError  # noqa: PLC0415

    from slurmrun.slurm.cluster import SlurmUnavailableError  # noqa: PLC0415

    try:
        return make()
    except (ValueError, TypeError) as e:
        return _submit_error(str(e))
    except SlurmUnavailableError as e:
        print(f"slurmrun submit: {e}", file=sys.stderr)
    except FailedJobError:  # submitit printed sbatch's message
        print("slurmrun submit: sbatch refused the job; nothing was submitted", file=sys.stderr)
    except OSError as e:
        print(f"slurmrun submit: {e}", file=sys.stderr)
    return 1


def _print_submitted(jobs: list[Any], what: str, more: str) -> None:
    """The job ids on stdout (first: they are submitted), then which cluster took them."""
    from slurmrun.slurm.cluster import placement  # noqa: PLC0415

    print("\n".join(job.job_id for job in jobs), flush=True)
    # Which cluster took it: SLURM's configuration here may name another one than meant.
    first = jobs[0].job_id.partition("_")[0]
    where = placement(first)
    print(f"submitted {what} {first}{more}" + (f" to {where}" if where else ""), file=sys.stderr)


def _job_options(args: argparse.Namespace) -> JobOptions:
    """What the job asks SLURM for (`slurmrun.submit`'s keywords) from the options."""
    params: dict[str, Any] = {"job_name": args.job_name}
    for name in ("partition", "account", "mem"):
        if getattr(args, name) is not None:
            params[name] = getattr(args, name)
    if args.sbatch:
        params["additional_parameters"] = dict(args.sbatch)
    return {
        "nodes": args.nodes,
        "gpus_per_node": args.gpus_per_node,
        "workers_per_node": args.workers_per_node,
        "cpus_per_worker": args.cpus_per_worker,
        "time_min": args.time,
        "slurm_parameters": params,
        "requeue": not args.no_requeue,
        "resources": args.resources,
    }


def _what_runs(launcher: Any, target: list[str], lines: list[list[str]], array: bool) -> str:
    """The dry run's last lines: the launch the job's batch step runs (each element's)."""
    import dataclasses  # noqa: PLC0415

    from slurmrun.launcher import Launcher  # noqa: PLC0415

    default = Launcher()
    changed = ", ".join(
        f"{f.name}={getattr(launcher, f.name)!r}"
        for f in dataclasses.fields(launcher)
        if getattr(launcher, f.name) != getattr(default, f.name)
    )
    head = f"# The job's batch step launches with slurmrun.Launcher({changed}); every worker runs:"
    if not array:
        return f"{head}\n#   {shlex.join([*target, *lines[0]])}"
    runs = [f"#   element {k}: {shlex.join([*target, *argv])}" for k, argv in enumerate(lines)]
    return "\n".join([head, *runs])
