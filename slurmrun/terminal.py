"""The live terminal view: records printed with a ``[host:rank]`` prefix, progress bars in place."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

from slurmrun.output import LINE, PROGRESS, printable, report_handler_error

__all__ = ["TerminalHandler", "silence_gone_readers"]


def _prefix(record: logging.LogRecord) -> str:
    rank = getattr(record, "local_rank", None)
    return f"[{getattr(record, 'hostname', '?')}:{'agent' if rank is None else rank}]"


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _rewrites(stream: IO[str]) -> bool:
    r"""Whether `stream` shows a ``\r`` as a rewrite of its line: a terminal, a notebook's cell."""
    return _isatty(stream) or type(stream).__module__.partition(".")[0] == "ipykernel"


@dataclass
class _Bar:
    target: IO[str]
    source: tuple[object, ...]
    text: str


class TerminalHandler(logging.Handler):
    r"""Writes records with a ``[host:rank]`` prefix; on a terminal, progress states in place.

    On a terminal, like ``tqdm.write``: at most one progress line is open; another line is
    printed by clearing the bar, printing the line, and drawing the bar again below it; a
    line not finished yet (a prompt) shows as it grows (partial records: it asks for them).
    A notebook's cell rewrites a line at ``\r`` too, but knows no escape codes: another line
    there ends the bar's line first. Where a stream is neither (a file, a pipe), it gets
    finished lines only: of a progress bar (``\r`` states) its last state, as a line of its
    own, once the bar's line ends or the handler is flushed (at the end of each run, at exit).
    """

    slurmrun_partial = True  # a prompt shows before its line ends (see `slurmrun.logs`)

    def __init__(self, stdout: IO[str] | None, stderr: IO[str] | None) -> None:
        super().__init__()
        self._out = stdout
        self._err = stderr
        self._bar: _Bar | None = None
        # Neither a terminal nor a notebook: each source's last progress state, held until final.
        self._held: dict[tuple[object, ...], _Bar] = {}
        self._write_lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        """Prints `record` (a failure is reported once, never raised)."""
        try:
            self._emit(record)
        except Exception:
            self.handleError(record)

    def handleError(self, record: logging.LogRecord) -> None:
        """Reports the exception once for this handler (`report_handler_error`).

        A stream whose reader has gone (``slurmrun train.py | head -1``) is no error: what
        it would get goes nowhere from then on (`silence_gone_readers`), and the run goes on.
        """
        gone = isinstance(sys.exc_info()[1], BrokenPipeError)
        if gone and silence_gone_readers(self._out or sys.stdout, self._err or sys.stderr):
            return
        report_handler_error(self, record)

    def flush(self) -> None:
        """Ends the open progress line, and writes the progress states held back (see above)."""
        try:
            with self._write_lock:
                if self._bar is not None:
                    _write(self._bar.target, "\n")
                    self._bar = None
                held, self._held = self._held, {}
                for bar in held.values():
                    _write(bar.target, f"{bar.text}\n")
        except Exception:  # a closed stream: reported once, never raised
            self.handleError(logging.makeLogRecord({"msg": "(flush)"}))

    def close(self) -> None:
        """Flushes (see `flush`), then closes."""
        self.flush()
        super().close()

    def emit_lines(self, record: logging.LogRecord, texts: Sequence[str]) -> None:
        """Prints whole lines of `record`'s source at once: what `emit` prints for each."""
        try:
            stream = getattr(record, "stream", "logging")
            if stream == "logging" or self._bar is not None:
                for text in texts:  # records of their own: the prefix, the bar's redraw
                    record.msg = text
                    self._emit(record)
                return
            target = (self._out or sys.stdout) if stream == "stdout" else (self._err or sys.stderr)
            source = (
                getattr(record, "hostname", None),
                getattr(record, "local_rank", None),
                stream,
            )
            prefix = f"{_prefix(record)} "
            block = printable("".join(f"{prefix}{text}\n" for text in texts))
            with self._write_lock:
                self._held.pop(source, None)  # the lines overwrite its states
                _write(target, block)
        except Exception:
            self.handleError(record)

    def _emit(self, record: logging.LogRecord) -> None:
        stream = getattr(record, "stream", "logging")
        target = (self._out or sys.stdout) if stream == "stdout" else (self._err or sys.stderr)
        message = record.getMessage()
        if stream == "logging":
            message = f"{record.levelname}:{record.name}: {message}"
        text = printable(f"{_prefix(record)} {message}")
        source = (getattr(record, "hostname", None), getattr(record, "local_rank", None), stream)
        partial = getattr(record, "slurmrun_partial", False) is True
        with self._write_lock:
            if partial or getattr(record, "slurmrun_end", LINE) == PROGRESS:
                if message:  # an empty state ("\r\r") leaves what is shown as it is
                    self._progress(target, source, text, partial)
            else:
                self._line(target, source, text)

    def _progress(
        self, target: IO[str], source: tuple[object, ...], text: str, partial: bool
    ) -> None:
        if not _rewrites(target):
            if not partial:  # a finished state: the last one so far
                self._held[source] = _Bar(target, source, text)
            return
        bar = self._bar
        if bar is not None and bar.source == source and bar.text == text:
            return  # the state that was shown while it was partial
        if bar is not None and bar.source != source:
            _write(bar.target, "\n")  # another source's bar: leave it as it is
        _write(target, f"\r{text}{_clear(target)}")
        self._bar = _Bar(target, source, text)

    def _line(self, target: IO[str], source: tuple[object, ...], text: str) -> None:
        self._held.pop(source, None)  # the line overwrites its states
        bar = self._bar
        if bar is None:
            _write(target, f"{text}\n")
        elif bar.source == source:  # the bar's own final state
            _write(target, f"\r{text}{_clear(target)}\n")
            self._bar = None
        elif _isatty(bar.target):
            _write(bar.target, "\r\x1b[K")  # ESC[K: erase the bar, print, draw it again
            _write(target, f"{text}\n")
            _write(bar.target, bar.text)
        else:
            _write(bar.target, "\n")  # a notebook cannot erase: end the bar's line
            _write(target, f"{text}\n")
            self._bar = None


def _clear(target: IO[str]) -> str:
    # On a terminal, ESC[K erases what a longer previous state left at the end of the line.
    return "\x1b[K" if _isatty(target) else ""


def _write(target: IO[str], text: str) -> None:
    target.write(text)
    target.flush()


def silence_gone_readers(*streams: IO[str]) -> bool:
    """Points the file of each of `streams` whose reader has gone at /dev/null; whether any.

    A pipe whose reading end was closed (``| head -1``) fails every write with EPIPE: what is
    still buffered for it, and whatever comes later, then goes nowhere instead, without
    another BrokenPipeError (at the interpreter's exit either), as other Unix tools stop
    printing quietly.
    """
    gone = []
    for stream in streams:
        with contextlib.suppress(AttributeError, OSError, ValueError):  # no file: not a pipe
            fd = stream.fileno()
            poll = select.poll()
            poll.register(fd, 0)  # POLLERR and POLLHUP are always reported
            if any(event & (select.POLLERR | select.POLLHUP) for _, event in poll.poll(0)):
                gone.append(fd)
    if gone:
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in gone:
            os.dup2(devnull, fd)
        os.close(devnull)
    return bool(gone)
