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

Tensors need no numpy (torch does not depend on it): a dense tensor is sent as its storage's
bytes, read in place through a ``ctypes`` array over the storage's address that holds a
reference to the storage, and rebuilt with its dtype, offset, shape and strides on a storage
that wraps the received buffer. Every dtype works (bfloat16, bool, complex, float8...), and
so do views: tensors of one storage in one pickled object share one buffer, and arrive sharing
one storage again. A Parameter stays a Parameter; ``requires_grad`` is kept (a non-leaf
arrives as a leaf, as after ``detach().requires_grad_()``); a conjugate view stays one. GPU
tensors arrive on the CPU: each CUDA storage's bytes go to the host in pinned chunks while
they are sent (`slurmrun.device_bytes`; in an in-band pickle, in one copy). Tensors that
are not plain dense ones (sparse, quantized, nested, subclasses, with attributes of their own)
are pickled as torch pickles them.

Only the bytes the tensors use are sent. `torch.save` sends whole storages, so a small view of
a huge tensor (``logits[:, -1]``) silently costs the whole; here each storage is cut to the
range its tensors in this object span (from the lowest to the highest byte any of them
reaches, so sharing survives). Finding that range takes a pass over the object first, so the
pickle is made twice when the cut saves `TRIM_MIN_BYTES` or more, and when the first pass
would have to copy (GPU storages, in-band pickles): the first pass then sends placeholders.
"""

from __future__ import annotations

import contextlib
import ctypes
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

from slurmrun.device_bytes import DeviceBytes
from slurmrun.torch_import import import_torch

__all__ = [
    "PREFIX_BYTES",
    "AuthenticationError",
    "ClientChallenge",
    "Connection",
    "Frame",
    "FrameError",
    "FrameHead",
    "HandshakeBrokeOff",
    "HandshakeTimeout",
    "OutOfBand",
    "ServerChallenge",
    "alloc",
    "bound_unacknowledged_sends",
    "client_handshake",
    "dumps",
    "dumps_inband",
    "encode_frame",
    "loads",
    "nbytes",
    "new_secret",
    "parse_header",
    "parse_lengths",
    "parse_prefix",
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
PREFIX_BYTES = _PREFIX.size
_RELAY_CHUNK = 1 << 22
LARGE_BUFFER_BYTES = 1 << 20
_JSON = json.JSONDecoder()

Buffer = bytearray | mmap.mmap
# An out-of-band buffer as `dumps` returns it: CPU bytes, or a CUDA storage's, sent in chunks.
OutOfBand = pickle.PickleBuffer | DeviceBytes

# Counts every call of `loads`: tests use it to prove that hostile peers never reach unpickling.
unpickle_count = 0


class AuthenticationError(ConnectionError):
    """The peer did not prove knowledge of the launch secret.

    Raised as such for a wrong proof (final: a wrong secret stays wrong); as
    `HandshakeBrokeOff` when the handshake ended before any proof (worth another try).
    """


class HandshakeBrokeOff(AuthenticationError):
    """The handshake ended before a proof was checked: closed, reset, dropped or timed out.

    Nothing says the secrets differ: a client tries again (a launcher crowded by strangers
    drops their oldest pending handshakes, and ends those past its deadline).
    """


class HandshakeTimeout(HandshakeBrokeOff):
    """The peer did not answer within the handshake's deadline."""


class FrameError(ConnectionError):
    """A frame was malformed: wrong magic, or a length beyond the protocol's limits."""


def new_secret() -> bytes:
    """Returns a fresh random per-launch secret."""
    return secrets.token_bytes(32)


def _mac(secret: bytes, role: bytes, nonce_server: bytes, nonce_client: bytes) -> bytes:
    return hmac.new(secret, role + nonce_server + nonce_client, hashlib.sha256).digest()


def alloc(n: int) -> Buffer:
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


