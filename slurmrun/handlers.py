"""The launcher's handlers: the live terminal view, files, and the filters that pick records.

`stream_handler` and `file_handler` are the public ones (with `add_filter_to_handler`, for any
handler of yours); `default_handlers` are what a launch uses when given none: agent 0 and
the ranks of `Options.show_ranks` (rank 0) live in the terminal, and, where the agents do not
write them (agents over ssh), a file per worker (`_WorkerFiles`). What a record carries:
`slurmrun.logs`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
from collections.abc import Collection, Iterable, Sequence
from typing import IO, Literal

from slurmrun.logs import APPEND, WRITER_CLOSE_TIMEOUT, FileEnds, file_bytes, worker_log_path
from slurmrun.output import LINE, report_handler_error
from slurmrun.terminal import TerminalHandler

__all__ = [
    "SourceFilter",
    "add_filter_to_handler",
    "begin_files",
    "default_handlers",
    "file_handler",
    "stream_handler",
]

WRITER_QUEUE = 16384  # records waiting for the files' writer (`_WorkerFiles`)


def _matches(record: logging.LogRecord, hostname: str | None, local_rank: int | None) -> bool:
    if hostname is not None and getattr(record, "hostname", None) != hostname:
        return False
    return local_rank is None or getattr(record, "local_rank", None) == local_rank


class SourceFilter(logging.Filter):
    """Takes the records of one host and local rank (`add_filter_to_handler`).

    It looks only at where a record comes from, never at its text: every line of one read of
    a worker's pipe passes it or none does (`slurmrun.launcher.records` asks it once for all).
    """

    def __init__(self, hostname: str | None, local_rank: int | None) -> None:
        super().__init__()
        self.hostname = hostname
        self.local_rank = local_rank

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether `record` comes from this filter's host and rank (-1: the agent alone)."""
        if self.local_rank == -1:
            agent = getattr(record, "local_rank", 0) is None
            return agent and _matches(record, self.hostname, None)
        return _matches(record, self.hostname, self.local_rank)


