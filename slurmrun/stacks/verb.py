"""``slurmrun stacks [JOB_ID] [--pid PID | --all] [--timeout SECONDS]``: every rank's stacks.

Asks a running launcher of this user through its control socket (`slurmrun.stacks.control`) and
prints its answer. Without JOB_ID it asks the launchers running on this host that were
started from this working directory or this terminal (and says how many others run; ``--all``
asks them too); with JOB_ID, that job's launcher: here if it runs here, else on the job's
batch host, through ``srun --jobid=JOB_ID --overlap`` (a step beside the job's own, whatever
they hold).

Exit status: 0; 1 when no launcher answered (none runs, the job is unknown or not running);
2 for bad options; the remote command's status for a job on another host.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import re
import signal
import socket
import subprocess
import sys

from slurmrun.stacks.control import MAX_WAIT, ControlError, LauncherEntry, ask, launchers
from slurmrun.stacks.control_dir import working_dir

__all__ = ["DEFAULT_TIMEOUT", "main"]

DEFAULT_TIMEOUT = 30.0
ASK_MARGIN = 5.0  # over the launcher's own timeout, so that its answer (even partial) comes
SRUN_MARGIN = 30.0  # for srun to create the step and start Python on the batch host
_JOB_ID = re.compile(r"\d+(_\d+)?(\+\d+)?")


class _Failed(Exception):
    """Ends the command with ``slurmrun stacks: error: <message>`` and status 1."""


def _seconds(text: str) -> float:
    """A timeout the launcher waits for (NaN, inf and the like are refused before asking)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_WAIT:
        raise argparse.ArgumentTypeError(
            f"expected a number of seconds > 0 and at most {MAX_WAIT:g}, got {text!r}"
        )
    return value


