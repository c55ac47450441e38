"""Requeueing a submitted job when SLURM signals it (time limit ahead, preemption).

SLURM sends the signal (``--signal=USR2@90``, ``scancel --signal=USR2 JOBID``) to the job's
steps, not to its batch step, where the launch runs: the agents' step (its workers get the
signal there, and may checkpoint) and a one-task *watch step* that the batch step starts
next to the agents, whose only job is to wait for that signal and exit. When it does, the
batch step gives the launch `Requeue.grace_seconds` to end (the workers checkpoint and
return), stops it if it has not, and runs ``scontrol requeue`` on its own job: SLURM puts
the job back in the queue (same job id) and runs the batch script again, which runs the
same launch again, with ``SLURMRUN_REQUEUE_COUNT`` one higher. (A job that SLURM preempts
with a GraceTime, SLURM 24.05+ requeues itself when its batch script ends: `requeue_this_job`
ends the script then.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType

from slurmrun.slurm.job_end import preemption, requeued_when_batch_ends

__all__ = [
    "REQUEUE_COUNT_VAR",
    "REQUEUE_FLAG_VAR",
    "Requeue",
    "RequeueLimitError",
    "RequeueWatch",
    "requeue_count",
    "requeue_requested",
]

REQUEUE_COUNT_VAR = "SLURMRUN_REQUEUE_COUNT"
"""How many times the job has been requeued before this run (0 on the first run)."""
REQUEUE_FLAG_VAR = "SLURMRUN_REQUEUE_FLAG"
"""A file that exists once this run of the job was asked to stop (see `requeue_requested`)."""
# Prints "signalled" on the signal; ends (status 0, so that srun prints nothing) then, or
# when its stdin (srun's, from the batch step) closes.
_WATCH = """\
import os, signal, sys, threading
s = getattr(signal, sys.argv[1])
signal.pthread_sigmask(signal.SIG_BLOCK, [s])
threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
print("ready", flush=True)
signal.sigwait([s])
print("signalled", flush=True)
os._exit(0)
"""
# The watch step's srun answers within a second or two; this bounds a wedged controller.
WATCH_READY_TIMEOUT = 30.0
# `scontrol requeue` ends this batch step (SIGTERM at once, SIGKILL after KillWait, 30 s by
# default); this bounds the wait for it.
REQUEUE_KILL_WAIT = 30.0


@dataclass(frozen=True)
class Requeue:
    """How a submitted job is requeued (``submit(..., requeue=Requeue(...))``).

    Attributes:
        signal: the signal SLURM sends: ``"USR2"`` (submitit's, the default) or ``"USR1"``
            (``SIG`` prefix accepted). Other signals would end the agents.
        signal_seconds: SLURM sends it this long before the time limit (``--signal``).
        max_requeues: requeue at most this many times; signalled once more, the job ends
            and `result()` raises `RequeueLimitError`.
        grace_seconds: how long the workers have, after the signal, to end by themselves
            (checkpoint and return) before the launch is stopped and the job requeued
            (default: ``signal_seconds - 30``, at least 10).
    """

    signal: str = "USR2"
    signal_seconds: int = 90
    max_requeues: int = 3
    grace_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.signal_name not in ("SIGUSR1", "SIGUSR2"):
            raise ValueError(f"Requeue.signal must be 'USR1' or 'USR2', got {self.signal!r}")
        for name in ("signal_seconds", "max_requeues"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Requeue.{name} must be an int >= 0, got {value!r}")
        if self.grace_seconds is not None and not self.grace_seconds >= 0:
            raise ValueError(f"Requeue.grace_seconds must be >= 0, got {self.grace_seconds!r}")

    @property
    def signal_name(self) -> str:
        """``SIGUSR1`` or ``SIGUSR2``."""
        return "SIG" + str(self.signal).upper().removeprefix("SIG")

    @property
    def grace(self) -> float:
        """`grace_seconds`, or its default."""
        if self.grace_seconds is not None:
            return float(self.grace_seconds)
        return float(max(10, self.signal_seconds - 30))

    def sbatch_signal(self) -> str:
        """The ``--signal`` value: ``USR2@90``."""
        return f"{self.signal_name.removeprefix('SIG')}@{self.signal_seconds}"


class RequeueLimitError(RuntimeError):
    """The job was signalled to stop once more after `Requeue.max_requeues` requeues."""


def requeue_count() -> int:
    """How many times this submitted job has been requeued before this run (0 at first).

    Read by workers from ``SLURMRUN_REQUEUE_COUNT`` (0 outside a submitted job).
    """
    try:
        return int(os.environ.get(REQUEUE_COUNT_VAR, "0"))
    except ValueError:
        return 0


def requeue_requested() -> bool:
    """Whether this run of a submitted job was signalled to stop (it will be requeued).

    A worker's function may poll it (e.g. once per step) to checkpoint and return; or it may
    install a handler for the signal (SIGUSR2) itself. False outside a submitted job.
    """
    flag = os.environ.get(REQUEUE_FLAG_VAR)
    return bool(flag) and os.path.exists(flag)  # type: ignore[arg-type]


class _Abandoned(BaseException):
    """Raised in the batch step's main thread when the grace after the signal is over."""


class RequeueWatch:
    """In the batch step, while the launch runs: notices the signal; then stops the launch.

    A context manager around ``launcher.run``: `requested` says afterwards whether the job
    was signalled, and a launch still running `grace` seconds after the signal is stopped
    (``_Abandoned`` is raised in the main thread, as Ctrl-C would be).
    """

    def __init__(self, policy: Requeue, flag: Path) -> None:
        self.policy = policy
        self.flag = flag
        self.signum = signal.Signals[policy.signal_name]
        self.requested = False
        self._proc: subprocess.Popen[str] | None = None
        self._stopping = False
        self._main = threading.main_thread().ident

    def __enter__(self) -> RequeueWatch:
        signal.signal(self.signum, self._on_signal)
        signal.signal(signal.SIGALRM, self._on_alarm)
        self._start_watch_step()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(self.signum, signal.SIG_IGN)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        self._stop_watch_step()
        return kind is _Abandoned

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            return
        self.requested = True
        with contextlib.suppress(OSError):
            self.flag.touch()
        grace = self.policy.grace
        print(
            f"slurmrun: {signal.Signals(signum).name}: this run will be requeued; the workers "
            f"have {grace:g} s to end",
            file=sys.stderr,
            flush=True,
        )
        signal.setitimer(signal.ITIMER_REAL, max(grace, 0.001))

    def _on_alarm(self, signum: int, frame: FrameType | None) -> None:
        raise _Abandoned

    def _start_watch_step(self) -> None:
        argv = [
            "srun",
            "--overlap",
            "--nodes=1",
            "--ntasks=1",
            "--job-name=slurmrun-signal-watch",
            "--quiet",
            sys.executable,
            "-S",
            "-c",
            _WATCH,
            self.policy.signal_name,
        ]
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        except OSError as e:
            print(f"slurmrun: no watch step ({e}): signals reach the launch only", file=sys.stderr)
            return
        self._proc = proc
        ready = threading.Event()
        threading.Thread(target=self._wait_watch_step, args=(proc, ready), daemon=True).start()
        if not ready.wait(WATCH_READY_TIMEOUT):
            print(
                f"slurmrun: the signal watch step was not ready within {WATCH_READY_TIMEOUT:g} s",
                file=sys.stderr,
                flush=True,
            )

    def _wait_watch_step(self, proc: subprocess.Popen[str], ready: threading.Event) -> None:
        assert proc.stdout is not None  # noqa: S101
        if proc.stdout.readline().strip() == "ready":
            ready.set()
        said = proc.stdout.read()
        proc.wait()
        ready.set()
        if "signalled" in said and not self._stopping and self._main is not None:
            signal.pthread_kill(self._main, self.signum)  # the handler runs in the main thread

    def _stop_watch_step(self) -> None:
        self._stopping = True
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(OSError):
            assert proc.stdin is not None  # noqa: S101
            proc.stdin.close()  # the task sees EOF and exits; srun with it
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)


