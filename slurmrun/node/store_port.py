"""The port of the next run's process-group store, held listening by the agent that reports it.

Every agent reports a free port in its hello and after each run; the agent that hosts rank 0
of a run gives its port to the workers as ``MASTER_PORT``, and rank 0 serves the run's
TCPStore there. Workers on other nodes may get there first: a port that is merely free (bound
and closed again) would refuse them, and torch's client retries a refused connect only after
a backoff of up to about a second, which every rank then waits for at the first barrier (a
warm run on three nodes took 0.4-0.9 s instead of 0.1 s). So the agent keeps a socket
listening on the port from the moment it reports it, and hands that socket to rank 0's
worker, whose store serves on it (``TCPStore(master_listen_fd=...)``): early connects wait
in its backlog instead.

The socket listens on the agent's own address toward its launcher (loopback for a localhost
launch): the address the agent reports in its hello, where the other ranks connect, and no
wider, as the store serves anyone who reaches it.
"""

from __future__ import annotations

import contextlib
import socket

__all__ = ["StorePort"]

# Every rank of a run connects to the store (capped by net.core.somaxconn).
BACKLOG = 8192


def _listening(host: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


class StorePort:
    """A free port, listening from the moment it is reported until a run's rank 0 takes it.

    Args:
        host: the address to listen on: the agent's own on its connection to the launcher.
    """

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self._sock: socket.socket | None = _listening(host)
        self._port = int(self._sock.getsockname()[1])

    @property
    def port(self) -> int:
        """The port to report (the same until it is taken or released)."""
        return self._port

    def held(self) -> bool:
        """Whether this agent still holds the listening socket of `port`."""
        return self._sock is not None

    def take(self) -> socket.socket:
        """Hands the listening socket over (to rank 0's worker); the caller closes its copy."""
        sock, self._sock = self._sock, None
        if sock is None:
            raise RuntimeError("the store port was already taken")  # a bug: spawn checks held()
        return sock

    def release(self) -> None:
        """Closes the socket, so that a script that binds ``MASTER_PORT`` itself can."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def renew(self) -> int:
        """The port for the next run: the same one while it is held, else a new one."""
        if self._sock is None:
            self._sock = _listening(self.host)
            self._port = int(self._sock.getsockname()[1])
        return self._port
