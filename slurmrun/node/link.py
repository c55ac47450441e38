"""The agent's connection to the launcher, which a failed send ends rather than leaves half-used."""

from __future__ import annotations

import socket
import sys
from collections.abc import Sequence
from typing import Any

from slurmrun.transport import Connection, FrameHead, OutOfBand

__all__ = ["LauncherConnection", "say"]


def say(hostname: str, message: str) -> None:
    """A line for the agent's own log (srun's output file, or the local agent's log)."""
    print(f"slurmrun agent on {hostname}: {message}", file=sys.stderr, flush=True)


class LauncherConnection(Connection):
    """The agent's connection to the launcher: a send that fails cuts it, and says why.

    The launcher waits for what the agent sends (results, DIED, IDLE): a frame that could not
    be sent whole must not leave it waiting, nor may the frames behind a half-sent one be read
    as its payload. So any failure to send (the connection broke, a header over the limit,
    a worker gone in the middle of a frame that was being forwarded) ends the connection: the
    launcher sees it end, and fails the run naming this agent.

    Args:
        sock: the authenticated socket.
        hostname: this node's name, for the agent's log.
    """

    def __init__(self, sock: socket.socket, hostname: str = "") -> None:
        super().__init__(sock)
        self.hostname = hostname

    def send(
        self,
        header: dict[str, Any],
        body: bytes | bytearray | memoryview = b"",
        buffers: Sequence[OutOfBand | memoryview | bytes | bytearray] = (),
    ) -> None:
        """`Connection.send`; a failure cuts the connection and raises ConnectionError."""
        try:
            super().send(header, body, buffers)
        except (OSError, ValueError) as e:
            self.cut(f"could not send a {header.get('t')!r} message: {e}")
            raise ConnectionError(str(e)) from e

    def take(self, head: FrameHead, src: Connection) -> None:
        """Forwards a worker's frame from `src`; a failure cuts the connection and raises.

        Raises:
            ConnectionError: the frame could not be sent whole (the launcher's connection
                broke, or the worker's ended in the middle of the frame).
        """
        try:
            src.forward(head, self)
        except (OSError, EOFError, ValueError) as e:
            self.cut(f"could not forward a worker's {head.kind!r} message: {e}")
            raise ConnectionError(str(e)) from e

    def cut(self, why: str) -> None:
        """Ends the connection (once), saying why in the agent's log."""
        if self.sock.fileno() >= 0:
            say(self.hostname, f"{why}; closing the connection to the launcher")
        self.close()
