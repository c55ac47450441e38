"""The spawner's ends of its workers' report pipes: what each worker noted of its imports.

Each worker writes into a pipe of its own (`slurmrun.node.import_notes`): a line as an
installed package's import starts, and at its end the list of what it imported. The spawner
reads them without blocking, as they come and once more when the worker is reaped; a pipe is
read at most ``2 * MAX_BYTES`` (a process the worker started may hold its write end and write
on).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from slurmrun.node.import_notes import MAX_BYTES

__all__ = ["Reports"]

Noted = Callable[[str], None]


@dataclass
class _Report:
    fd: int  # the read end of a worker's report pipe (-1: closed)
    data: bytes = b""  # a line not whole yet
    size: int = 0


@dataclass
class Reports:
    """The read ends of the live workers' report pipes, by worker pid."""

    _pipes: dict[int, _Report] = field(default_factory=dict)

    def add(self, pid: int, read_end: int) -> None:
        """Worker `pid` got the write end of the pipe whose read end is `read_end`."""
        os.set_blocking(read_end, False)  # a process the worker started may hold the write end
        self._pipes[pid] = _Report(read_end)

    def fds(self) -> list[int]:
        """The read ends still open."""
        return [r.fd for r in self._pipes.values() if r.fd >= 0]

    def take_notes(self, noted: Noted) -> None:
        """Hands each whole line written so far, of every worker, to `noted`."""
        for report in list(self._pipes.values()):
            _read(report, noted, final=False)

    def take_last(self, pid: int, noted: Noted) -> None:
        """Worker `pid` exited: hands the rest of its pipe (its final list) to `noted`."""
        report = self._pipes.pop(pid, None)
        if report is not None and report.fd >= 0:
            _read(report, noted, final=True)


def _read(report: _Report, noted: Noted, *, final: bool) -> None:
    """Takes what a worker wrote into its report pipe: notes as they come, the final list."""
    eof = final
    with contextlib.suppress(OSError):  # (would block: nothing more for now)
        while report.size <= 2 * MAX_BYTES and (chunk := os.read(report.fd, MAX_BYTES)):
            report.data += chunk
            report.size += len(chunk)
        eof = True
    lines = report.data.split(b"\n")
    report.data = b"" if final else lines.pop()  # a cut last line is dropped at the end
    for line in lines[:-1] if final else lines:
        noted(line.decode(errors="replace"))
    if eof or report.size > 2 * MAX_BYTES:  # a process it started may hold the write end
        os.close(report.fd)
        report.fd = -1
