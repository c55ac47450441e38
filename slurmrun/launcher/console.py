"""Debugger sessions of a run in the launcher's terminal: one at a time, the others queued.

A worker's pdb (`slurmrun.node.debugger`) sends what it wrote, ending with its prompt
(``(Pdb) [node2 rank 5]``); `Sessions` shows it and reads one line from the terminal on a
thread of its own (`TerminalReader`: the run's loop never blocks on the user), which comes
back to the loop as a `LineTyped` event and goes to that worker as DEBUG_INPUT. While one
rank's session is open, other ranks that stop at a breakpoint wait their turn (the launcher
says so). Ctrl-C ends the run as ever: the main thread gets it, not the reader.

On a terminal the prompt is GNU readline's (`slurmrun.launcher.line_editor`): line editing,
the session's history (every breakpoint of the process), and Tab, which asks the rank's pdb
for completions (`CompletionWanted`, `DebugComplete`; a rank that does not answer within
`COMPLETION_WAIT` offers none). A notice that comes while a prompt is up (another rank
stopped too) is written above the prompt, which is shown again with what was typed.

Without a terminal (a batch job's launcher, stdin not a TTY) a breakpoint cannot be served:
the launcher says where it was, and the rank goes on (pdb sees end of input). So it is for a
launcher in the background of its terminal (a shell's ``&`` job, or one put there with
``bg``): the shell owns the terminal, and a read would stop the launcher (SIGTTIN). It is
asked at each prompt, and the reader reads only while the launcher is in the foreground: a
session that Ctrl-Z and ``bg`` interrupt waits for ``fg``.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

from slurmrun import protocol
from slurmrun.launcher.line_editor import LineEditor
from slurmrun.launcher.pump import Events, Local
from slurmrun.waiting import wait_readable

__all__ = [
    "CompletionWanted",
    "LineTyped",
    "Sessions",
    "TerminalReader",
    "has_terminal",
    "in_foreground",
]

log = logging.getLogger("slurmrun")
Key = tuple[int, int]  # (node rank, local rank)
_POLL = 0.1  # how often the reader looks whether its line is still wanted
LINE_LIMIT = 64 * 1024  # what one typed line may hold
COMPLETION_WAIT = 1.5  # how long Tab waits for the rank's completions (then: none)
_JOIN_WAIT = 1.0  # how long a cancelled reader may take to put the terminal back


def has_terminal(stdin: TextIO | None = None) -> bool:
    """Whether a person can answer here: stdin is a terminal, or a Jupyter kernel's input."""
    stdin = sys.stdin if stdin is None else stdin
    if _kernel_input():
        return True
    try:
        return stdin is not None and stdin.isatty()
    except (ValueError, OSError):
        return False


def in_foreground(stdin: TextIO | None = None) -> bool:
    """Whether this process may read its terminal: its process group is the foreground one.

    A shell's background job is not (``python train.py > log &``): reading would stop it
    (SIGTTIN). A stdin that is no controlling terminal of ours (or a Jupyter kernel's input)
    has no foreground to own: True.
    """
    stdin = sys.stdin if stdin is None else stdin
    if _kernel_input():
        return True
    try:
        return os.tcgetpgrp(stdin.fileno()) == os.getpgrp()
    except (AttributeError, ValueError, OSError):
        return True


def _kernel_input() -> bool:
    """Whether input() asks a Jupyter frontend (ipykernel replaces it while a cell runs)."""
    return "ipykernel" in sys.modules and getattr(builtins.input, "__module__", "") != "builtins"


@dataclass(frozen=True)
class LineTyped(Local):
    """The user typed `line` for the session of `key` (None: end of input, Ctrl-D)."""

    key: Key
    line: str | None


@dataclass(frozen=True)
class CompletionWanted(Local):
    """Tab at the prompt of `key`'s session: complete `text` (at `begidx`:`endidx` of `line`).

    The reader waits for `give` (a bounded wait); the run's loop asks the rank.
    """

    key: Key
    text: str
    line: str
    begidx: int
    endidx: int
    _given: list[list[str]] = field(default_factory=list)
    _answered: threading.Event = field(default_factory=threading.Event)

    def give(self, matches: list[str]) -> None:
        """The completions (the first answer counts)."""
        if not self._answered.is_set():
            self._given.append(matches)
            self._answered.set()

    def wait(self, stop: threading.Event, timeout: float) -> list[str]:
        """The completions given within `timeout` seconds (none after it, or once `stop`)."""
        deadline = time.monotonic() + timeout
        while not stop.is_set() and (left := deadline - time.monotonic()) > 0:
            if self._answered.wait(min(left, _POLL)):
                return self._given[0]
        return []

    def unowned(self) -> None:
        """No run takes it: no completions."""
        self.give([])


