r"""Workers' output as it travels: bytes cut into lines, LOG messages, lines put back together.

A worker's stdout and stderr are byte streams. Its agent reads them in chunks of up to 64 KiB,
decodes each stream with one incremental UTF-8 decoder (a character split between two reads
arrives whole) and cuts it at ``\n``, ``\r\n`` and ``\r`` (`LineAssembler`). What it sends the
launcher is only what is new: a piece of the current line and how the piece ends, never the
whole line again, so a line that grows by small writes costs the wire its length, not its
length squared. The launcher keeps the current unfinished line of each (host, local rank,
stream) and turns pieces back into records (`LineJoiner`).

Every byte a worker wrote is in exactly one finished record, with what ended it: ``"\n"``,
``"\r\n"``, ``"\r"`` (a state of a line that the next one overwrites: a progress bar), or
``""`` (the stream ended there). Files and handlers join a stream's records with their ends
and get the worker's bytes back, exactly. The text of a line that is not finished yet (a
prompt, a progress bar's current state) is a *partial* record, made only for those that show
it live (`slurmrun.terminal`); a finished record follows it, so nothing is counted twice by
those that take only finished ones.

Bytes that are not UTF-8 are carried, not replaced: they decode with ``surrogateescape`` (each
such byte becomes one lone surrogate, U+DC80 to U+DCFF, as `os.fsdecode` does), and files are
written back with ``surrogateescape`` (`to_bytes`), so a worker's log file holds exactly the
bytes it wrote. The live terminal view replaces them (`printable`); a custom handler gets them
as surrogates and recovers the bytes with ``record.getMessage().encode("utf-8",
"surrogateescape")``.

A LOG message (worker -> agent -> launcher) is one frame (`log_frame`, `log_text`):

- header (JSON): ``t`` = ``"log"``; ``stream`` (``"stdout"``, ``"stderr"``, ``"logging"``);
  ``level`` (an int); ``end``; ``name`` (the logger's, for ``"logging"`` records); and
  ``local_rank``, added by the agent;
- body: the text, as UTF-8 with ``surrogateescape`` (raw bytes: never pickled, never JSON).

For stdout and stderr the text is a piece of the current line, and ``end`` says what follows
it: `MORE` (``""``) the line goes on; `LINE` (``"\n"``) or `CRLF` (``"\r\n"``) the line is
finished; `PROGRESS` (``"\r"``) the line was a state that the next one overwrites; `EOF` the
stream ended, and the line has no end. A ``logging`` record's text is its whole message, with
``end`` ``"\n"``.

Bounds: a line is held whole in memory, by the agent (for the worker's file) and by the
launcher (for its records), up to `MAX_LINE` characters (64 Mi: 64 MiB of ASCII); a longer
line is cut there, as if it had a line end, with `cut_mark` at the cut (the stream and the
file say where), and the agent says so once per stream on its stderr (its own log). A
``logging`` record's message is cut to `MAX_LINE` characters by the
worker, with a note at the cut. A line still unfinished past `MAX_PROGRESS` characters makes
no partial record (each would be a copy of it all) until it is finished.
"""

from __future__ import annotations

import codecs
import contextlib
import logging
import re
import sys
import traceback
import weakref
from collections.abc import Callable
from typing import Any

from slurmrun import protocol

__all__ = [
    "CRLF",
    "EOF",
    "LINE",
    "MAX_LINE",
    "MAX_PROGRESS",
    "MORE",
    "PROGRESS",
    "LineAssembler",
    "LineJoiner",
    "cut_mark",
    "line_end",
    "log_frame",
    "log_text",
    "printable",
    "report_handler_error",
    "to_bytes",
]

LINE = "\n"  # the piece finishes its line
CRLF = "\r\n"  # the piece finishes its line, ended by "\r\n"
PROGRESS = "\r"  # the piece finishes a state of a line that the next state overwrites
MORE = ""  # the line goes on
EOF = "eof"  # the stream ended: the piece finishes a last line that has no end
_FINISHED = (LINE, CRLF, PROGRESS, EOF)
MAX_LINE = 64 << 20
MAX_PROGRESS = 1 << 20
_BREAK = re.compile(r"\r\n|\r|\n")
_SURROGATE = re.compile("[\ud800-\udfff]")


