"""``breakpoint()`` in a worker: pdb, with the launcher's terminal as its own.

A worker has no terminal (its stdin is not the user's), so its ``PYTHONBREAKPOINT`` names
`set_trace` here (`slurmrun.worker_env.DEBUGGER_HOOK`). The debugger is pdb with its input
and output on the worker's control connection: when pdb wants a line, the worker sends what
pdb wrote, ending with the prompt (``(Pdb) [node2 rank 5]``), as a DEBUGGER message; the
launcher shows it in its terminal (one session at a time: other ranks queue), and sends the
line typed back as DEBUG_INPUT, which the worker's inbox thread (`slurmrun.node.inbox`) hands
over here. ``c`` (or ``q``, or Ctrl-D) ends the session: the rank goes on, the next one in the
queue gets the terminal. The other ranks never stop: they run on, or wait in their
collectives as they would.

Only the worker process itself has the connection: a process that a worker forked or started
(a DataLoader worker, a subprocess) that calls ``breakpoint()`` is told so on its stderr and
goes on. One thread of a worker at a time should debug: the launcher tells sessions apart by
rank.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any

from slurmrun import protocol

if TYPE_CHECKING:
    import bdb

    from slurmrun.transport import Connection

__all__ = [
    "attach",
    "begin_run",
    "breakpoint",
    "end_run",
    "give_completion",
    "give_input",
    "quit_line",
    "set_trace",
]

# What pdb may write between two prompts that travels (the rest is cut, saying so).
OUTPUT_LIMIT = 1 << 20
# How long one wait for the user's line lasts before it looks again; the wait itself ends
# with the run: the agent's STOP, or its connection closing, ends the worker.
_LINE_POLL = 1.0


@dataclass
class _RunInput:
    """The lines typed for one run's sessions.

    A pdb left waiting by an earlier run (in a thread the function left behind) has its own,
    closed one, and never takes this run's lines.
    """

    run: int | None  # None: the worker's first run (the only one its lines can be for yet)
    # The lines typed, and the completions asked for (Tab) while pdb waits for a line.
    lines: queue.Queue[str | protocol.DebugComplete | None] = field(
        default_factory=lambda: queue.Queue(maxsize=16)
    )
    closed: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Link:
    """The worker's way to the launcher's terminal."""

    conn: Connection
    where: str  # "node2 rank 5"
    pid: int  # the worker's: a forked child has the connection, but must not use it
    input: _RunInput = field(default_factory=lambda: _RunInput(None))


_link: _Link | None = None
# This worker's live debuggers: a run's end clears their breakpoints and traces (weak: a
# breakpoint() in a loop makes one per stop, and an ended session's is garbage).
_debuggers: weakref.WeakSet[bdb.Bdb] = weakref.WeakSet()


def attach(conn: Connection, where: str) -> None:
    """Called by the worker before it runs the function: `conn` leads to the launcher."""
    global _link  # noqa: PLW0603 - one link per worker process, set once
    _link = _Link(conn, where, os.getpid())


def give_input(line: str | None, run: int) -> None:
    """A line the user typed for this worker's debugger in `run` (None: there is none to give).

    Called by the worker's inbox thread; a line for another run, or that nobody waits for,
    is dropped (bounded).
    """
    link = _link
    if link is None:
        return
    run_input = link.input
    if run_input.run not in (None, run) or run_input.closed.is_set():
        return
    with contextlib.suppress(queue.Full):
        run_input.lines.put_nowait(line)


def give_completion(ask: protocol.DebugComplete) -> None:
    """Tab at the prompt: pdb answers `ask` while it waits for its line (dropped if none does).

    Called by the worker's inbox thread; the answer comes from pdb's own thread, which owns
    the frame it completes in.
    """
    link = _link
    if link is None:
        return
    run_input = link.input
    if run_input.run not in (None, ask.run) or run_input.closed.is_set():
        return
    with contextlib.suppress(queue.Full):
        run_input.lines.put_nowait(ask)


def quit_line(exc: BaseException) -> str | None:
    """What the launcher shows for `exc` if it is the user's ``q`` in this worker's pdb."""
    session = sys.modules.get("slurmrun.node.pdb_session")
    return None if session is None else session.quit_line(exc)


def end_run() -> None:
    """A kept worker's run is over: its debugging ends with it (a fresh worker's would).

    Breakpoints set with ``b`` are cleared, pdb's trace function leaves this thread (it
    would stop the next run in code that never calls ``breakpoint()``, and slow it), and a
    pdb still waiting for a line (a thread the function left) gets end of input: it goes on.
    Called by the worker's main thread, once the run's result is sent.
    """
    link = _link
    if link is not None:
        link.input.closed.set()
        with contextlib.suppress(queue.Full):
            link.input.lines.put_nowait(None)  # (wakes a waiting pdb at once)
    if "slurmrun.node.pdb_session" not in sys.modules:
        return  # no breakpoint() was ever served here: nothing to clear
    ours = set(_debuggers)
    for debugger in ours:
        debugger.breaks = {}
    sys.modules["bdb"].Breakpoint.clearBreakpoints()  # (pdb's are class-wide)
    if _traced_by(sys.gettrace(), ours):
        sys.settrace(None)
    if _traced_by(threading.gettrace(), ours):
        threading.settrace(None)
    frame: FrameType | None = sys._getframe()
    while frame is not None:  # bdb's set_trace gave each caller's frame its trace too
        if _traced_by(frame.f_trace, ours):
            frame.f_trace = None
        frame = frame.f_back


def begin_run(run: int) -> None:
    """A kept worker takes `run`: the lines typed from now on are for that run's sessions."""
    link = _link
    if link is not None:
        link.input = _RunInput(run)