def _job_id(text: str) -> str:
    if not _JOB_ID.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected a SLURM job id (such as 1234), got {text!r}")
    return text


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slurmrun stacks",
        description="Print the Python stacks of every rank of a running slurmrun launch of yours.",
    )
    parser.add_argument(
        "job_id",
        nargs="?",
        type=_job_id,
        metavar="JOB_ID",
        help="a SLURM job whose launch to ask (default: the launches running on this host)",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--pid", type=int, help="the launcher's process id, where several run")
    which.add_argument(
        "--all",
        action="store_true",
        help="ask every launch of yours on this host (default: those started from this "
        "directory or this terminal)",
    )
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"how long the ranks have to answer (default: {DEFAULT_TIMEOUT:g}, at most "
        f"{MAX_WAIT:g})",
    )
    # Run by the srun of JOB_ID on its batch host: look there only, never srun again.
    parser.add_argument("--here", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str]) -> int:
    """Runs ``slurmrun stacks`` with `argv` (the words after ``stacks``); returns the status."""
    args = _parser().parse_args(argv)  # exits with 2 on bad options
    try:
        return _stacks(args)
    except (_Failed, ControlError) as e:
        print(f"slurmrun stacks: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _stacks(args: argparse.Namespace) -> int:
    found = launchers(args.job_id)
    if found or args.job_id is None or args.here:
        return _ask_all(_select(found, args), args.timeout)
    return _ask_on_batch_host(args)


def _select(found: list[LauncherEntry], args: argparse.Namespace) -> list[LauncherEntry]:
    here = socket.gethostname()
    if not found:
        if args.job_id is not None:
            raise _Failed(
                f"no slurmrun launch of job {args.job_id} runs on {here} (a launch started in "
                "an salloc shell runs where salloc runs: ask there)"
            )
        raise _Failed(
            f"no slurmrun launch of yours runs on this host ({here}); for a submitted job, "
            "pass its id: slurmrun stacks JOB_ID"
        )
    if args.pid is not None:
        chosen = [e for e in found if e.pid == args.pid]
        if not chosen:
            running = ", ".join(f"{e.pid} ({e.what})" for e in found)
            raise _Failed(
                f"no slurmrun launch of yours has pid {args.pid} on {here}: {running} run"
            )
        return chosen
    if args.all or args.job_id is not None:
        return found
    return _started_here(found, here)


def _started_here(found: list[LauncherEntry], here: str) -> list[LauncherEntry]:
    """The launches started from this directory or terminal; says how many others run.

    Another project's (or another test session's) launch is not asked unasked: its stacks
    are not ours to read, and its report would be written into its log directory.
    """
    mine = [e for e in found if e.started_here()]
    others = len(found) - len(mine)
    plural = others > 1
    if not mine:
        listing = ", ".join(f"{e.pid} ({e.what}, in {e.cwd or '?'})" for e in found)
        raise _Failed(
            f"no slurmrun launch of yours on this host ({here}) was started from "
            f"{working_dir() or 'this directory'} or this terminal; {others} "
            f"other{'s run' if plural else ' runs'}: {listing}. --pid PID asks one, --all every one"
        )
    if others:
        print(
            f"slurmrun stacks: {others} other {'launches' if plural else 'launch'} of yours "
            f"{'run' if plural else 'runs'} on this host, started from another directory and "
            f"terminal: slurmrun stacks --all asks {'them' if plural else 'it'} too",
            file=sys.stderr,
            flush=True,
        )
    return mine


def _ask_all(entries: list[LauncherEntry], timeout: float) -> int:
    """Prints each launcher's stacks (under a line naming it where several); returns the status."""
    status = 0
    for entry in entries:
        if len(entries) > 1:
            started = datetime.datetime.fromtimestamp(entry.started).strftime("%Y-%m-%d %H:%M:%S")
            print(f"=== launcher pid {entry.pid}: {entry.what}, started {started}", flush=True)
        try:
            text = ask(entry, "stacks", {"timeout": timeout}, timeout=timeout + ASK_MARGIN)
        except ControlError as e:
            print(f"slurmrun stacks: error: {e}", file=sys.stderr, flush=True)
            status = 1
            continue
        print(text.rstrip("\n"), flush=True)
    return status


def _ask_on_batch_host(args: argparse.Namespace) -> int:
    """Runs ``slurmrun stacks JOB_ID --here`` on the job's batch host; returns its status."""
    from slurmrun.slurm.fields import first_record  # noqa: PLC0415
    from slurmrun.slurm.scontrol import scontrol  # noqa: PLC0415

    job = args.job_id
    text = scontrol(["show", "job", job])
    if text is None:
        raise _Failed(
            f"SLURM does not know job {job} (scontrol show job {job} failed); squeue --me lists "
            "your jobs"
        )
    fields = first_record(text).fields
    state, host = fields.get("JobState", "?"), fields.get("BatchHost", "")
    if state != "RUNNING":
        raise _Failed(f"job {job} is {state}, not RUNNING: no launcher of it runs")
    uid = re.search(r"\((\d+)\)", fields.get("UserId", ""))
    if uid is not None and int(uid.group(1)) != os.getuid():
        raise _Failed(f"job {job} is not yours (UserId={fields['UserId']})")
    if not host or host == "(null)":
        raise _Failed(f"job {job} has no batch host (scontrol show job {job}: BatchHost)")
    job_id = fields.get("JobId", job)  # 1234 for the array task 1200_34
    argv = [
        "srun",
        f"--jobid={job_id}",
        "--overlap",  # beside the job's steps, sharing what they hold (CPUs, memory, GPUs)
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={host}",
        "--job-name=slurmrun-stacks",
        "--quiet",
        sys.executable,
        "-m",
        "slurmrun",
        "stacks",
        job_id,
        "--here",
        f"--timeout={args.timeout:g}",
        *([f"--pid={args.pid}"] if args.pid is not None else []),
    ]
    return _run_srun(argv, args.timeout + ASK_MARGIN + SRUN_MARGIN)


def _run_srun(argv: list[str], timeout: float) -> int:
    # The variables of a job this runs in (salloc shell) would be srun's defaults for the other.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}
    if "SLURM_CONF" in os.environ:
        env["SLURM_CONF"] = os.environ["SLURM_CONF"]
    try:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)
    except OSError as e:
        raise _Failed(
            f"cannot run srun ({e}): run slurmrun stacks JOB_ID where SLURM's commands are"
        ) from e
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # srun ends its step
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        raise _Failed(f"no answer from job {argv[1].split('=')[1]} within {timeout:g} s") from None
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=5)
        raise
