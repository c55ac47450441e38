r"""Where agents' and workers' output goes: records, handlers, files and the live terminal view.

Agents turn what workers write (file descriptors 1 and 2, ``logging`` records, ``warnings``)
into plain records: JSON fields, never pickles. The launcher turns each record into a
`logging.LogRecord` with these extra attributes, and hands it to its handlers:

- ``hostname``, ``local_rank`` (None for the agent itself), ``rank`` (global, or None);
- ``stream``: ``"stdout"``, ``"stderr"`` or ``"logging"``;
- ``slurmrun_end``: what ended the text in the worker's output: ``"\\n"``, ``"\\r\\n"``, ``"\\r"``
  (a state of a line that the next one overwrites: a progress bar), or ``""`` (nothing: the
  stream ended there, or the line is not finished yet);
- ``slurmrun_partial``: True for the text so far of a line not finished yet (a prompt, a
  progress bar's current state), which only handlers with ``slurmrun_partial = True`` get
  (the live view); the finished record follows it. A stream's other records, joined with
  their ends, are the bytes the worker wrote.

The default handlers print agent 0 and worker rank 0 live, and a file per worker holds the
bytes it wrote. Where the agents see the launcher's log directory (srun and local agents),
each agent writes its own workers' files (`WorkerLog`) and sends the launcher only what it
shows: 32,768 workers' lines and files would otherwise all pass through one process. Agents
over ssh may not share the directory: their lines come to the launcher, which writes them
(`slurmrun.handlers`). Custom handlers get every record (`slurmrun.launcher.records`).

How output travels (pieces of lines, not whole lines again), how bytes that are not UTF-8
stay exact in files, and the bounds on a line's length: see `slurmrun.output`. A handler that
raises is reported once on stderr, and the run goes on: output must not cost a run its results.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import time
import urllib.parse
from collections.abc import Sequence

from slurmrun.log_dirs import LogDir, resolve_log_dir
from slurmrun.output import (
    LINE,
    MORE,
    LineAssembler,
    line_end,
    to_bytes,
)

__all__ = [
    "UNSHARED_LOG_DIR_ADVICE",
    "LineAssembler",
    "LogDir",
    "WorkerLog",
    "file_name",
    "host_labels",
    "log_level",
    "resolve_log_dir",
    "run_header",
    "tail_file",
]

LOG_LEVEL_VAR = "SLURMRUN_LOG_LEVEL"
# Read too: `FileEnds` looks at the last byte a former run wrote.
APPEND = os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
WRITER_CLOSE_TIMEOUT = 30.0  # what the end of a run waits for queued lines to reach the files


# ---------------------------------------------------------------------- files


def worker_log_path(log_dir: str, hostname: str, local_rank: int) -> str:
    """Where a worker's output goes: ``<dir>/<host>.<local rank>.log``.

    `hostname` may be a label of `host_labels` (``localhost#1``); characters that cannot
    be in a file name (``/``) are %-escaped (`file_name`).
    """
    return os.path.join(log_dir, f"{file_name(hostname)}.{local_rank}.log")


UNSHARED_LOG_DIR_ADVICE = (
    "agents' log files are written by each node, so SLURMRUN_LOG_DIR must be a directory on a "
    "filesystem that every node shares and can write (the default, ./slurmrun_logs, must then "
    "be too). Set SLURMRUN_LOG_DIR to such a directory, or SLURMRUN_LOG_DIR='' to write no log "
    "files on the nodes."
)
"""What a launch whose nodes cannot use its log directory says to do."""


def agent_log_path(log_dir: str, hostname: str) -> str:
    """Where an agent's own output goes: ``<dir>/<host>.agent.log``."""
    return os.path.join(log_dir, f"{file_name(hostname)}.agent.log")


def file_name(hostname: str) -> str:
    """`hostname` as (part of) one file's name: readable, with ``/`` and the like %-escaped.

    Example:
        >>> file_name("node-1.cluster"), file_name("rack/3"), file_name("localhost#1")
        ('node-1.cluster', 'rack%2F3', 'localhost#1')
    """
    return urllib.parse.quote(hostname, safe="#@+,=:~") or "%"


def host_labels(hostnames: Sequence[str]) -> list[str]:
    """Each node's name in records, live prefixes and log file names, by node rank.

    A host's own name, except for its later entries when it appears more than once: those
    are ``<host>#<node rank>``, so that every rank has a prefix and a file of its own.

    Example:
        >>> host_labels(["localhost", "node2", "localhost"])
        ['localhost', 'node2', 'localhost#2']
    """
    seen: set[str] = set()
    labels = []
    for node_rank, host in enumerate(hostnames):
        labels.append(f"{host}#{node_rank}" if host in seen else host)
        seen.add(host)
    return labels


def log_level(environ: dict[str, str] | None = None) -> int:
    """The level from ``SLURMRUN_LOG_LEVEL`` (a name like ``DEBUG`` or a number; INFO if unset)."""
    env = os.environ if environ is None else environ
    value = env.get(LOG_LEVEL_VAR, "INFO").strip().upper() or "INFO"
    if value.isdigit():
        return int(value)
    level = logging.getLevelName(value)
    if not isinstance(level, int):
        raise ValueError(  # noqa: TRY004 - a bad value of a variable, not a bad type
            f"{LOG_LEVEL_VAR}={value!r} is not a logging level: use DEBUG, INFO, WARNING, "
            "ERROR, CRITICAL or a number"
        )
    return level


def tail_file(path: str | None, lines: int = 20, max_bytes: int = 16384) -> str:
    r"""The last `lines` lines of a text file ('' if it cannot be read), as a terminal shows them.

    Of a line rewritten by ``\r`` (a progress bar's states), its last state. In a worker's
    file, only the lines after the last run's header (`run_header`).
    """
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            data = f.read()
    except OSError:
        return ""
    shown = data.decode(errors="replace").split("\n")
    if shown[-1] == "":
        shown.pop()
    headers = [i for i, line in enumerate(shown) if RUN_HEADER.fullmatch(line)]
    if headers:  # a warm launcher's file: the last run's lines only
        shown = shown[headers[-1] + 1 :]
    return "\n".join(line.rstrip("\r").rsplit("\r", 1)[-1] for line in shown[-lines:])


def run_header(run: int, title: str, when: float | None = None) -> bytes:
    """The line that starts a run's part of each worker's file (a warm launcher's runs append).

    `run`: the run's number in the launch; `title`: what it runs (``func train``); `when`: the
    time (now if None), in the local time zone. Example:
    ``=== slurmrun run 3, 2026-11-27 14:50:02, func train ===``.
    """
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))
    what = f", {' '.join(title.split())}" if title else ""  # one line, whatever the name holds
    return to_bytes(f"=== slurmrun run {run}, {stamp}{what} ===\n")