class TerminalReader:
    """Reads one line at a time from stdin, on a thread of its own, into the run's loop.

    On a terminal with GNU readline, the line is edited (`LineEditor`), and the reader shows
    the prompt itself.
    """

    def __init__(self, events: Events) -> None:
        self._events = events
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._prompt: str | None = None  # the prompt up now (None: no line is being read)
        self._editing = False  # the line is edited by readline, on the reader's thread
        self._current: threading.Event | None = None  # the stop of the read in progress
        self._notices: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._lock = threading.Lock()

    @property
    def edits(self) -> bool:
        """Whether lines are edited with readline (then `read` shows the prompt itself)."""
        return not _kernel_input() and LineEditor.load() is not None

    def read(self, key: Key, prompt: str) -> None:
        """Starts reading the line for `key` (`prompt` is shown already, unless `edits`)."""
        self._stop.clear()
        stop = self._stop
        editor = None if _kernel_input() else LineEditor.load()
        with self._lock:
            self._prompt, self._editing, self._current = prompt, editor is not None, stop
        self._thread = threading.Thread(
            target=self._read,
            args=(key, prompt, editor, stop),
            name="slurmrun-console",
            daemon=True,
        )
        self._thread.start()

    def cancel(self) -> None:
        """The line is no longer wanted (the session or the run ended).

        An edited line's terminal is back in its own mode when this returns (bounded wait).
        """
        self._stop.set()
        self._stop = threading.Event()
        with self._lock:
            self._prompt = self._current = None
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread() and not _kernel_input():
            thread.join(_JOIN_WAIT)

    def interject(self, text: str) -> bool:
        """Shows `text` (whole lines) above the prompt that is up; False: no prompt is up."""
        with self._lock:
            prompt = self._prompt
            if prompt is None:
                return False
            if self._editing:
                self._notices.put(text)  # (the reader's thread owns readline: it shows it)
            else:
                _write_out(f"\n{text}{prompt}")
            return True

    def _read(
        self, key: Key, prompt: str, editor: LineEditor | None, stop: threading.Event
    ) -> None:
        try:
            if _kernel_input():
                line = _input()  # cannot be cancelled: the frontend's input box stays until used
            elif editor is not None:
                line = self._edit(key, prompt, editor, stop)
            else:
                line = _read_line(stop)
        finally:
            with self._lock:
                if self._current is stop:
                    self._prompt = self._current = None
                while not self._notices.empty():  # (came as the line ended)
                    _write_out(self._notices.get())
        if not stop.is_set():
            self._events.put(LineTyped(key, line))

    def _edit(self, key: Key, prompt: str, editor: LineEditor, stop: threading.Event) -> str | None:
        """An edited line (None: end of input, or `stop`)."""

        def complete(text: str, line: str, begidx: int, endidx: int) -> list[str]:
            wanted = CompletionWanted(key, text, line, begidx, endidx)
            self._events.put(wanted)
            return wanted.wait(stop, COMPLETION_WAIT)

        started = False
        try:
            while not stop.is_set():
                if not in_foreground():  # (Ctrl-Z and bg during a session: it waits for fg)
                    stop.wait(_POLL)
                    continue
                if not started:
                    editor.start(prompt, complete)
                    started = True
                while not self._notices.empty():
                    editor.interject(self._notices.get())
                if wait_readable([0], _POLL) and not stop.is_set() and editor.feed():
                    line = editor.line
                    return None if line is None else line[:LINE_LIMIT] + "\n"
        finally:
            editor.stop()
        return None


def _read_line(stop: threading.Event) -> str | None:
    """A line from stdin (None: end of input), waiting until `stop` is set."""
    try:
        fd = sys.stdin.fileno()
    except (AttributeError, ValueError, OSError):
        return None
    while not stop.is_set():
        if not in_foreground():  # (Ctrl-Z and bg during a session: the line waits for fg)
            stop.wait(_POLL)
        elif wait_readable([fd], _POLL) and in_foreground():
            return sys.stdin.readline(LINE_LIMIT) or None
    return None


def _input() -> str | None:
    """A line from a Jupyter frontend (None: end of input, or a frontend without input)."""
    try:
        return input()[:LINE_LIMIT] + "\n"
    except (EOFError, NotImplementedError):  # IPython's StdinNotImplementedError: no input box
        log.warning(
            "slurmrun: this notebook's frontend takes no input (allow_stdin is off): the "
            "rank goes on"
        )
        return None


