"""Authenticated, framed messages between launcher, agents and workers.

Every TCP connection starts with a mutual HMAC challenge over a per-launch secret; nothing a
peer sends is parsed beyond fixed-size handshake fields until it has proven the secret. After
that, a frame is::

    prefix   !4sIQI  magic, header length, body length, number of buffers
    lengths  !Q * n  one length per out-of-band buffer
    header   JSON    small routing fields (never pickled)
    body     bytes   a pickle (protocol 5), or empty
    buffers  bytes   the pickle's out-of-band buffers, raw

Large values (tensors, numpy arrays) travel as raw out-of-band buffers: they are written from
their own memory and received into preallocated buffers that the unpickled objects then wrap
without a copy. Buffers of `LARGE_BUFFER_BYTES` or more are private anonymous mappings, which
the kernel hands out as zero pages on first touch, so receiving one costs a single pass over
its memory (a ``bytearray`` is zero-filled first, then written again).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import io
import json
import mmap
import pickle
import secrets
import select
import socket
import struct
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

__all__ = [
    "AuthenticationError",
    "Connection",
    "Frame",
    "FrameError",
    "FrameHead",
    "bound_unacknowledged_sends",
    "client_handshake",
    "dumps",
    "dumps_inband",
    "loads",
    "new_secret",
    "server_handshake",
]

MAGIC = b"SRF1"
HANDSHAKE_MAGIC = b"SRH1"
NONCE_BYTES = 32
MAC_BYTES = 32  # sha256
MAX_HEADER_BYTES = 1 << 20
MAX_BUFFERS = 1 << 16
MAX_PAYLOAD_BYTES = 1 << 40
_PREFIX = struct.Struct("!4sIQI")
_RELAY_CHUNK = 1 << 22
LARGE_BUFFER_BYTES = 1 << 20

Buffer = bytearray | mmap.mmap

# Counts every call of `loads`: tests use it to prove that hostile peers never reach unpickling.
unpickle_count = 0


class AuthenticationError(ConnectionError):
    """The peer did not prove knowledge of the launch secret."""


class FrameError(ConnectionError):
    """A frame was malformed: wrong magic, or a length beyond the protocol's limits."""


def new_secret() -> bytes:
    """Returns a fresh random per-launch secret."""
    return secrets.token_bytes(32)


def _mac(secret: bytes, role: bytes, nonce_server: bytes, nonce_client: bytes) -> bytes:
    return hmac.new(secret, role + nonce_server + nonce_client, hashlib.sha256).digest()


def _alloc(n: int) -> Buffer:
    """A writable buffer of `n` bytes; large ones are mappings that skip the zero-fill pass."""
    if n >= LARGE_BUFFER_BYTES:
        with contextlib.suppress(OSError):  # e.g. vm.max_map_count reached: fall back
            return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return bytearray(n)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return buf


def _recv_buffer(sock: socket.socket, n: int) -> Buffer:
    buf = _alloc(n)
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


@contextlib.contextmanager
def _handshake_io(sock: socket.socket, timeout: float) -> Iterator[None]:
    """Bounds a handshake by `timeout` and reports any way it breaks as AuthenticationError."""
    sock.settimeout(timeout)
    try:
        yield
    except AuthenticationError:
        raise
    except (OSError, EOFError) as e:
        raise AuthenticationError(f"handshake broke off: {e}") from e
    finally:
        sock.settimeout(None)


def server_handshake(sock: socket.socket, secret: bytes, timeout: float) -> None:
    """Challenges a freshly accepted peer; raises AuthenticationError if it fails.

    The fields read are all fixed-size, and the whole exchange is bounded by `timeout`.
    """
    with _handshake_io(sock, timeout):
        nonce_s = secrets.token_bytes(NONCE_BYTES)
        sock.sendall(HANDSHAKE_MAGIC + nonce_s)
        reply = _recv_exact(sock, NONCE_BYTES + MAC_BYTES)
        nonce_c, mac_c = bytes(reply[:NONCE_BYTES]), bytes(reply[NONCE_BYTES:])
        if not hmac.compare_digest(mac_c, _mac(secret, b"client", nonce_s, nonce_c)):
            raise AuthenticationError("peer failed the HMAC challenge")
        sock.sendall(_mac(secret, b"server", nonce_s, nonce_c))


def client_handshake(sock: socket.socket, secret: bytes, timeout: float) -> None:
    """Answers the server's challenge and checks that the server knows the secret too."""
    with _handshake_io(sock, timeout):
        hello = _recv_exact(sock, len(HANDSHAKE_MAGIC) + NONCE_BYTES)
        if bytes(hello[: len(HANDSHAKE_MAGIC)]) != HANDSHAKE_MAGIC:
            raise AuthenticationError("server did not speak the slurmrun handshake")
        nonce_s = bytes(hello[len(HANDSHAKE_MAGIC) :])
        nonce_c = secrets.token_bytes(NONCE_BYTES)
        sock.sendall(nonce_c + _mac(secret, b"client", nonce_s, nonce_c))
        mac_s = bytes(_recv_exact(sock, MAC_BYTES))
        if not hmac.compare_digest(mac_s, _mac(secret, b"server", nonce_s, nonce_c)):
            raise AuthenticationError("server failed the HMAC challenge")


