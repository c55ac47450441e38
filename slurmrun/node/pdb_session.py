"""The pdb of `slurmrun.node.debugger`: imported on the first ``breakpoint()`` only."""

from __future__ import annotations

import pdb
from types import FrameType
from typing import Any, Protocol

from slurmrun import protocol

__all__ = ["LinkedPdb"]


class Channel(Protocol):
    """pdb's stdin and stdout, which can also tell the launcher where the session is."""

    def write(self, text: str) -> int: ...
    def flush(self) -> None: ...
    def readline(self, size: int | None = -1) -> str: ...
    def send(self, state: protocol.DebugState) -> None: ...


class LinkedPdb(pdb.Pdb):
    """pdb on a `Channel`, that says when its session ends (continue, quit, Ctrl-D)."""

    def __init__(self, channel: Channel, where: str) -> None:
        self.channel = channel
        super().__init__(stdin=channel, stdout=channel, nosigint=True, readrc=False)  # type: ignore[arg-type]
        self.use_rawinput = False
        self.prompt = f"(Pdb) [{where}] "
        self._leaving = False

    def interaction(self, frame: FrameType | None, tb: Any) -> None:
        """Pdb's session at a stop; the launcher hears when the user let the rank go on."""
        super().interaction(frame, tb)
        if self._leaving:
            self._leaving = False
            self.channel.send(protocol.DebugState.ENDED)

    def do_continue(self, arg: str) -> bool | None:
        """c(ont(inue)): the rank goes on; the session ends."""
        self._leaving = True
        return super().do_continue(arg)

    do_c = do_cont = do_continue

    def do_quit(self, arg: str) -> bool | None:
        """q(uit): the rank's function raises BdbQuit (the run fails); the session ends."""
        self._leaving = True
        return super().do_quit(arg)

    do_q = do_exit = do_quit

    def do_EOF(self, arg: str) -> bool | None:
        """Ctrl-D, or a launcher without a terminal: the rank goes on (pdb would quit)."""
        self.message("")
        self._leaving = True
        return super().do_continue(arg)