class Sessions:
    """The run's debugger sessions (see the module's docstring).

    Args:
        send: sends a `DebugInput` (or `DebugComplete`) to the agent of the key's node rank.
        reader: reads the user's lines (None: no terminal; every prompt gets end of input).
        out: where prompts and the debugger's output are written.
    """

    def __init__(
        self,
        send: Callable[[int, protocol.Message, bytes], None],
        reader: TerminalReader | None,
        out: TextIO | None = None,
    ) -> None:
        self._send = send
        self._reader = reader
        self._out = out
        self.active: Key | None = None
        self._waiting: deque[tuple[Key, bytes]] = deque()  # prompts in turn
        self._run = 0
        self._told: set[Key] = set()  # ranks told once that there is no terminal
        self._closed = False  # the run is over: no more sessions
        self._asked: tuple[int, CompletionWanted] | None = None  # the Tab the rank answers
        self._requests = 0

    @property
    def open(self) -> bool:
        """Whether a rank is in a session, or waits for one."""
        return self.active is not None or bool(self._waiting)

    def on_message(self, run: int, key: Key, message: protocol.Debugger, body: bytes) -> None:
        """A worker's debugger spoke: a prompt (show it, or queue it), or its session ended."""
        if self._closed:
            return  # the run is over: its workers are being stopped
        self._run = run
        text = body.decode(errors="replace")
        if message.state == protocol.DebugState.ENDED:
            if self.active == key:  # (else a prompt answered with end of input: nothing shown)
                self._write(text)
                self._next()
            return
        if self._reader is None or not in_foreground():
            self._no_terminal(key, message.where, text, background=self._reader is not None)
            return
        if self.active in (None, key):
            self._show(key, text)
        elif all(k != key for k, _ in self._waiting):
            self._waiting.append((key, body))
            notice = (
                f"slurmrun: {message.where} stopped at a breakpoint too; its session follows "
                f"this one ({len(self._waiting)} waiting).\n"
            )
            if self._reader is None or not self._reader.interject(notice):
                self._write(notice)  # (no prompt is up: the rank runs a command)

    def on_complete(self, wanted: CompletionWanted) -> None:
        """Tab at the prompt: asks the rank whose session is open (the reader waits)."""
        if self._closed or wanted.key != self.active:
            wanted.give([])
            return
        self._answer([])  # (an earlier Tab's answer is too late now)
        self._requests += 1
        self._asked = (self._requests, wanted)
        ask = protocol.DebugComplete(
            run=self._run,
            local_rank=wanted.key[1],
            request=self._requests,
            text=wanted.text,
            line=wanted.line,
            begidx=wanted.begidx,
            endidx=wanted.endidx,
        )
        self._send(wanted.key[0], ask, b"")

    def on_completions(self, key: Key, answer: protocol.DebugCompletions) -> None:
        """The rank's completions, for the reader that waits for them."""
        if self._asked is not None and self._asked[0] == answer.request and key == self.active:
            self._answer(answer.matches)

    def _answer(self, matches: list[str]) -> None:
        asked, self._asked = self._asked, None
        if asked is not None:
            asked[1].give(matches)

    def on_line(self, typed: LineTyped) -> None:
        """The user's line: to the worker whose session is open."""
        if typed.key != self.active:
            return
        line = typed.line or ""
        input_ = protocol.DebugInput(run=self._run, local_rank=typed.key[1], eof=typed.line is None)
        self._send(typed.key[0], input_, line.encode(errors="surrogateescape"))

    def rank_ended(self, key: Key) -> None:
        """Rank `key` returned, failed or died: its session (or place in the queue) is over."""
        if self._waiting:  # (called for every result: nothing to do, nothing made)
            self._waiting = deque(w for w in self._waiting if w[0] != key)
        if self.active == key:
            self._next()

    def close(self) -> None:
        """The run is over: no line is wanted any more."""
        self._closed = True
        self._answer([])
        if self._reader is not None:
            self._reader.cancel()
        self.active = None
        self._waiting.clear()

    def _show(self, key: Key, text: str) -> None:
        self.active = key
        output, newline, prompt = text.rpartition("\n")
        if self._reader is not None and self._reader.edits:
            self._write(output + newline)  # (readline shows the prompt)
        else:
            self._write(text)
        if self._reader is not None:
            self._reader.read(key, prompt)

    def _next(self) -> None:
        self.active = None
        self._answer([])
        if self._reader is not None:
            self._reader.cancel()
        if self._waiting:
            key, body = self._waiting.popleft()
            self._show(key, body.decode(errors="replace"))

    def _no_terminal(self, key: Key, where: str, text: str, *, background: bool) -> None:
        stop = next((line for line in text.splitlines() if line.startswith("> ")), "")
        self._send(key[0], protocol.DebugInput(run=self._run, local_rank=key[1], eof=True), b"")
        if key in self._told:
            return  # once per rank: a breakpoint in a loop must not flood the output
        self._told.add(key)
        if background:
            why = (
                "this launcher runs in the background of its terminal (a shell's & job, or "
                "bg): the rank goes on. Keep the launch in the foreground (fg) to debug it."
            )
        else:
            why = (
                "this launch has no terminal to debug in (its stdin is not one): the rank "
                "goes on. Run the launch from a terminal (under SLURM: salloc, or srun --pty) "
                "to debug it."
            )
        log.warning(
            "slurmrun: %s stopped at a breakpoint%s, but %s",
            where,
            f" ({stop[2:]})" if stop else "",
            why,
        )

    def _write(self, text: str) -> None:
        out = self._out if self._out is not None else sys.stdout
        with contextlib.suppress(OSError, ValueError):
            out.write(text)
            out.flush()


def _write_out(text: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.write(text)
        sys.stdout.flush()
