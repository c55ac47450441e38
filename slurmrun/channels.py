"""Many byte streams over one pair of pipes: how a launcher reaches a keeper through srun.

Where the nodes and the login node cannot reach each other's ports, the one way in is the
stdin and stdout of ``srun --jobid J --overlap`` (SLURM authenticates it by uid). The
launcher's side (`slurmrun.launcher.agents.reserved_relay`) and the relay on the keeper's node
(`slurmrun.node.keeper_relay`) carry each TCP connection of a launcher to the keeper as a
channel: a chunk is ``channel (4 bytes) | length (4 bytes) | bytes``; a length of 0 opens
the channel (the keeper speaks first: the relay must connect before any byte comes), and one
of `CLOSED` ends it. The relay writes each chunk as a line of base64: slurmstepd passes a
task's output on by lines (a chunk without a newline would wait there). Each side turns a
channel into a socket (the relay: a connection to the keeper; the launcher: one end of a
socketpair), so what runs over them (the HMAC handshake, frames) does not know it is
relayed. Standard library only: the relay runs it on the node before anything else.
"""

from __future__ import annotations

import base64
import contextlib
import os
import socket
import struct
import threading
from collections.abc import Callable

__all__ = ["CLOSED", "Mux"]

_HEAD = struct.Struct(">II")
CLOSED = 0xFFFFFFFF  # the length that ends a channel
_CHUNK = 1 << 16


def _read_exactly(fd: int, n: int) -> bytes | None:
    """`n` bytes from `fd`; None at end-of-file."""
    parts: list[bytes] = []
    while n:
        part = os.read(fd, n)
        if not part:
            return None
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


class Mux:
    """The channels over one pipe pair: `pump` reads the pipe, a thread per channel the socket.

    Args:
        read_fd: the pipe the other side writes.
        write_fd: the pipe the other side reads.
        opened: makes the socket of a channel the other side opened (None: it may not).
        lines_in: the other side writes chunks as lines (the relay's output, through srun).
        lines_out: this side writes them so (the relay).
    """

    def __init__(
        self,
        read_fd: int,
        write_fd: int,
        opened: Callable[[int], socket.socket | None] | None = None,
        *,
        lines_in: bool = False,
        lines_out: bool = False,
    ) -> None:
        self.read_fd = read_fd
        self.write_fd = write_fd
        self.opened = opened
        self.lines_in = lines_in
        self.lines_out = lines_out
        self._lines = os.fdopen(read_fd, "rb", closefd=False) if lines_in else None
        self.channels: dict[int, socket.socket] = {}
        self._write_lock = threading.Lock()
        self._lock = threading.Lock()
        self._next = 0  # the last channel this side opened
        self._highest = 0  # the last channel the other side opened (ids are never reused)

    def open(self) -> socket.socket:
        """A new channel, as a socket of this side's (the other side connects it)."""
        ours, theirs = socket.socketpair()
        with self._lock:
            self._next += 1
            channel = self._next
        self._add(channel, theirs)
        with self._write_lock:
            self._write(_HEAD.pack(channel, 0))
        return ours

    def _add(self, channel: int, sock: socket.socket) -> None:
        with self._lock:
            self.channels[channel] = sock
        threading.Thread(target=self._from_socket, args=(channel, sock), daemon=True).start()

    def _send(self, channel: int, data: bytes) -> None:
        """`data` on `channel`; no data: the channel ends."""
        length = CLOSED if not data else len(data)
        with self._write_lock:
            self._write(_HEAD.pack(channel, length) + data)

    def _write(self, chunk: bytes) -> None:
        if self.lines_out:
            chunk = base64.b64encode(chunk) + b"\n"
        view = memoryview(chunk)
        while view:
            view = view[os.write(self.write_fd, view) :]

    def _from_socket(self, channel: int, sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := sock.recv(_CHUNK):
                self._send(channel, data)
        with contextlib.suppress(OSError):
            self._send(channel, b"")  # closed
        self._forget(channel)

    def _forget(self, channel: int) -> None:
        with self._lock:
            sock = self.channels.pop(channel, None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _next_chunk(self) -> tuple[int, int, bytes] | None:
        """The next chunk: its channel, its length field and its bytes; None at the end."""
        if self._lines is not None:
            line = self._lines.readline()
            if not line.endswith(b"\n"):
                return None
            raw = base64.b64decode(line)
            channel, length = _HEAD.unpack_from(raw)
            return channel, length, raw[_HEAD.size :]
        head = _read_exactly(self.read_fd, _HEAD.size)
        if head is None:
            return None
        channel, length = _HEAD.unpack(head)
        if length in {0, CLOSED}:
            return channel, length, b""
        data = _read_exactly(self.read_fd, length)
        return None if data is None else (channel, length, data)

    def pump(self) -> None:
        """Carries the pipe's chunks to their channels until the pipe ends (then ends them)."""
        try:
            while (chunk := self._next_chunk()) is not None:
                channel, length, data = chunk
                if length == CLOSED:
                    self._forget(channel)
                    continue
                with self._lock:
                    sock = self.channels.get(channel)
                if sock is None and self.opened is not None and channel > self._highest:
                    self._highest = channel
                    sock = self.opened(channel)
                    if sock is None:
                        with contextlib.suppress(OSError):
                            self._send(channel, b"")
                        continue
                    self._add(channel, sock)
                if sock is not None and data:
                    try:
                        sock.sendall(data)
                    except OSError:
                        self._forget(channel)
        finally:
            with self._lock:
                channels = list(self.channels)
            for channel in channels:
                self._forget(channel)