def _traced_by(trace: object, debuggers: set[bdb.Bdb]) -> bool:
    return getattr(trace, "__self__", None) in debuggers


class _Channel:
    """pdb's stdin and stdout: its output is kept until it asks for a line."""

    def __init__(self, link: _Link) -> None:
        self._link = link
        self._input = link.input  # this run's lines; once it is over, end of input
        # pdb's completions of a text (set by `LinkedPdb`): text, line, begidx, endidx.
        self.completer: Callable[[str, str, int, int], list[str]] | None = None
        self._parts: list[str] = []
        self._size = 0
        self._cut = 0

    def flush(self) -> None:
        """Nothing: what pdb wrote travels with its next prompt."""

    def write(self, text: str) -> int:
        if self._size + len(text) <= OUTPUT_LIMIT:
            self._parts.append(text)
            self._size += len(text)
        else:
            self._cut += len(text)
        return len(text)

    def take(self) -> str:
        """What pdb wrote since the last call (with a note of what was cut)."""
        text = "".join(self._parts)
        if self._cut:
            text += f"\n[slurmrun: {self._cut:,} characters of the debugger's output cut]\n"
        self._parts, self._size, self._cut = [], 0, 0
        return text

    def readline(self, size: int | None = -1) -> str:
        """Sends pdb's output and prompt to the launcher; returns the line typed ("": none)."""
        run_input = self._input
        self.send(protocol.DebugState.PROMPT)
        while not run_input.closed.is_set():
            try:
                line = run_input.lines.get(timeout=_LINE_POLL)
            except queue.Empty:
                continue
            if isinstance(line, protocol.DebugComplete):
                self._complete(line)
                continue
            if line is None:
                return ""
            return line if line.endswith("\n") else line + "\n"
        return ""

    def _complete(self, ask: protocol.DebugComplete) -> None:
        """Answers Tab at the prompt (a failing completer answers none: the line stays)."""
        matches: list[str] = []
        if self.completer is not None:
            with contextlib.suppress(Exception):
                matches = self.completer(ask.text, ask.line, ask.begidx, ask.endidx)
        if self._input.closed.is_set() or self._input is not self._link.input:
            return  # its run is over
        answer = protocol.DebugCompletions(request=ask.request, matches=matches)
        with contextlib.suppress(OSError):  # the agent is gone: the worker is ending
            self._link.conn.send(answer.header())

    def send(self, state: protocol.DebugState) -> None:
        if self._input.closed.is_set() or self._input is not self._link.input:
            self.take()  # its run is over, and the launcher's session with it
            return
        message = protocol.Debugger(state=state.value, where=self._link.where)
        self._link.conn.send(message.header(), self.take().encode(errors="surrogateescape"))


def _stdin_is_a_terminal() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (ValueError, OSError):
        return False


def set_trace(*_args: Any, frame: FrameType | None = None, **_kwargs: Any) -> None:
    """Stops here in pdb, in the launcher's terminal (``PYTHONBREAKPOINT``'s target).

    Args:
        frame: where to stop; None: the caller's frame.
    """
    caller = frame if frame is not None else sys._getframe(1)
    link = _link
    if link is None and _stdin_is_a_terminal():
        import pdb  # noqa: PLC0415 - no launch in this process: plain pdb, here

        pdb.Pdb().set_trace(caller)
        return
    if link is None or link.pid != os.getpid():
        print(
            f"slurmrun: breakpoint() at {caller.f_code.co_filename}:{caller.f_lineno} in "
            f"process {os.getpid()} ignored: only a worker process itself can open the "
            "debugger in the launcher's terminal (this one was started by a worker, or by no "
            "slurmrun launch)",
            file=sys.stderr,
            flush=True,
        )
        return
    from slurmrun.node.pdb_session import LinkedPdb  # noqa: PLC0415 - pdb: only when used

    debugger = LinkedPdb(_Channel(link), link.where)
    _debuggers.add(debugger)
    debugger.set_trace(caller)


def breakpoint(*, frame: FrameType | None = None) -> None:
    """Stops the calling worker in pdb, in the launcher's terminal (see docs/debugging.md).

    What ``breakpoint()`` does in a worker, for code that wants it whatever
    ``PYTHONBREAKPOINT`` says (``slurmrun.breakpoint()``). The prompt names the host and rank
    (``(Pdb) [node2 rank 5]``); the other ranks run on. Outside a worker: plain pdb where stdin
    is a terminal.

    Args:
        frame: where to stop; None: the caller.
    """
    set_trace(frame=frame if frame is not None else sys._getframe(1))