def requeue_this_job(job_id: str) -> str:
    """Requeues this job, then ends this process; returns only on failure (why).

    ``scontrol requeue`` it; but where SLURM requeues the job itself once its batch script
    ends (a preemption's grace, SLURM 24.05+: `requeued_when_batch_ends`), end the batch
    script instead (``scancel --batch --signal=KILL``): SLURM would add its requeue to the
    asked one, and run the job a third time.
    """
    # The requeue ends the job's processes with SIGTERM, then SIGKILL after KillWait. This one
    # outlives the SIGTERM (SLURM signals it before the shell that waits for it): dying of it,
    # it let the batch script run its next command in this cut-short run (seen under load).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    preempted = preemption(job_id)
    if preempted is not None and requeued_when_batch_ends(preempted):
        argv = ["scancel", "--batch", "--signal=KILL", job_id]
        print(
            f"slurmrun: SLURM requeues job {job_id} once its batch script ends: ending it",
            file=sys.stderr,
            flush=True,
        )
    else:
        argv = ["scontrol", "requeue", job_id]
    try:
        done = subprocess.run(
            argv,
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{' '.join(argv)} failed: {e}"
    if done.returncode != 0:
        return f"{' '.join(argv)} failed: {done.stderr.strip() or done.returncode}"
    # Ended by SLURM's SIGKILL, or here once the shell that ran it is gone: an orphan is out of
    # SLURM's reach where it tracks processes by parentage (proctrack/linuxproc).
    deadline = time.monotonic() + REQUEUE_KILL_WAIT
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.05)
    # Not ended by SLURM: end without a result (submitit would record this run's as the job's).
    sys.stderr.flush()
    os._exit(1)
