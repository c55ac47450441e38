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
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any

from slurmrun import protocol

if TYPE_CHECKING:
    from slurmrun.transport import Connection

__all__ = ["attach", "breakpoint", "give_input", "set_trace"]

# What pdb may write between two prompts that travels (the rest is cut, saying so).
OUTPUT_LIMIT = 1 << 20
# How long one wait for the user's line lasts before it looks again; the wait itself ends
# with the run: the agent's STOP, or its connection closing, ends the worker.
_LINE_POLL = 1.0


@dataclass
class _Link:
    """The worker's way to the launcher's terminal."""

    conn: Connection
    where: str  # "node2 rank 5"
    pid: int  # the worker's: a forked child has the connection, but must not use it
    lines: queue.Queue[str | None] = field(default_factory=lambda: queue.Queue(maxsize=16))


_link: _Link | None = None


def attach(conn: Connection, where: str) -> None:
    """Called by the worker before it runs the function: `conn` leads to the launcher."""
    global _link  # noqa: PLW0603 - one link per worker process, set once
    _link = _Link(conn, where, os.getpid())


def give_input(line: str | None) -> None:
    """A line the user typed for this worker's debugger (None: there is none to give).

    Called by the worker's inbox thread; a line nobody waits for is dropped, bounded.
    """
    link = _link
    if link is not None:
        with contextlib.suppress(queue.Full):
            link.lines.put_nowait(line)


class _Channel:
    """pdb's stdin and stdout: its output is kept until it asks for a line."""

    def __init__(self, link: _Link) -> None:
        self._link = link
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
        self.send(protocol.DebugState.PROMPT)
        link = self._link
        while True:
            try:
                line = link.lines.get(timeout=_LINE_POLL)
            except queue.Empty:
                continue
            if line is None:
                return ""
            return line if line.endswith("\n") else line + "\n"

    def send(self, state: protocol.DebugState) -> None:
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

    LinkedPdb(_Channel(link), link.where).set_trace(caller)


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