@contextlib.contextmanager
def _handshake_io(sock: socket.socket, timeout: float) -> Iterator[None]:
    """Bounds a handshake by `timeout`; any way it breaks becomes `HandshakeBrokeOff`."""
    sock.settimeout(timeout)
    try:
        yield
    except AuthenticationError:
        raise
    except TimeoutError as e:
        raise HandshakeTimeout(f"handshake timed out after {timeout:g} s") from e
    except (OSError, EOFError) as e:
        raise HandshakeBrokeOff(f"handshake broke off: {e}") from e
    finally:
        sock.settimeout(None)


class ServerChallenge:
    """The server's side of the handshake as two steps, for readers that cannot block.

    Send `greeting`; read exactly `REPLY_BYTES`; `answer` checks them and returns what to
    send back (or raises AuthenticationError). Nothing else from the peer is read before.
    """

    REPLY_BYTES = NONCE_BYTES + MAC_BYTES

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._nonce = secrets.token_bytes(NONCE_BYTES)
        self.greeting = HANDSHAKE_MAGIC + self._nonce

    def answer(self, reply: bytes | bytearray) -> bytes:
        """The server's proof, once the peer's `reply` proved the secret."""
        nonce_c, mac_c = bytes(reply[:NONCE_BYTES]), bytes(reply[NONCE_BYTES:])
        if not hmac.compare_digest(mac_c, _mac(self._secret, b"client", self._nonce, nonce_c)):
            raise AuthenticationError("peer failed the HMAC challenge")
        return _mac(self._secret, b"server", self._nonce, nonce_c)


def server_handshake(sock: socket.socket, secret: bytes, timeout: float) -> None:
    """Challenges a freshly accepted peer; raises AuthenticationError if it fails.

    The fields read are all fixed-size, and the whole exchange is bounded by `timeout`.
    """
    with _handshake_io(sock, timeout):
        challenge = ServerChallenge(secret)
        sock.sendall(challenge.greeting)
        sock.sendall(challenge.answer(_recv_exact(sock, ServerChallenge.REPLY_BYTES)))


class ClientChallenge:
    """The client's side of the handshake as two steps, for callers that cannot block.

    Read exactly `GREETING_BYTES`; send what `reply` returns; read exactly `PROOF_BYTES`;
    `check` them (each raises AuthenticationError when the server fails).
    """

    GREETING_BYTES = len(HANDSHAKE_MAGIC) + NONCE_BYTES
    PROOF_BYTES = MAC_BYTES

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._nonces = (b"", b"")

    def reply(self, greeting: bytes | bytearray) -> bytes:
        """What to send the server, proving the secret, for its `greeting`."""
        if bytes(greeting[: len(HANDSHAKE_MAGIC)]) != HANDSHAKE_MAGIC:
            raise AuthenticationError("server did not speak the slurmrun handshake")
        nonce_s = bytes(greeting[len(HANDSHAKE_MAGIC) :])
        nonce_c = secrets.token_bytes(NONCE_BYTES)
        self._nonces = (nonce_s, nonce_c)
        return nonce_c + _mac(self._secret, b"client", nonce_s, nonce_c)

    def check(self, proof: bytes | bytearray) -> None:
        """Checks that the server, whose `proof` this is, knows the secret too."""
        expected = _mac(self._secret, b"server", *self._nonces)
        if not self._nonces[0] or not hmac.compare_digest(bytes(proof), expected):
            raise AuthenticationError("server failed the HMAC challenge")


def client_handshake(sock: socket.socket, secret: bytes, timeout: float) -> None:
    """Answers the server's challenge and checks that the server knows the secret too.

    A server closes, without a word, on a wrong proof of ours: a client with a wrong secret
    sees `HandshakeBrokeOff` (strangers learn nothing but the challenge).

    Raises:
        AuthenticationError: the server failed its proof (final).
        HandshakeTimeout: the server did not answer within `timeout` (e.g. it was crowded).
        HandshakeBrokeOff: the connection ended or broke before a proof (try again).
    """
    with _handshake_io(sock, timeout):
        challenge = ClientChallenge(secret)
        sock.sendall(challenge.reply(_recv_exact(sock, ClientChallenge.GREETING_BYTES)))
        challenge.check(_recv_exact(sock, ClientChallenge.PROOF_BYTES))


# ----------------------------------------------------------------------------- pickling