def to_bytes(text: str) -> bytes:
    """The bytes a worker wrote, from text decoded with ``surrogateescape``."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate that no decoding made (a logging message's)
        return text.encode("utf-8", "backslashreplace")


def line_end(end: str) -> str:
    """What ended a piece in the worker's output: `end`, or ``""`` for `EOF` (nothing did)."""
    return "" if end == EOF else end


def printable(text: str) -> str:
    """`text` with the bytes that were not UTF-8 shown as U+FFFD (for terminals)."""
    if text.isascii() or not _SURROGATE.search(text):
        return text
    return to_bytes(text).decode("utf-8", "replace")


# ---------------------------------------------------------------------- the LOG message


def log_frame(
    stream: str,
    text: str,
    *,
    end: str = LINE,
    level: int = logging.INFO,
    name: str = "",
    local_rank: int = -1,
    run: int = 0,
) -> tuple[dict[str, Any], bytes]:
    """A LOG message: its header and its body (the text's bytes), for `Connection.send`."""
    message = protocol.Log(
        stream=stream, level=level, end=end, name=name, local_rank=local_rank, run=run
    )
    return message.header(), to_bytes(text)


def log_text(body: bytes | bytearray | memoryview | Any) -> str:
    """A LOG message's text, from its body."""
    return str(bytes(body), "utf-8", "surrogateescape")


# ---------------------------------------------------------------------- agent side


class LineAssembler:
    r"""Cuts one output stream of a worker into pieces of lines (see the module's docstring).

    `feed` calls ``emit(piece, end)`` with what is new: end `MORE` for a piece of a line that
    goes on (once per chunk, so a prompt or a progress bar shows at once), `LINE` or `CRLF`
    when the line is finished, `PROGRESS` when a ``\r`` ends a state of it (an empty one
    too: every ``\r`` is in the stream), `EOF` for the rest of a last line without an end.
    ``"\r\n"`` is one line end, also when a read ends between the two.

    Args:
        emit: receives each piece and how it ends.
        limit: the longest line (characters); a longer one is cut there, as if it had ended.
        on_cut: called once, the first time a line is cut.
        emit_lines: if given, receives the whole lines of a chunk (each ended by ``"\n"``,
            none begun in an earlier chunk, none over `limit`) at once, instead of `emit`
            once per line: what a fast printer writes costs a call per read, not per line.
    """

    def __init__(
        self,
        emit: Callable[[str, str], None],
        limit: int = MAX_LINE,
        on_cut: Callable[[], None] | None = None,
        emit_lines: Callable[[list[str]], None] | None = None,
    ) -> None:
        self._emit = emit
        self._emit_lines = emit_lines
        self._limit = limit
        self._on_cut = on_cut
        self._decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
        self._open = 0  # characters of the current line sent so far
        self._cr = False  # the text so far ended with "\r": a line end if "\n" comes next

    def feed(self, data: bytes) -> None:
        """Processes one chunk of output."""
        self._cut(self._decoder.decode(data))

    def close(self) -> None:
        """Finishes the stream: bytes of an unfinished character, and an unfinished last line."""
        self._cut(self._decoder.decode(b"", final=True))
        if self._cr:
            self._cr = False
            self._send("", PROGRESS)
        if self._open:
            self._send("", EOF)

    def _cut(self, text: str) -> None:
        if not text:
            return
        if self._cr:
            self._cr = False
            if text[0] == "\n":
                self._send("", CRLF)
                text = text[1:]
            else:
                self._send("", PROGRESS)
        if self._emit_lines is not None and "\r" not in text:
            parts = text.split("\n")
            if len(parts) > 2 and max(map(len, parts)) <= self._limit:
                self._send(parts[0], LINE)  # it may end a line begun earlier
                self._emit_lines(parts[1:-1])
                self._send(parts[-1], MORE)
                return
        start = 0
        for match in _BREAK.finditer(text):
            piece = text[start : match.start()]
            start = match.end()
            if match.group() == "\r" and start == len(text):
                self._send(piece, MORE)  # shown now; whether it ends a line, the next read says
                self._cr = True
            else:
                self._send(piece, match.group())  # LINE, CRLF or PROGRESS
        self._send(text[start:], MORE)

    def _send(self, piece: str, end: str) -> None:
        while self._open + len(piece) > self._limit:
            cut = self._limit - self._open
            self._emit(piece[:cut] + cut_mark(self._limit), LINE)
            self._open, piece = 0, piece[cut:]
            if self._on_cut is not None:
                self._on_cut()
                self._on_cut = None
        if end == MORE:
            if piece:
                self._emit(piece, MORE)
                self._open += len(piece)
        else:  # an empty state too: "\r\r" is two bytes of the stream
            self._emit(piece, end)
            self._open = 0


