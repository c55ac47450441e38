"""Where agents' and workers' output goes."""

from __future__ import annotations

import datetime
import os
import tempfile
from dataclasses import dataclass

__all__ = ["LogDir", "resolve_log_dir"]

LOG_DIR_VAR = "SLURMRUN_LOG_DIR"


@dataclass(frozen=True)
class LogDir:
    """The directory for one launch's log files.

    Attributes:
        path: the directory.
        keep: False when the user turned files off (``SLURMRUN_LOG_DIR=""``): the launcher then
            uses a private temporary directory (for error messages only) and removes it.
        shared: whether agents on other nodes may write here (True unless it is a private
            temporary directory on the launcher's machine).
    """

    path: str
    keep: bool
    shared: bool


def resolve_log_dir(environ: dict[str, str] | None = None) -> LogDir:
    """Creates this launch's log directory, ``<$SLURMRUN_LOG_DIR or ./slurmrun_logs>/<time>``."""
    env = os.environ if environ is None else environ
    configured = env.get(LOG_DIR_VAR)
    if configured == "":
        return LogDir(tempfile.mkdtemp(prefix="slurmrun-logs-"), keep=False, shared=False)
    base = configured if configured is not None else os.path.join(os.getcwd(), "slurmrun_logs")
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S-%f")
    path = os.path.join(base, stamp)  # one subdirectory per launch: launches never mix files
    os.makedirs(path, exist_ok=True)
    return LogDir(os.path.abspath(path), keep=True, shared=True)