# ----------------------------------------------------------------------------- pickling


def _rebuild_tensor(
    data: Buffer | bytes | None, dtype: str, shape: tuple[int, ...], requires_grad: bool
) -> Any:
    import torch  # noqa: PLC0415 - only a value that holds tensors needs torch in the launcher

    torch_dtype = getattr(torch, dtype)
    if data is None or len(data) == 0:
        tensor = torch.empty(shape, dtype=torch_dtype)
    else:
        tensor = torch.frombuffer(data, dtype=torch.uint8).view(torch_dtype).reshape(shape)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle ships no type hints
    """cloudpickle, plus plain CPU/GPU tensors as raw out-of-band buffers on the CPU."""

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) in (torch.Tensor, torch.nn.Parameter):
            reduced = _reduce_tensor(torch, obj)
            if reduced is not None:
                return reduced
        return super().reducer_override(obj)


def _reduce_tensor(torch: Any, obj: Any) -> tuple[Any, ...] | None:
    if obj.layout != torch.strided or obj.is_quantized or obj.is_meta:
        return None
    t = obj.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    data = None if t.numel() == 0 else pickle.PickleBuffer(t.reshape(-1).view(torch.uint8).numpy())
    return (_rebuild_tensor, (data, dtype, tuple(t.shape), bool(obj.requires_grad)))


def dumps(obj: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Pickles `obj` with cloudpickle (protocol 5), keeping large buffers out of band."""
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    _Pickler(out, protocol=5, buffer_callback=buffers.append).dump(obj)
    return out.getvalue(), buffers


def dumps_inband(obj: Any) -> bytes:
    """Pickles `obj` like `dumps`, with every buffer inside the one returned bytes object."""
    out = io.BytesIO()
    _Pickler(out, protocol=5).dump(obj)
    return out.getvalue()


def loads(body: Buffer | bytes | memoryview, buffers: Sequence[Any] = ()) -> Any:
    """Unpickles what `dumps` produced. Call only on frames from authenticated peers."""
    global unpickle_count  # noqa: PLW0603 - a process-wide counter is exactly what tests need
    unpickle_count += 1
    return pickle.loads(body, buffers=buffers)  # noqa: S301 - the peer proved the launch secret


# ----------------------------------------------------------------------------- frames


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


def _encode_prefix(header: dict[str, Any], body_len: int, buffer_lens: Sequence[int]) -> bytes:
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    if len(header_bytes) > MAX_HEADER_BYTES:
        raise FrameError(f"frame header of {len(header_bytes)} bytes exceeds {MAX_HEADER_BYTES}")
    lens = struct.pack(f"!{len(buffer_lens)}Q", *buffer_lens)
    return _PREFIX.pack(MAGIC, len(header_bytes), body_len, len(buffer_lens)) + lens + header_bytes


def _read_prefix(sock: socket.socket) -> tuple[dict[str, Any], int, list[int]] | None:
    try:
        first = sock.recv(1)
    except ConnectionResetError:
        return None
    if not first:
        return None
    raw = first + bytes(_recv_exact(sock, _PREFIX.size - 1))
    magic, header_len, body_len, nbuf = _PREFIX.unpack(raw)
    if magic != MAGIC:
        raise FrameError("bad frame magic")
    if header_len > MAX_HEADER_BYTES or nbuf > MAX_BUFFERS or body_len > MAX_PAYLOAD_BYTES:
        raise FrameError("frame lengths beyond protocol limits")
    lens = list(struct.unpack(f"!{nbuf}Q", _recv_exact(sock, 8 * nbuf))) if nbuf else []
    if sum(lens) + body_len > MAX_PAYLOAD_BYTES:
        raise FrameError("frame payload beyond protocol limits")
    try:
        header = json.loads(bytes(_recv_exact(sock, header_len)))
    except ValueError as e:
        raise FrameError(f"frame header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise FrameError("frame header is not a JSON object")
    return header, body_len, lens


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
        buffers: Sequence[pickle.PickleBuffer | memoryview | bytes | bytearray] = (),
    ) -> None:
        """Sends one frame; buffers are written from their own memory."""
        views = [b.raw() if isinstance(b, pickle.PickleBuffer) else memoryview(b) for b in buffers]
        prefix = _encode_prefix(header, len(body), [v.nbytes for v in views])
        with self._send_lock:
            if len(body) < 1 << 16:
                self.sock.sendall(prefix + bytes(body))
            else:
                self.sock.sendall(prefix)
                self.sock.sendall(body)
            for v in views:
                self.sock.sendall(v.cast("B") if v.ndim != 1 or v.format != "B" else v)

    def recv(self) -> Frame | None:
        """Receives one frame; None when the peer closed the connection between frames."""
        head = _read_prefix(self.sock)
        if head is None:
            return None
        header, body_len, lens = head
        self.receiving = True
        try:
            body = _recv_buffer(self.sock, body_len)
            buffers = [_recv_buffer(self.sock, n) for n in lens]
        finally:
            self.receiving = False
        return Frame(header, body, buffers)

    def recv_head(self) -> FrameHead | None:
        """Reads the next frame's header only; its payload must then go to `forward`.

        None when the peer closed the connection between frames.
        """
        head = _read_prefix(self.sock)
        return None if head is None else FrameHead(*head)

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
