"""The live terminal view: records printed with a ``[host:rank]`` prefix, progress bars in place."""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass
from typing import IO

from slurmrun.output import LINE, PROGRESS, printable, report_handler_error

__all__ = ["TerminalHandler"]


def _prefix(record: logging.LogRecord) -> str:
    rank = getattr(record, "local_rank", None)
    return f"[{getattr(record, 'hostname', '?')}:{'agent' if rank is None else rank}]"


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


@dataclass
class _Bar:
    target: IO[str]
    source: tuple[object, ...]
    text: str


class TerminalHandler(logging.Handler):
    """Writes records with a ``[host:rank]`` prefix; progress states rewrite their line.

    Like ``tqdm.write``: at most one progress line is open; another line is printed by
    clearing the bar, printing the line, and drawing the bar again below it.
    """

    def __init__(self, stdout: IO[str] | None, stderr: IO[str] | None) -> None:
        super().__init__()
        self._out = stdout
        self._err = stderr
        self._bar: _Bar | None = None
        self._write_lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        """Prints `record` (a failure is reported once, never raised)."""
        try:
            self._emit(record)
        except Exception:
            self.handleError(record)

    def handleError(self, record: logging.LogRecord) -> None:
        """Reports the exception once for this handler (`report_handler_error`)."""
        report_handler_error(self, record)

    def _emit(self, record: logging.LogRecord) -> None:
        stream = getattr(record, "stream", "logging")
        target = (self._out or sys.stdout) if stream == "stdout" else (self._err or sys.stderr)
        message = record.getMessage()
        if stream == "logging":
            message = f"{record.levelname}:{record.name}: {message}"
        text = printable(f"{_prefix(record)} {message}")
        source = (getattr(record, "hostname", None), getattr(record, "local_rank", None), stream)
        with self._write_lock:
            if getattr(record, "slurmrun_end", LINE) == PROGRESS:
                self._progress(target, source, text)
            else:
                self._line(target, source, text)

    def _progress(self, target: IO[str], source: tuple[object, ...], text: str) -> None:
        bar = self._bar
        if bar is not None and bar.source != source:
            _write(bar.target, "\n")  # another source's bar: leave it as it is
        _write(target, f"\r{text}{_clear(target)}")
        self._bar = _Bar(target, source, text)

    def _line(self, target: IO[str], source: tuple[object, ...], text: str) -> None:
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
            _write(bar.target, "\n")  # a file or pipe cannot redraw: end the bar's line
            _write(target, f"{text}\n")
            self._bar = None


def _clear(target: IO[str]) -> str:
    # On a terminal, ESC[K erases what a longer previous state left at the end of the line.
    return "\x1b[K" if _isatty(target) else ""


def _write(target: IO[str], text: str) -> None:
    target.write(text)
    target.flush()