_ALIGN = 16  # the largest element size (complex128): rebased offsets stay whole numbers
TRIM_MIN_BYTES = LARGE_BUFFER_BYTES  # unused storage bytes worth a second pickling pass

_StorageKey = tuple[str, int, int]  # device, address, bytes
_Deferred = dict[int, tuple[bytearray, DeviceBytes]]  # id(placeholder) -> (placeholder, bytes)


class _Storage:
    """A tensor storage (its bytes `lo:hi`), pickled once however many tensors view it."""

    def __init__(self, storage: Any, lo: int, hi: int) -> None:
        self.storage = storage
        self.lo = lo
        self.hi = hi

    def reduce(self, torch: Any, deferred: _Deferred | None) -> tuple[Any, ...]:
        """`deferred`: where CUDA storages go instead of being copied (out-of-band pickles)."""
        storage, lo, n = self.storage, self.lo, self.hi - self.lo
        if deferred is not None and storage.device.type == "cuda":
            # An empty placeholder buffer, which the buffer callback swaps for the device's bytes.
            marker = bytearray()
            deferred[id(marker)] = (marker, DeviceBytes(storage, lo, n))
            return (_rebuild_storage, (pickle.PickleBuffer(marker),))
        if storage.device.type != "cpu":
            # One copy of the used bytes to the CPU; every view of the storage rebuilds on it.
            part = torch.empty((0,), dtype=torch.uint8, device=storage.device)
            storage, lo = part.set_(storage, lo, (n,), (1,)).cpu().untyped_storage(), 0
        raw = (ctypes.c_ubyte * n).from_address(storage.data_ptr() + lo)
        raw._slurmrun_owner = storage  # type: ignore[attr-defined]  # the memory's owner lives on
        return (_rebuild_storage, (pickle.PickleBuffer(raw),))


def _rebuild_storage(data: Any) -> Any:
    torch = import_torch()  # only a value that holds tensors needs torch in the launcher

    if memoryview(data).nbytes == 0:
        return torch.empty((0,), dtype=torch.uint8).untyped_storage()
    return torch.frombuffer(data, dtype=torch.uint8).untyped_storage()


