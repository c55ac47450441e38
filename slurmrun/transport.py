"""Framed messages between launcher, agents and workers, on sockets.

A connection carries frames once both ends passed the handshake (`slurmrun.authentication`).
A frame is::

    prefix   !4sIQI  magic, header length, body length, number of buffers
    lengths  !Q * n  one length per out-of-band buffer
    header   JSON    small routing fields (never pickled)
    body     bytes   a pickle (protocol 5, `slurmrun.pickling`), or empty
    buffers  bytes   the pickle's out-of-band buffers, raw

Buffers are written from their own memory (a GPU's in pinned chunks, `slurmrun.device_bytes`)
and received into preallocated buffers. Buffers of `LARGE_BUFFER_BYTES` or more are private
anonymous mappings, which the kernel hands out as zero pages on first touch, so receiving one
costs a single pass over its memory (a ``bytearray`` is zero-filled first, then written again).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import pickle
import select
import socket
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from slurmrun.device_bytes import DeviceBytes

__all__ = [
    "LARGE_BUFFER_BYTES",
    "PREFIX_BYTES",
    "Buffer",
    "Connection",
    "Frame",
    "FrameError",
    "FrameHead",
    "OutOfBand",
    "alloc",
    "bound_unacknowledged_sends",
    "encode_frame",
    "nbytes",
    "parse_header",
    "parse_lengths",
    "parse_prefix",
    "recv_exact",
]

MAGIC = b"SRF1"
MAX_HEADER_BYTES = 1 << 20
MAX_BUFFERS = 1 << 16
MAX_PAYLOAD_BYTES = 1 << 40
_PREFIX = struct.Struct("!4sIQI")
PREFIX_BYTES = _PREFIX.size
_RELAY_CHUNK = 1 << 22
LARGE_BUFFER_BYTES = 1 << 20
_JSON = json.JSONDecoder()

Buffer = bytearray | mmap.mmap
# An out-of-band buffer as `slurmrun.pickling.dumps` returns it: CPU bytes, or a CUDA
# storage's, sent in chunks.
OutOfBand = pickle.PickleBuffer | DeviceBytes


class FrameError(ConnectionError):
    """A frame was malformed: wrong magic, or a length beyond the protocol's limits."""


def alloc(n: int) -> Buffer:
    """A writable buffer of `n` bytes; large ones are mappings that skip the zero-fill pass."""
    if n >= LARGE_BUFFER_BYTES:
        with contextlib.suppress(OSError):  # e.g. vm.max_map_count reached: fall back
            return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return bytearray(n)


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Exactly `n` bytes from `sock`; EOFError when the peer closes before."""
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return buf


def _recv_buffer(sock: socket.socket, n: int) -> Buffer:
    buf = alloc(n)
    _recv_into(sock, memoryview(buf))
    return buf


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, 1 << 30))
        if k == 0:
            raise EOFError("peer closed the connection")
        got += k


@dataclass
class Frame:
    """One received message: a JSON header, and a pickled body with its raw buffers."""

    header: dict[str, Any]
    body: Buffer = field(default_factory=bytearray)
    buffers: list[Buffer] = field(default_factory=list)

    @property
    def kind(self) -> str:
        """The message type (``header["t"]``)."""
        return str(self.header.get("t", ""))


@dataclass
class FrameHead:
    """A frame whose header was read and whose payload is still on the socket (for relays)."""

    header: dict[str, Any]
    body_len: int
    buffer_lens: list[int]

    @property
    def kind(self) -> str:
        """The message type (``header["t"]``)."""
        return str(self.header.get("t", ""))

    @property
    def payload_bytes(self) -> int:
        """Bytes of pickle and raw buffers that follow the header."""
        return self.body_len + sum(self.buffer_lens)


def encode_frame(header: dict[str, Any], body: bytes = b"") -> bytes:
    """One whole frame without out-of-band buffers, as bytes (for senders that cannot block)."""
    return _encode_prefix(header, len(body), []) + body


def _encode_prefix(header: dict[str, Any], body_len: int, buffer_lens: Sequence[int]) -> bytes:
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    if len(header_bytes) > MAX_HEADER_BYTES:
        raise FrameError(f"frame header of {len(header_bytes)} bytes exceeds {MAX_HEADER_BYTES}")
    lens = struct.pack(f"!{len(buffer_lens)}Q", *buffer_lens)
    return _PREFIX.pack(MAGIC, len(header_bytes), body_len, len(buffer_lens)) + lens + header_bytes


def parse_prefix(raw: bytes | bytearray | memoryview) -> tuple[int, int, int]:
    """A frame's fixed-size prefix (`PREFIX_BYTES`) -> header length, body length, buffers.

    Raises:
        FrameError: wrong magic, or lengths beyond the protocol's limits.
    """
    magic, header_len, body_len, nbuf = _PREFIX.unpack(raw)
    if magic != MAGIC:
        raise FrameError("bad frame magic")
    if header_len > MAX_HEADER_BYTES or nbuf > MAX_BUFFERS or body_len > MAX_PAYLOAD_BYTES:
        raise FrameError("frame lengths beyond protocol limits")
    return header_len, body_len, nbuf


def parse_lengths(raw: bytes | bytearray | memoryview, body_len: int) -> list[int]:
    """The buffer lengths that follow the prefix (8 bytes each), checked against the limits."""
    lens = list(struct.unpack(f"!{len(raw) // 8}Q", raw)) if raw else []
    if sum(lens) + body_len > MAX_PAYLOAD_BYTES:
        raise FrameError("frame payload beyond protocol limits")
    return lens


def parse_header(raw: bytes | bytearray | memoryview) -> dict[str, Any]:
    """A frame's JSON header, which must be an object."""
    try:
        # Not json.loads: its checks around the decoder cost more than decoding a header.
        text = str(raw, "utf-8")
        header, end = _JSON.raw_decode(text)
    except ValueError as e:
        raise FrameError(f"frame header is not JSON: {e}") from e
    if end != len(text):
        raise FrameError("frame header is not JSON: extra data after the object")
    if not isinstance(header, dict):
        raise FrameError("frame header is not a JSON object")
    return header


