"""Where a launch's log files go: ``<root>/<time>/``, with ``<root>/latest`` naming the newest.

The root is ``$SLURMRUN_LOG_DIR``, or ``./slurmrun_logs`` in the launcher's working directory.
The working directory stays the default because under SLURM every node writes its own files
there: a job's working directory is on a filesystem the nodes share, which ``$HOME`` or
``$XDG_STATE_HOME`` need not be. So that a source checkout does not fill up with untracked
files, a root that slurmrun creates gets a ``.gitignore`` holding ``*`` (as pytest, mypy and
ruff do with their caches). Nothing is ever deleted: a folder of a launch that is still
running cannot be told from an old one by every node, so pruning is left to the user
(docs/logs.md says how).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile
import uuid
from dataclasses import dataclass

from slurmrun.private import owner_name

__all__ = ["LATEST", "LOG_DIR_VAR", "LogDir", "LogDirError", "resolve_log_dir"]

LOG_DIR_VAR = "SLURMRUN_LOG_DIR"
LATEST = "latest"  # the link in the root to the newest launch's folder
GITIGNORE = "# Created by slurmrun: its logs are not source files.\n*\n"


class LogDirError(PermissionError):
    """The log directory cannot be created here (another user's ``slurmrun_logs``, say).

    Attributes:
        path: the directory that refused (the nearest existing one on the way).
        owner: its owner's uid.
    """

    def __init__(self, message: str, *, path: str, owner: int) -> None:
        super().__init__(message)
        self.path = path
        self.owner = owner

    def __str__(self) -> str:  # not OSError's "[Errno None] ..."
        return str(self.args[0])


@dataclass(frozen=True)
class LogDir:
    """The directory for one launch's log files.

    Attributes:
        path: the directory.
        keep: False when the user turned files off (``SLURMRUN_LOG_DIR=""``): then it is a
            private temporary directory, only for the agents' own start-up output, removed
            after the launch.
    """

    path: str
    keep: bool


def resolve_log_dir(environ: dict[str, str] | None = None, *, create: bool = True) -> LogDir:
    """Creates this launch's log directory, ``<$SLURMRUN_LOG_DIR or ./slurmrun_logs>/<time>``.

    It also points ``<root>/latest`` at it, and gives a root it creates a ``.gitignore``.
    With ``create=False`` (a dry run) nothing is created: the path is the one a launch now
    would create, and a private temporary directory is only named.

    Raises:
        LogDirError: it cannot be created for lack of permission (it says whose the directory
            is, and to set ``SLURMRUN_LOG_DIR``).
    """
    env = os.environ if environ is None else environ
    configured = env.get(LOG_DIR_VAR)
    if configured == "":
        if not create:
            return LogDir(os.path.join(tempfile.gettempdir(), "slurmrun-logs-*"), keep=False)
        return LogDir(tempfile.mkdtemp(prefix="slurmrun-logs-"), keep=False)
    root = configured if configured is not None else os.path.join(os.getcwd(), "slurmrun_logs")
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S-%f")
    path = os.path.join(root, stamp)  # one subdirectory per launch: launches never mix files
    if create:
        new_root = not os.path.isdir(root)
        try:
            os.makedirs(path, exist_ok=True)
        except PermissionError as e:
            raise _refused(path, configured is None) from e
        if new_root:
            _ignore_in_git(root)
        point_latest(root, stamp)
    return LogDir(os.path.abspath(path), keep=True)


def _refused(path: str, default_root: bool) -> LogDirError:
    """Why `path` cannot be made: the nearest existing directory on the way, and its owner."""
    refusing = os.path.abspath(path)
    while not os.path.lexists(refusing) and os.path.dirname(refusing) != refusing:
        refusing = os.path.dirname(refusing)
    try:
        st = os.stat(refusing)
    except OSError:
        owner = -1
        whose = "cannot be read"
    else:
        owner = st.st_uid
        whose = f"belongs to {owner_name(owner)} (mode {st.st_mode & 0o7777:o})"
        if owner != os.getuid():
            whose += f", not to you ({owner_name(os.getuid())})"
    where = "./slurmrun_logs, the default" if default_root else f"${LOG_DIR_VAR}"
    return LogDirError(
        f"cannot create the log folder {path} ({where}): {refusing} {whose}. Set {LOG_DIR_VAR} "
        f"to a folder of your own (e.g. {LOG_DIR_VAR}=~/slurmrun_logs; {LOG_DIR_VAR}= for no "
        "log files), or launch from a directory of yours",
        path=refusing,
        owner=owner,
    )


def point_latest(root: str, name: str) -> None:
    """Makes ``<root>/latest`` a link to ``<root>/<name>``, atomically, by a relative path.

    The link is made under a name of its own and renamed over the old one, so a reader never
    finds it missing, and concurrent launches leave it whole (naming one of them). A root
    where links cannot be made (some filesystems) just has none: it is a convenience.
    """
    temporary = os.path.join(root, f".{LATEST}.{uuid.uuid4().hex}")
    try:
        os.symlink(name, temporary)
        os.replace(temporary, os.path.join(root, LATEST))
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temporary)


def _ignore_in_git(root: str) -> None:
    with contextlib.suppress(OSError), open(os.path.join(root, ".gitignore"), "x") as f:
        f.write(GITIGNORE)
