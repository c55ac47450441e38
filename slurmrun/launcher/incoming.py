"""One connection to the launcher, read without blocking: the handshake, then frames.

The launcher reads all its connections from one thread (`slurmrun.launcher.listener`): 4096 agents
are 4096 connections, and a thread each would spend the launch contending for the GIL. So a
connection here is a state machine that is fed whatever bytes arrived, one ``recv`` per
readiness: first exactly the handshake's reply (nothing else is read before the peer proved
the secret), then frames, cut out of a read-ahead buffer (one ``recv`` brings many small
frames: log lines, results). A frame's payload goes into its final buffer (`alloc`: large
ones are anonymous mappings); one that is still `HANDOFF_BYTES` or more once its header is in
is left to a thread of its own (`receive_rest`, blocking), so that large results from many
workers still arrive in parallel.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

from slurmrun.authentication import HandshakeBrokeOff, ServerChallenge
from slurmrun.transport import (
    LARGE_BUFFER_BYTES,
    PREFIX_BYTES,
    Buffer,
    Connection,
    Frame,
    alloc,
    bound_unacknowledged_sends,
    parse_header,
    parse_lengths,
    parse_prefix,
)

__all__ = ["HANDOFF_BYTES", "Incoming"]

HANDOFF_BYTES = LARGE_BUFFER_BYTES  # payload left to receive that a thread of its own takes
READ_BYTES = 1 << 18  # read-ahead per recv
_DIRECT_BYTES = 1 << 16  # payload left that is received straight into its buffer
# Where each reading thread receives into: ``recv(READ_BYTES)`` would allocate (and map) a
# fresh READ_BYTES object per call, about five times the cost of the small reads it serves.
_scratch = threading.local()


def _scratch_view() -> memoryview:
    view: memoryview | None = getattr(_scratch, "view", None)
    if view is None:
        view = _scratch.view = memoryview(bytearray(READ_BYTES))
    return view


class Incoming:
    """An accepted connection: its handshake, then the frames it sends.

    Args:
        sock: the accepted socket (blocking; reads here pass ``MSG_DONTWAIT``).
        peer: its address, for messages.
        secret: what the peer must prove.
        silence: the agents' heartbeat timeout (bounds unacknowledged sends once accepted).
        deadline: when the handshake must be done (monotonic clock).
    """

    def __init__(
        self, sock: socket.socket, peer: Any, secret: bytes, silence: float, deadline: float
    ) -> None:
        self.sock = sock
        self.peer = peer
        # Its address without the port: what a flood from one host has in common.
        self.source = str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)
        self.deadline = deadline
        self.conn: Connection | None = None  # once the peer proved the secret
        self.handoff = False  # a large payload is pending: `receive_rest` takes it
        self._silence = silence
        self._challenge: ServerChallenge | None = ServerChallenge(secret)
        self._reply = bytearray()
        self._ahead = bytearray()  # bytes received and not yet cut into frames
        self._pos = 0  # how much of `_ahead` was used
        self._header: dict[str, Any] | None = None  # the frame being received
        self._parts: list[Buffer] = []
        self._part = 0  # which of `_parts` is being filled, and how far
        self._filled = 0

    # ------------------------------------------------------------------ handshake
    def greet(self) -> None:
        """Sends the challenge (it fits any fresh socket's buffer, so this never waits)."""
        assert self._challenge is not None  # noqa: S101 - called once, before any read
        greeting = self._challenge.greeting
        if self.sock.send(greeting, socket.MSG_DONTWAIT) != len(greeting):
            raise HandshakeBrokeOff("the challenge did not fit")

    def _read_reply(self) -> bool:
        assert self._challenge is not None  # noqa: S101 - only during the handshake
        try:
            data = self.sock.recv(
                ServerChallenge.REPLY_BYTES - len(self._reply), socket.MSG_DONTWAIT
            )
        except BlockingIOError:
            return True
        except OSError as e:
            raise HandshakeBrokeOff(str(e)) from e
        if not data:
            raise HandshakeBrokeOff("peer closed the connection")
        self._reply += data
        if len(self._reply) < ServerChallenge.REPLY_BYTES:
            return True
        proof = self._challenge.answer(self._reply)  # raises for a wrong answer
        self._challenge = None
        try:
            self.sock.sendall(proof)  # 32 bytes, into an empty buffer
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            bound_unacknowledged_sends(self.sock, self._silence)
        except OSError as e:
            raise HandshakeBrokeOff(str(e)) from e
        self.conn = Connection(self.sock)
        return True

    # ------------------------------------------------------------------ frames
    def read(self) -> tuple[list[Frame], bool]:
        """Takes what arrived (one recv): the frames it completed, and whether it is open.

        Open is False when the peer closed the connection between frames.

        Raises:
            AuthenticationError: the peer's proof was wrong (`HandshakeBrokeOff`: the
                handshake ended before it proved anything).
            FrameError: a malformed frame.
            EOFError: the peer closed the connection in the middle of a frame.
            OSError: the connection broke.
        """
        if self._challenge is not None:
            return [], self._read_reply()
        try:
            got = self._receive()
        except BlockingIOError:
            return [], True
        except ConnectionResetError:
            if self._header is not None or self._pos < len(self._ahead):
                raise
            return [], False  # as a reset between frames ends a blocking reader: a close
        if got == 0:
            if self._header is not None or self._pos < len(self._ahead):
                raise EOFError("peer closed the connection in the middle of a frame")
            return [], False
        return self._cut(), True

    def _receive(self) -> int:
        if self._header is not None and self._pos == len(self._ahead):
            part = self._parts[self._part]
            left = len(part) - self._filled
            if left >= _DIRECT_BYTES:  # straight into the payload's own buffer
                view = memoryview(part)[self._filled :]
                got = self.sock.recv_into(view, min(left, 1 << 30), socket.MSG_DONTWAIT)
                self._filled += got
                self._skip_full()
                return got
        if self._pos == len(self._ahead):
            self._ahead.clear()
            self._pos = 0
        elif self._pos > READ_BYTES:
            del self._ahead[: self._pos]  # rarely: a header that arrives in pieces
            self._pos = 0
        scratch = _scratch_view()
        got = self.sock.recv_into(scratch, READ_BYTES, socket.MSG_DONTWAIT)
        self._ahead += scratch[:got]
        return got

    def _cut(self) -> list[Frame]:
        frames: list[Frame] = []
        ahead = self._ahead
        while True:
            if self._header is None:
                if len(ahead) - self._pos < PREFIX_BYTES:
                    break
                start = self._pos
                with memoryview(ahead) as view:
                    header_len, body_len, nbuf = parse_prefix(view[start : start + PREFIX_BYTES])
                    lens_end = start + PREFIX_BYTES + 8 * nbuf
                    end = lens_end + header_len
                    if len(ahead) < end:
                        break
                    lens = parse_lengths(view[start + PREFIX_BYTES : lens_end], body_len)
                    header = parse_header(view[lens_end:end])
                self._pos = end
                payload = body_len + sum(lens)
                if payload < _DIRECT_BYTES and len(ahead) - end >= payload:
                    frames.append(self._whole(header, body_len, lens))  # most frames
                    continue
                self._begin(header, body_len, lens)
            self._take_ahead()
            if self._part == len(self._parts):
                frames.append(self._finish())
                continue
            left = len(self._parts[self._part]) - self._filled
            left += sum(len(p) for p in self._parts[self._part + 1 :])
            self.handoff = left >= HANDOFF_BYTES
            break
        return frames

    def _whole(self, header: dict[str, Any], body_len: int, lens: list[int]) -> Frame:
        """A small frame whose payload is all in the read-ahead buffer: sliced off it."""
        ahead, pos = self._ahead, self._pos
        body = ahead[pos : pos + body_len]
        pos += body_len
        buffers: list[Buffer] = []
        for n in lens:
            buffers.append(ahead[pos : pos + n])
            pos += n
        self._pos = pos
        return Frame(header, body, buffers)

    def _begin(self, header: dict[str, Any], body_len: int, lens: list[int]) -> None:
        self._header = header
        self._parts = [alloc(body_len), *(alloc(n) for n in lens)]
        self._part = 0
        self._filled = 0
        self._skip_full()
        if self.conn is not None:
            self.conn.receiving = self._part < len(self._parts)

    def _skip_full(self) -> None:
        while self._part < len(self._parts) and self._filled == len(self._parts[self._part]):
            self._part += 1
            self._filled = 0

    def _take_ahead(self) -> None:
        """Moves read-ahead bytes into the current frame's buffers."""
        while self._part < len(self._parts) and self._pos < len(self._ahead):
            part = self._parts[self._part]
            n = min(len(part) - self._filled, len(self._ahead) - self._pos)
            with memoryview(part) as dst, memoryview(self._ahead) as src:
                dst[self._filled : self._filled + n] = src[self._pos : self._pos + n]
            self._filled += n
            self._pos += n
            self._skip_full()
        self._skip_full()

    def _finish(self) -> Frame:
        assert self._header is not None  # noqa: S101 - a frame was begun
        frame = Frame(self._header, self._parts[0], self._parts[1:])
        self._header, self._parts, self._part, self._filled = None, [], 0, 0
        if self.conn is not None:
            self.conn.receiving = False
        return frame

    def receive_rest(self) -> Frame:
        """Receives the rest of a large frame, blocking (on a thread of its own).

        Raises:
            EOFError: the peer closed the connection before the frame was whole.
            OSError: the connection broke.
        """
        while self._part < len(self._parts):
            view = memoryview(self._parts[self._part])[self._filled :]
            got = self.sock.recv_into(view, min(len(view), 1 << 30))
            if got == 0:
                raise EOFError("peer closed the connection in the middle of a frame")
            self._filled += got
            self._skip_full()
        self.handoff = False
        return self._finish()
