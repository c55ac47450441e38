"""The launcher's records: a run's LOG messages made into `logging.LogRecord`s for its handlers.

What a record carries is `slurmrun.logs`'s to say (its module docstring). Here each LOG message
becomes the records of what it finished, a record per line, and goes to every handler whose
level it reaches. The finished lines of one read of a worker's pipe come in one message
(`slurmrun.node.relay`); a handler that can print them at once (``emit_lines``, the terminal
view) gets them so, where its filters are slurmrun's own (`slurmrun.handlers.SourceFilter`, which
look only at where a record comes from): the live view then costs a write per read, not per
line. Every other handler gets a record per line, as from a logger.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from slurmrun import protocol
from slurmrun.handlers import SourceFilter
from slurmrun.output import (
    LINE,
    MORE,
    LineJoiner,
    line_end,
    log_text,
    note_cut,
    report_handler_error,
)

__all__ = ["RunOutput", "dispatch", "flush_handlers", "make_record", "wants_partial"]

LOGGING = "logging"  # the stream of a logging record: one record, whatever lines it holds


def make_record(
    log: protocol.Log, hostname: str, rank: int | None, msg: str, end: str
) -> logging.LogRecord:
    """A LogRecord from a LOG message, the text it makes (`msg`) and how that ends.

    `end` is one of `slurmrun.output`'s: `MORE` makes a partial record.
    """
    record = logging.makeLogRecord(
        {
            "name": log.name or f"slurmrun.{hostname}",
            "levelno": log.level,
            "levelname": logging.getLevelName(log.level),
            "msg": msg,
        }
    )
    record.hostname = hostname
    record.local_rank = log.local_rank if log.local_rank >= 0 else None
    record.rank = rank
    record.stream = log.stream
    record.slurmrun_end = line_end(end)
    record.slurmrun_partial = end == MORE
    return record


def _with_text(record: logging.LogRecord, msg: str) -> logging.LogRecord:
    """`record` for another line of the same read (a copy: a handler may keep its records)."""
    copy = logging.LogRecord.__new__(logging.LogRecord)
    copy.__dict__.update(record.__dict__)
    copy.msg = msg
    return copy


class RunOutput:
    """The launcher's side of one run's LOG messages: pieces of lines in, records out.

    It holds the unfinished line of every (host, local rank, stream), and hands the handlers
    a record per finished piece (a line, a progress state); the states of an unfinished line
    (partial records) go only to handlers whose ``slurmrun_partial`` is true (see
    `slurmrun.output`).
    """

    def __init__(self) -> None:
        self._lines: dict[tuple[str, object, str], LineJoiner] = {}

    def dispatch(
        self,
        log: protocol.Log,
        body: Any,
        hostname: str,
        rank: int | None,
        handlers: Iterable[logging.Handler],
    ) -> None:
        """Hands the records that one LOG message (and its body) makes to `handlers`."""
        text, handlers = log_text(body), list(handlers)
        if log.stream == LOGGING or log.end != LINE or "\n" not in text:
            self._piece(log, text, hostname, rank, handlers)
            return
        # Finished lines of one read, joined by "\n" (no piece holds one): the first may end
        # a line begun earlier; the others are whole.
        joiner = self._lines.get((hostname, log.local_rank, log.stream))
        if joiner is not None and joiner.open:
            first, _, text = text.partition("\n")
            self._piece(log, first, hostname, rank, handlers)
        _lines(make_record(log, hostname, rank, "", LINE), text.split("\n"), handlers)

    def _piece(
        self,
        log: protocol.Log,
        text: str,
        hostname: str,
        rank: int | None,
        handlers: list[logging.Handler],
    ) -> None:
        end = log.end
        if log.stream != LOGGING:
            key = (hostname, log.local_rank, log.stream)
            joiner = self._lines.get(key)
            if joiner is None:
                live = any(wants_partial(h) for h in handlers)
                joiner = self._lines[key] = LineJoiner(progress=live)
            made = joiner.add(text, end)
            if joiner.cut == 1 and made is not None and made[1] == LINE:
                note_cut(f"{hostname}:{log.local_rank} ({log.stream})")
            if made is None:
                return
            text, end = made
            if end == MORE:
                handlers = [h for h in handlers if wants_partial(h)]
        dispatch(make_record(log, hostname, rank, text, end), handlers)


def _lines(
    record: logging.LogRecord, texts: Sequence[str], handlers: Iterable[logging.Handler]
) -> None:
    """Hands whole lines of one source (`record` says which) to `handlers`, in order."""
    for handler in handlers:
        if record.levelno < handler.level:
            continue
        emit_lines = getattr(handler, "emit_lines", None)
        if emit_lines is not None and all(isinstance(f, SourceFilter) for f in handler.filters):
            record.msg = texts[0]  # what the filters and an error's report see
            try:
                if handler.filter(record):
                    emit_lines(record, texts)
            except Exception:
                report_handler_error(handler, record)
            continue
        for text in texts:
            line = _with_text(record, text)
            try:
                handler.handle(line)
            except Exception:
                report_handler_error(handler, line)


def wants_partial(handler: logging.Handler) -> bool:
    """Whether `handler` asked for partial records (``handler.slurmrun_partial = True``)."""
    return getattr(handler, "slurmrun_partial", False) is True


def flush_handlers(handlers: Iterable[logging.Handler]) -> None:
    """Flushes each handler at the end of a run (a failure is reported once, as `dispatch`'s)."""
    for handler in handlers:
        try:
            handler.flush()
        except Exception:
            report_handler_error(handler, logging.makeLogRecord({"msg": "(flush)"}))


def dispatch(record: logging.LogRecord, handlers: Iterable[logging.Handler]) -> None:
    """Hands `record` to each handler whose level it reaches (as a logger would).

    A handler that raises is reported once (`report_handler_error`); the others still get it.
    """
    for handler in handlers:
        if record.levelno >= handler.level:
            try:
                handler.handle(record)
            except Exception:
                report_handler_error(handler, record)
