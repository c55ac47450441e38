"""The pdb of `slurmrun.node.debugger`: imported on the first ``breakpoint()`` only."""

from __future__ import annotations

import bdb
import pdb
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

from slurmrun import protocol

__all__ = ["LinkedPdb", "quit_line"]

# The BdbQuit that each ``q`` raised, and where: the worker sends it with one line instead of
# bdb's traceback (a person who typed ``q`` knows where it came from).
_quits: weakref.WeakKeyDictionary[BaseException, str] = weakref.WeakKeyDictionary()


class Channel(Protocol):
    """pdb's stdin and stdout, which can also tell the launcher where the session is."""

    completer: Callable[[str, str, int, int], list[str]] | None

    def write(self, text: str) -> int: ...
    def flush(self) -> None: ...
    def readline(self, size: int | None = -1) -> str: ...
    def send(self, state: protocol.DebugState) -> None: ...


def quit_line(exc: BaseException) -> str | None:
    """The line that stands for `exc`'s traceback if a ``q`` in a `LinkedPdb` raised it."""
    where = _quits.get(exc)
    if where is None:
        return None
    return f"slurmrun: the debugger was quit (q) in {where}: its run ends here.\n"


class LinkedPdb(pdb.Pdb):
    """pdb on a `Channel`, that says when its session ends (continue, quit, Ctrl-D)."""

    def __init__(self, channel: Channel, where: str) -> None:
        self.channel = channel
        super().__init__(stdin=channel, stdout=channel, nosigint=True, readrc=False)  # type: ignore[arg-type]
        self.use_rawinput = False
        self.prompt = f"(Pdb) [{where}] "
        self.where = where
        self._leaving = False
        channel.completer = self.completions

    def interaction(self, frame: FrameType | None, tb: Any) -> None:
        """Pdb's session at a stop; the launcher hears when the user let the rank go on."""
        super().interaction(frame, tb)
        if self._leaving:
            self._leaving = False
            self.channel.send(protocol.DebugState.ENDED)

    def completions(self, text: str, line: str, begidx: int, endidx: int) -> list[str]:
        """What Tab offers for `text` at `begidx`:`endidx` of `line` (`cmd.Cmd.complete`'s way).

        Asked by the launcher (its readline has the line, this pdb the frame): a command's
        name first, then what the command completes (``p`` an expression in the frame).
        """
        stripped = len(line) - len(line.lstrip())
        line, begidx, endidx = line.lstrip(), begidx - stripped, endidx - stripped
        if begidx > 0:
            command = self.parseline(line)[0]
            complete = getattr(self, f"complete_{command}", self.completedefault)
        else:
            complete = self.completenames
        return [str(m) for m in complete(text, line, begidx, endidx) or []]

    def trace_dispatch(self, frame: FrameType, event: str, arg: Any) -> Any:
        """bdb's, but the BdbQuit of ``q`` says where (and is sent without its traceback)."""
        try:
            return super().trace_dispatch(frame, event, arg)
        except bdb.BdbQuit as e:
            if e.args:
                raise  # (already ours: outer frames raise it again as it leaves them)
            quit_ = bdb.BdbQuit(f"the debugger was quit (q) in {self.where}")
            _quits[quit_] = self.where
            raise quit_ from None

    def do_continue(self, arg: str) -> bool | None:
        """c(ont(inue)): the rank goes on; the session ends."""
        self._leaving = True
        return super().do_continue(arg)

    do_c = do_cont = do_continue

    def do_quit(self, arg: str) -> bool | None:
        """q(uit): the rank's run ends (BdbQuit, one line in the launcher); the session ends."""
        self._leaving = True
        return super().do_quit(arg)

    do_q = do_exit = do_quit

    def do_EOF(self, arg: str) -> bool | None:
        """Ctrl-D, or a launcher without a terminal: the rank goes on (pdb would quit)."""
        self.message("")
        self._leaving = True
        return super().do_continue(arg)