def _read_prefix(sock: socket.socket) -> tuple[dict[str, Any], int, list[int]] | None:
    try:
        first = sock.recv(1)
    except ConnectionResetError:
        return None
    if not first:
        return None
    header_len, body_len, nbuf = parse_prefix(first + bytes(recv_exact(sock, PREFIX_BYTES - 1)))
    lens = parse_lengths(recv_exact(sock, 8 * nbuf), body_len) if nbuf else []
    return parse_header(recv_exact(sock, header_len)), body_len, lens


def nbytes(buffer: OutOfBand | memoryview) -> int:
    """The length of an out-of-band buffer, on the host or on a GPU."""
    if isinstance(buffer, DeviceBytes):
        return buffer.nbytes
    return (buffer.raw() if isinstance(buffer, pickle.PickleBuffer) else buffer).nbytes


def _view(buffer: OutOfBand | memoryview | bytes | bytearray) -> DeviceBytes | memoryview:
    if isinstance(buffer, DeviceBytes):
        return buffer
    return buffer.raw() if isinstance(buffer, pickle.PickleBuffer) else memoryview(buffer)


class Connection:
    """A socket that carries frames; sending is thread-safe, receiving is for one reader."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        self.receiving = False  # True while a frame's payload is arriving (liveness checks)

    def send(
        self,
        header: dict[str, Any],
        body: bytes | bytearray | memoryview = b"",
        buffers: Sequence[OutOfBand | memoryview | bytes | bytearray] = (),
    ) -> None:
        """Sends one frame; buffers are written from their own memory (a GPU's in chunks)."""
        views = [_view(b) for b in buffers]
        prefix = _encode_prefix(header, len(body), [nbytes(v) for v in views])
        with self._send_lock:
            if len(body) < 1 << 16:
                self.sock.sendall(prefix + bytes(body))
            else:
                self.sock.sendall(prefix)
                self.sock.sendall(body)
            for v in views:
                if isinstance(v, DeviceBytes):
                    v.send_to(self.sock)
                else:
                    self.sock.sendall(v.cast("B") if v.ndim != 1 or v.format != "B" else v)

    def recv(self) -> Frame | None:
        """Receives one frame; None when the peer closed the connection between frames."""
        head = self.recv_head()
        return None if head is None else self.recv_payload(head)

    def recv_head(self) -> FrameHead | None:
        """Reads the next frame's header only; its payload must then go to `forward`.

        None when the peer closed the connection between frames.
        """
        head = _read_prefix(self.sock)
        return None if head is None else FrameHead(*head)

    def recv_payload(self, head: FrameHead) -> Frame:
        """Reads the payload of `head` (from `recv_head`): the whole frame, as `recv` gives it."""
        self.receiving = True
        try:
            body = _recv_buffer(self.sock, head.body_len)
            buffers = [_recv_buffer(self.sock, n) for n in head.buffer_lens]
        finally:
            self.receiving = False
        return Frame(head.header, body, buffers)

    def forward(self, head: FrameHead, dst: Connection) -> None:
        """Sends `head` (its header possibly edited) and then its payload, unread, to `dst`.

        The payload streams through a fixed-size buffer, so relaying costs no memory beyond it
        and nothing is unpickled.
        """
        prefix = _encode_prefix(head.header, head.body_len, head.buffer_lens)
        remaining = head.payload_bytes
        chunk = memoryview(bytearray(min(max(remaining, 1), _RELAY_CHUNK)))
        with dst._send_lock:
            dst.sock.sendall(prefix)
            while remaining:
                k = self.sock.recv_into(chunk, min(remaining, len(chunk)))
                if k == 0:
                    raise EOFError("peer closed the connection in the middle of a frame")
                dst.sock.sendall(chunk[:k])
                remaining -= k

    def close(self) -> None:
        """Closes the socket (idempotent)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def send_nowait(self, header: dict[str, Any]) -> bool:
        """Sends a small header-only frame unless that would wait; True if it was sent.

        It would wait while another thread sends on this connection, or while the socket's
        send buffer is full (a peer that stopped reading, or vanished).
        """
        if not self._send_lock.acquire(blocking=False):
            return False
        try:
            poller = select.poll()
            poller.register(self.sock.fileno(), select.POLLOUT)
            if not poller.poll(0):
                return False
            self.sock.sendall(_encode_prefix(header, 0, []))
            return True
        finally:
            self._send_lock.release()


def bound_unacknowledged_sends(sock: socket.socket, seconds: float) -> None:
    """Makes the kernel drop the connection when what was sent stays unacknowledged that long.

    Without it, a peer whose host vanished (no FIN, no RST) is retransmitted to for about 15
    minutes (tcp_retries2) and a blocked send waits as long. Linux only; elsewhere a no-op.
    """
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    if option is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, option, max(1, int(seconds * 1000)))