def _rebuild_tensor(  # noqa: PLR0917 - pickle calls it with positional arguments
    storage: Any,
    dtype: str,
    offset: int,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
    parameter: bool,
    conj: bool,
) -> Any:
    torch = import_torch()  # only a value that holds tensors needs torch in the launcher

    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise TypeError(f"not a torch dtype: {dtype!r}")
    if storage is None:
        tensor = torch.empty_strided(shape, stride, dtype=torch_dtype)
    else:
        tensor = torch.empty((0,), dtype=torch_dtype).set_(storage, offset, shape, stride)
    if conj:
        tensor = tensor.conj()
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_() if requires_grad else tensor


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle ships no type hints
    """cloudpickle, plus plain CPU/GPU tensors as their storages' raw bytes, out of band.

    `spans` (storage key -> byte range to send) comes from a first pass over the same object,
    which records in `used` which bytes its tensors need. In that first pass, storages are
    whole, and those that would cost a copy (on a GPU, or in band) are empty placeholders.
    """

    def __init__(
        self,
        file: io.BytesIO,
        buffer_callback: Any = None,
        spans: dict[_StorageKey, tuple[int, int]] | None = None,
        deferred: _Deferred | None = None,
    ) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffer_callback)
        self.spans = spans
        self.used: dict[_StorageKey, list[int]] = {}  # key -> [lo, hi]
        self.placeholders = False
        self._in_band = buffer_callback is None
        self._storages: dict[_StorageKey, _Storage] = {}
        # Out of band, CUDA storages go here and are sent from the device in chunks, uncopied.
        self.deferred = None if self._in_band else deferred

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None:
            if type(obj) is _Storage:
                # The first pass sends a placeholder where the real thing would cost a copy.
                copies = self._in_band or obj.storage.device.type not in {"cpu", "cuda"}
                if self.spans is None and copies:
                    self.placeholders = True
                    return (_rebuild_storage, (pickle.PickleBuffer(bytearray()),))
                return obj.reduce(torch, self.deferred)
            if type(obj) in (torch.Tensor, torch.nn.Parameter) and _plain_tensor(torch, obj):
                return self._reduce_tensor(torch, obj)
        return super().reducer_override(obj)

    def _reduce_tensor(self, torch: Any, obj: Any) -> tuple[Any, ...]:
        t = obj.detach()
        if t.is_neg():
            t = t.resolve_neg()
        conj = bool(t.is_conj())
        if conj:
            t = t.conj()  # the same memory without the conjugate bit; set again on arrival
        dtype = str(t.dtype).removeprefix("torch.")
        shape, stride = tuple(t.shape), tuple(t.stride())
        flags = (bool(obj.requires_grad), type(obj) is torch.nn.Parameter, conj)
        if t.numel() == 0:
            return (_rebuild_tensor, (None, dtype, 0, shape, stride, *flags))
        storage = t.untyped_storage()
        key = (str(storage.device), storage.data_ptr(), storage.nbytes())
        size = t.element_size()
        lo = t.storage_offset() * size
        hi = lo + size * (1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)))
        seen = self.used.setdefault(key, [lo, hi])
        seen[0], seen[1] = min(seen[0], lo), max(seen[1], hi)
        ref = self._storages.get(key)
        if ref is None:
            # A storage new in this pass (a resolved negative view's copy) is sent whole.
            span = (self.spans or {}).get(key, (0, storage.nbytes()))
            ref = self._storages[key] = _Storage(storage, *span)
        return (_rebuild_tensor, (ref, dtype, (lo - ref.lo) // size, shape, stride, *flags))

    def trimmed_spans(self) -> dict[_StorageKey, tuple[int, int]] | None:
        """The byte ranges to send instead of whole storages, when a second pass is worth it."""
        spans: dict[_StorageKey, tuple[int, int]] = {}
        unused = 0
        for key, (lo, hi) in self.used.items():
            spans[key] = (lo - lo % _ALIGN, hi)
            unused += key[2] - (hi - spans[key][0])
        return spans if self.placeholders or unused >= TRIM_MIN_BYTES else None


def _plain_tensor(torch: Any, obj: Any) -> bool:
    """A dense tensor with data and nothing else attached (others pickle as torch does)."""
    return bool(
        obj.layout == torch.strided
        and not (obj.is_quantized or obj.is_meta or obj.is_nested)
        and not obj.__dict__
    )


class _Collect:
    """The pickler's buffer callback: out-of-band buffers in order, CUDA ones as DeviceBytes."""

    def __init__(self) -> None:
        self.buffers: list[OutOfBand] = []
        self.deferred: _Deferred = {}

    def __call__(self, buffer: pickle.PickleBuffer) -> None:
        placeholder = self.deferred.get(id(buffer.raw().obj))
        self.buffers.append(buffer if placeholder is None else placeholder[1])


def _dump(obj: Any, out_of_band: bool) -> tuple[bytes, list[OutOfBand]]:
    spans = None
    for _ in range(2):
        collect = _Collect()
        buffers = collect.buffers
        out = io.BytesIO()
        pickler = _Pickler(out, collect if out_of_band else None, spans, collect.deferred)
        pickler.dump(obj)
        if spans is not None:
            break
        spans = pickler.trimmed_spans()
        if spans is None:
            break
    return out.getvalue(), buffers


def dumps(obj: Any) -> tuple[bytes, list[OutOfBand]]:
    """Pickles `obj` with cloudpickle (protocol 5), keeping large buffers out of band.

    CUDA tensors' bytes stay on the device as `DeviceBytes` until `Connection.send` sends them.
    """
    return _dump(obj, out_of_band=True)


def dumps_inband(obj: Any) -> bytes:
    """Pickles `obj` like `dumps`, with every buffer inside the one returned bytes object."""
    return _dump(obj, out_of_band=False)[0]


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
    header_len, body_len, nbuf = parse_prefix(first + bytes(_recv_exact(sock, PREFIX_BYTES - 1)))
    lens = parse_lengths(_recv_exact(sock, 8 * nbuf), body_len) if nbuf else []
    return parse_header(_recv_exact(sock, header_len)), body_len, lens


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
