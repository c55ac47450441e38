"""Where running launchers register for their control channel (`slurmrun.stacks.control`).

`runtime_dir` is a directory of this user's that only they can enter; a launcher's server
writes a `LauncherEntry` there (``<host>-<pid>.json``) beside its socket, and `launchers`
reads them back: the running launchers of this user on this host.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import stat
from pathlib import Path

from slurmrun.private import problem

__all__ = [
    "FALLBACK_ROOT",
    "ControlError",
    "LauncherEntry",
    "answers",
    "launchers",
    "runtime_dir",
    "terminal_session",
    "working_dir",
]

MAX_ENTRY = 64 * 1024  # a <pid>.json larger than this is not ours
# Literal /tmp, not $TMPDIR: a job's steps may each get their own TMPDIR, and the `srun` of
# `slurmrun stacks JOB_ID` must look where the job's launcher wrote.
FALLBACK_ROOT = Path("/tmp")  # noqa: S108 - private per-user directory, checked below


class ControlError(RuntimeError):
    """A launcher's control channel cannot be used (or answered with an error)."""


@dataclasses.dataclass(frozen=True)
class LauncherEntry:
    """A running launcher, as its ``<pid>.json`` in `runtime_dir` describes it."""

    pid: int
    host: str
    job_id: str  # its SLURM_JOB_ID; "" outside a job
    started: float  # time.time() when it started its server
    what: str  # what it runs: "train.py", "my_func"
    socket: Path
    cwd: str = ""  # its working directory when it started its server ("": unknown)
    session: int = 0  # its terminal's session id (0: it has no terminal)

    def started_here(self) -> bool:
        """Whether it was started from this process's working directory or terminal session."""
        if self.session and self.session == terminal_session():
            return True
        return bool(self.cwd) and self.cwd == working_dir()


def terminal_session() -> int:
    """This process's session id where it has a controlling terminal; 0 where it has none.

    Two commands typed in one terminal share it (a shell puts each job in a process group
    of its own, not in a session of its own); batch jobs, cron and daemons have no terminal.
    """
    try:
        with open("/proc/self/stat", "rb") as f:
            # pid (comm) state ppid pgrp session tty_nr ...; comm may hold spaces and ")"
            fields = f.read().rsplit(b")", 1)[1].split()
        session, tty = int(fields[3]), int(fields[4])
    except (OSError, IndexError, ValueError):
        return 0
    return session if tty else 0


def working_dir() -> str:
    """This process's working directory ("" where it was removed)."""
    try:
        return os.getcwd()
    except OSError:  # removed meanwhile
        return ""


def runtime_dir(create: bool = True) -> Path:
    """The private per-user directory of running launchers.

    ``$XDG_RUNTIME_DIR/slurmrun`` when ``XDG_RUNTIME_DIR`` is set, is a directory, is ours and
    only we can write to it (as the XDG spec asks: else another user could swap what is in it);
    else ``/tmp/slurmrun-<uid>``.

    Args:
        create: create it (mode 0700) when missing; False returns its path all the same.

    Raises:
        ControlError: it exists but is not a directory of ours that only we can enter (a
            symlink in its place included): it is never used, and the message says what to do.
    """
    path = _preferred_dir()
    if create:
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700)
    _check_private(path)
    return path


def _preferred_dir() -> Path:
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isabs(xdg):
        try:
            st = os.stat(xdg)
        except OSError:
            st = None
        if (
            st is not None
            and stat.S_ISDIR(st.st_mode)
            and st.st_uid == os.getuid()
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        ):
            return Path(xdg) / "slurmrun"
    return FALLBACK_ROOT / f"slurmrun-{os.getuid()}"


def _check_private(path: Path) -> None:
    """Raises ControlError unless `path` is missing or a directory of ours, mode 0700 or less."""
    why = problem(path, others_may_read=False)
    if why is None:
        return
    fix = f"remove it (rm -r {path}) and slurmrun creates it anew, only for you"
    if why.kind == "owner":
        fix = f"ask its owner or an admin to {fix}"
    elif why.kind == "mode":
        fix = f"`chmod 700 {path}` or {fix}"
    raise ControlError(f"{why}: slurmrun does not use it; {fix}")


def _search_dirs() -> list[Path]:
    """Where launchers may be: `runtime_dir`, then the other candidates that are private.

    A launcher and ``slurmrun stacks`` may disagree on XDG_RUNTIME_DIR: srun and sbatch pass
    on the login side's, which may not exist on the node; an ssh session there has its own.
    """
    dirs = [runtime_dir(create=False)]
    uid = os.getuid()
    for other in (Path(f"/run/user/{uid}/slurmrun"), FALLBACK_ROOT / f"slurmrun-{uid}"):
        if other not in dirs:
            with contextlib.suppress(ControlError):
                _check_private(other)
                dirs.append(other)
    return [d for d in dirs if d.is_dir()]


def launchers(job_id: str | None = None) -> list[LauncherEntry]:
    """Running launchers of this user on this host, newest first.

    Entries of this host whose process ended, and their sockets, are removed unless a process
    still listens there (one of another pid namespace); entries of other hosts (a shared /tmp)
    are left alone.

    Args:
        job_id: only the launchers of this SLURM job (their SLURM_JOB_ID).

    Raises:
        ControlError: the runtime directory is not private (`runtime_dir`).
    """
    host = socket.gethostname()
    found = []
    for directory in _search_dirs():
        for path in directory.glob("*.json"):
            entry = _read_entry(path)
            if entry is None or entry.host != host:
                continue
            if not _alive(entry.pid):
                if not answers(entry.socket):  # (a live one is another pid namespace's)
                    for stale in (path, entry.socket):
                        with contextlib.suppress(OSError):
                            stale.unlink()
                continue
            if job_id is None or entry.job_id == job_id:
                found.append(entry)
    return sorted(found, key=lambda e: e.started, reverse=True)


def _read_entry(path: Path) -> LauncherEntry | None:
    """The entry `path` describes, or None when it is not one (too large, garbled)."""
    try:
        with path.open("rb") as f:
            data = json.loads(f.read(MAX_ENTRY))
        return LauncherEntry(
            pid=int(data["pid"]),
            host=str(data["host"]),
            job_id=str(data["job_id"]),
            started=float(data["started"]),
            what=str(data["what"]),
            socket=path.with_suffix(".sock"),  # not the file's word: next to it, in our dir
            cwd=str(data.get("cwd", "")),
            session=int(data.get("session", 0)),
        )
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process took the pid: alive, not ours
        return True
    return True


def answers(path: Path) -> bool:
    """Whether a process listens on the Unix socket `path` (a full backlog counts as one)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError):
            return False
        except OSError as e:
            # No errno: the path is too long for a socket (none can be there). Else timed
            # out (backlog full), or not ours to reach: someone's, alive.
            return e.errno is not None
    return True