RUN_HEADER = re.compile(r"=== slurmrun run \d+, [^\n]* ===")  # a line of `run_header`


def file_bytes(stream: str, levelname: str, name: str, msg: str, end: str) -> bytes:
    """A record as a log file holds it (`end`: what ended it in the output, see `line_end`).

    Output as the worker wrote it; a logging record on a line of its own, prefixed with its
    level and logger.
    """
    if stream == "logging":
        return to_bytes(f"{levelname}:{name}: {msg}\n")
    return to_bytes(msg + end)


class FileEnds:
    """Whether a log file's last line was left without an end: what comes next starts a new one.

    A stream's last line may have no end (`slurmrun.output.EOF`); what is written after it
    (the other stream's last line, the next run's output) starts on a line of its own. Nothing
    else is added: the file holds the worker's bytes.
    """

    def __init__(self) -> None:
        self.open = False

    def opened(self, fd: int) -> None:
        """Looks at the file's last byte: a former run's stream ended there, without a line end."""
        try:
            size = os.fstat(fd).st_size
            self.open = size > 0 and os.pread(fd, 1, size - 1) not in (b"\n", b"\r")
        except OSError:
            self.open = False

    def before(self, data: bytes, end: str) -> bytes:
        """`data`, which `end` ended, on a new line if the file's last line has no end."""
        if not data:
            return data
        data = b"\n" + data if self.open else data
        self.open = end == ""
        return data


# ---------------------------------------------------------------------- agent side


class WorkerLog:
    """One worker's log file, ``<dir>/<host>.<local rank>.log``, written by its agent.

    It holds what the launcher's files would: the worker's bytes (each finished piece with
    its end, progress states too: ``cat`` shows a bar's final state), logging records on lines
    of their own prefixed with their level and logger, and only records at the launch's log
    level or above (stdout and stderr count as INFO). Each piece is one ``write`` of an
    ``O_APPEND`` descriptor, so stdout, stderr and logging records, written from different
    threads, never interleave within a line. A file that cannot be written is reported once
    on the agent's stderr (its own log) and then left alone: output must not fail a run.
    """

    def __init__(self, log_dir: str, hostname: str, local_rank: int, level: int) -> None:
        self.path = worker_log_path(log_dir, hostname, local_rank)
        self.level = level
        self._fd: int | None = None
        self._failed = False
        self._closed = False  # the run is over: a late write is dropped, not reopened
        self._lock = threading.Lock()
        self._ends = FileEnds()

    def begin(self, header: bytes) -> None:
        """Starts the run's part of the file with `header` (`run_header`), creating the file.

        Called when the worker starts (or a kept one takes the next run), so that every worker
        has its file even if it never prints. Written at any level.
        """
        if not self._failed:
            self._append(header, LINE)

    def write(self, stream: str, level: int, name: str, msg: str, end: str = LINE) -> None:
        """Appends one finished record: `msg` and what ended it (`slurmrun.output`'s ends).

        Dropped below the level. A partial record (end `MORE`) is never written.
        """
        if end == MORE or level < self.level or self._failed:
            return
        ended = line_end(end) if stream != "logging" else LINE
        self._append(file_bytes(stream, logging.getLevelName(level), name, msg, ended), ended)

    def write_lines(self, texts: Sequence[str]) -> None:
        """Appends whole lines of the worker's stdout or stderr (INFO), each ended by a newline."""
        if texts and self.level <= logging.INFO and not self._failed:
            self._append(to_bytes("\n".join(texts) + "\n"), LINE)

    def _append(self, data: bytes, ended: str) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                if self._fd is None:
                    self._fd = os.open(self.path, APPEND, 0o644)
                    self._ends.opened(self._fd)
                data = self._ends.before(data, ended)
                while data:
                    data = data[os.write(self._fd, data) :]
            except OSError as e:
                self._failed = True
                print(f"slurmrun: cannot write a worker's log: {e}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Closes the file for good (other nodes see its lines once it is closed: NFS's rule)."""
        with self._lock:
            self._closed = True
            if self._fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._fd)
                self._fd = None