# ---------------------------------------------------------------------- both sides


class LineJoiner:
    """Puts one stream's pieces back together: `add` returns the record it makes, if any.

    A record is ``(text, end)``: a finished one (end `LINE`, `CRLF`, `PROGRESS` or `EOF`) for
    every finished piece, and with `progress`, a partial one (end `MORE`: the line so far, while
    it is at most `MAX_PROGRESS` characters long) for each piece of a line not finished yet.

    Args:
        progress: whether partial records are made (for a live view; files take none).
        limit: the longest line held; a longer one is returned as finished (see `cut`).
    """

    def __init__(self, *, progress: bool = True, limit: int = MAX_LINE) -> None:
        self._parts: list[str] = []
        self._size = 0
        self._progress = progress
        self._limit = limit
        self.cut = 0  # lines returned as finished because they passed `limit`

    def add(self, piece: str, end: str) -> tuple[str, str] | None:
        """Takes one piece (see `LineAssembler`); returns the record it makes, if any."""
        if piece:
            self._parts.append(piece)
            self._size += len(piece)
        if end in _FINISHED:
            return self._take(), end
        if self._size > self._limit:
            self.cut += 1
            return self._take(), LINE
        if self._progress and piece and self._size <= MAX_PROGRESS:
            return self._peek(), MORE
        return None

    @property
    def open(self) -> bool:
        """Whether a line was begun (pieces taken) and not finished yet."""
        return bool(self._parts)

    def _peek(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0]

    def _take(self) -> str:
        text = "".join(self._parts)
        self._parts, self._size = [], 0
        return text


def cut_mark(limit: int) -> str:
    """What ends a line cut at `limit` characters, in the stream and the file: it says so there."""
    return f" [slurmrun: line cut at {limit} characters; it goes on on the next line]"


def note_cut(what: str) -> None:
    """Says on stderr that a line of `what` passed `MAX_LINE` and was cut."""
    print(
        f"slurmrun: a line of {what} passed {MAX_LINE} characters: it was cut there, as if it "
        "ended (and so is every later line this long)",
        file=sys.stderr,
        flush=True,
    )


# ---------------------------------------------------------------------- handlers


_reported: weakref.WeakSet[logging.Handler] = weakref.WeakSet()


def report_handler_error(handler: logging.Handler, record: logging.LogRecord) -> None:
    """Reports the exception being handled, raised by `handler`, once per handler, on stderr.

    Handlers follow logging's convention: a failing handler (a full disk, a bug) is reported
    and the run goes on, so output never costs a run its results.
    """
    if handler in _reported:
        return
    _reported.add(handler)
    with contextlib.suppress(Exception):  # stderr itself may be what fails
        where = f"{getattr(record, 'hostname', '?')}:{getattr(record, 'local_rank', None)}"
        sys.stderr.write(
            f"slurmrun: the log handler {handler!r} failed on a record of {where}; the run goes "
            "on, and this handler's later errors are not reported:\n" + traceback.format_exc()
        )
        sys.stderr.flush()