class _RankFilter(SourceFilter):
    """Takes the records of some global ranks (None: every rank), and none of the agents'."""

    def __init__(self, ranks: frozenset[int] | None) -> None:
        super().__init__(None, None)
        self.ranks = ranks

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether `record` comes from a worker whose global rank is shown."""
        rank = getattr(record, "rank", None)
        return rank is not None and (self.ranks is None or rank in self.ranks)


def add_filter_to_handler(
    handler: logging.Handler,
    hostname: str | None = None,
    local_rank: int | None = None,
    log_level: int = logging.NOTSET,
) -> logging.Handler:
    """Makes `handler` take only records of `hostname` / `local_rank` at `log_level` or above.

    Args:
        handler: any `logging.Handler`.
        hostname: only this host (None: every host).
        local_rank: only this local rank (None: every rank and the agent; use -1 for the
            agent alone).
        log_level: the handler's level.

    Returns:
        `handler`, for chaining.
    """
    handler.setLevel(log_level)
    handler.addFilter(SourceFilter(hostname, local_rank))
    return handler


def _file_bytes(record: logging.LogRecord) -> tuple[bytes, str]:
    """What a file holds of `record` (`slurmrun.logs.file_bytes`), and what ended it."""
    ended = str(getattr(record, "slurmrun_end", LINE))
    stream = str(getattr(record, "stream", ""))
    return file_bytes(stream, record.levelname, record.name, record.getMessage(), ended), ended


class _FileHandler(logging.Handler):
    """Appends records to a file: the bytes the worker wrote (see `slurmrun.output`)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self._file: IO[bytes] | None = None
        self._ends = FileEnds()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if self._file is None:
                self._file = open(self.path, "a+b")  # noqa: SIM115 - closed in close()
                self._ends.opened(self._file.fileno())
            data, ended = _file_bytes(record)
            self._file.write(self._ends.before(data, ended))
            self._file.flush()
        except Exception:
            self.handleError(record)

    def handleError(self, record: logging.LogRecord) -> None:
        report_handler_error(self, record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        super().close()


def stream_handler(
    hostname: str | None = None,
    local_rank: int | None = None,
    log_level: int = logging.NOTSET,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> logging.Handler:
    r"""A handler that prints records live with a ``[host:rank]`` prefix.

    Workers' stdout goes to the launcher's stdout, everything else to its stderr; progress
    bars (``\\r``-rewritten lines) update in place.

    Args:
        hostname: only this host (None: all).
        local_rank: only this local rank (None: all; -1: the agent alone).
        log_level: minimum level.
        stdout: where stdout records go (default: ``sys.stdout`` at the time of writing).
        stderr: where the others go (default: ``sys.stderr`` at the time of writing).
    """
    return add_filter_to_handler(TerminalHandler(stdout, stderr), hostname, local_rank, log_level)


def file_handler(
    path: str,
    hostname: str | None = None,
    local_rank: int | None = None,
    log_level: int = logging.NOTSET,
) -> logging.Handler:
    """A handler that appends what matching records hold to `path`: the workers' bytes.

    Raises:
        ValueError: `path` cannot be written (its directory is missing or not writable, or it
            is a directory): said now, before a launch starts, not after the work ran.

    Example:
        One file per rank of node1::

            handlers = [slurmrun.file_handler(f"logs/node1.{i}.log", "node1", i) for i in range(8)]
    """
    _check_writable(path)
    return add_filter_to_handler(_FileHandler(path), hostname, local_rank, log_level)


def _check_writable(path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ValueError(
            f"file_handler({path!r}): the directory {directory} does not exist: create it "
            "first (os.makedirs), or name a file in an existing directory"
        )
    if os.path.isdir(path):
        raise ValueError(f"file_handler({path!r}): {path} is a directory: name a file")
    exists = os.path.exists(path)
    if not os.access(path if exists else directory, os.W_OK):
        what = f"the file {path}" if exists else f"the directory {directory}"
        raise ValueError(
            f"file_handler({path!r}): {what} is not writable: change its permissions, or "
            "name a file where you can write"
        )


class _WorkerFiles(logging.Handler):
    """One file per worker, ``<dir>/<host>.<local rank>.log``, written by a thread of its own.

    `emit` only formats the line and queues it: opening thousands of files and writing every
    line there would hold back the terminal's lines, and more so on a slow shared filesystem.
    The writer takes whatever is queued and appends each worker's lines with one write; `close`
    waits for it, bounded. The queue holds at most `WRITER_QUEUE` records: a filesystem slower
    than the workers makes `emit` wait (and so, through the launcher's credit, the workers).
    """

    def __init__(self, log_dir: str) -> None:
        super().__init__()
        self.log_dir = log_dir
        # (host, local rank), a record's bytes, what ended it
        self._queue: queue.Queue[tuple[tuple[str, int], bytes, str] | None] = queue.Queue(
            WRITER_QUEUE
        )
        self._writer: threading.Thread | None = None
        self._ends: dict[tuple[str, int], FileEnds] = {}
        self.lines_written = 0

    def emit(self, record: logging.LogRecord) -> None:
        local_rank = getattr(record, "local_rank", None)
        if local_rank is None:
            return  # agents' own output is in <host>.agent.log
        text, ended = _file_bytes(record)
        self._queue_item(((str(getattr(record, "hostname", "")), int(local_rank)), text, ended))

    def _queue_item(self, item: tuple[tuple[str, int], bytes, str]) -> None:
        if self._writer is None:
            self._writer = threading.Thread(
                target=self._write_loop, name="slurmrun-log-writer", daemon=True
            )
            self._writer.start()
        self._put(item)

    def _put(self, item: tuple[tuple[str, int], bytes, str] | None) -> None:
        """Queues `item`, waiting while the queue is full and the writer is alive."""
        while True:
            try:
                self._queue.put(item, timeout=1.0)
            except queue.Full:
                if self._writer is None or not self._writer.is_alive():
                    raise OSError("the log files' writer is gone") from None
            else:
                return

    def _write_loop(self) -> None:
        failed: set[tuple[str, int]] = set()
        while True:
            item = self._queue.get()
            batch: dict[tuple[str, int], list[tuple[bytes, str]]] = {}
            while item is not None:
                batch.setdefault(item[0], []).append(item[1:])
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            for key, lines in batch.items():
                if key not in failed and not self._append(key, lines):
                    failed.add(key)
            if item is None:
                return

    def _append(self, key: tuple[str, int], pieces: list[tuple[bytes, str]]) -> bool:
        # Opened per batch, not kept: 32,768 workers must not hold 32,768 descriptors, and
        # one line per worker is the common case.
        try:
            fd = os.open(worker_log_path(self.log_dir, *key), APPEND, 0o644)
            try:
                ends = self._ends.get(key)
                if ends is None:
                    ends = self._ends[key] = FileEnds()
                    ends.opened(fd)
                data = b"".join(ends.before(piece, ended) for piece, ended in pieces)
                while data:
                    data = data[os.write(fd, data) :]
            finally:
                os.close(fd)
        except OSError as e:
            print(f"slurmrun: cannot write a worker's log: {e}", file=sys.stderr)
            return False
        self.lines_written += len(pieces)
        return True

    def begin(self, workers: Iterable[tuple[str, int]], header: bytes) -> None:
        """Starts each of `workers`' files (host label, local rank) with the run's `header`.

        So every worker has its file even if it never prints, and a warm launcher's runs are
        told apart (`slurmrun.logs.run_header`).
        """
        for key in workers:
            self._queue_item((key, header, LINE))

    def close(self) -> None:
        """Writes what is queued and stops the writer (waits at most `WRITER_CLOSE_TIMEOUT`)."""
        if self._writer is not None:
            with contextlib.suppress(OSError):  # (gone: there is nothing to wait for)
                self._put(None)
            self._writer.join(timeout=WRITER_CLOSE_TIMEOUT)
            self._writer = None
        super().close()


def begin_files(
    handlers: Iterable[logging.Handler],
    labels: Sequence[str],
    counts: Sequence[int],
    header: bytes,
) -> None:
    """Starts every worker's file that `handlers` write (the default ones) with `header`.

    Args:
        handlers: a run's handlers; those that write a file per worker start them.
        labels: each node's label (`slurmrun.logs.host_labels`), by node rank.
        counts: each node's worker count, by node rank.
        header: the run's header line (`slurmrun.logs.run_header`).
    """
    workers = [(label, i) for label, n in zip(labels, counts, strict=True) for i in range(n)]
    for handler in handlers:
        if isinstance(handler, _WorkerFiles):
            handler.begin(workers, header)


def default_handlers(
    hostnames: Iterable[str],
    log_dir: str | None,
    level: int,
    ranks: Literal["all"] | Collection[int] = (0,),
) -> list[logging.Handler]:
    """Agent 0 and the global `ranks` (``"all"``: all) live; with `log_dir`, a file per worker."""
    first = next(iter(hostnames))
    workers = TerminalHandler(None, None)
    workers.setLevel(level)
    workers.addFilter(_RankFilter(None if ranks == "all" else frozenset(ranks)))
    handlers: list[logging.Handler] = [stream_handler(first, -1, level), workers]
    if log_dir is not None:
        files = _WorkerFiles(log_dir)
        files.setLevel(level)
        handlers.append(files)
    return handlers
