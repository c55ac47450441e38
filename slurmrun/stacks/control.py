"""The private control channel of a running launcher: ``slurmrun stacks`` reaches it here.

A launcher starts a `ControlServer`: a Unix socket ``<host>-<pid>.sock`` and a description
``<host>-<pid>.json`` (a `LauncherEntry`) in `runtime_dir`, a directory only this user can
enter (on a /tmp that several hosts share, the host in the name keeps their launchers apart).
Another process of the same user on the same host finds it with `launchers` and sends one
request with `ask`. Nothing listens on the network, and a connection from another user is
closed unanswered (``SO_PEERCRED``), should the directory's and socket's modes not keep it out.

The protocol: the client sends one JSON line ``{"op": ..., "args": {...}}`` (at most
`MAX_REQUEST` bytes, within `READ_TIMEOUT` s of connecting); the server answers one JSON line,
``{"ok": true, "text": ...}`` or ``{"ok": false, "error": ...}``, and closes the connection.
``args["timeout"]``, where given, is how long the handler may take: a number of seconds > 0
(else the request gets an error reply), at most `MAX_WAIT` (more is cut to it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slurmrun.stacks.control_dir import (
    ControlError,
    LauncherEntry,
    answers,
    launchers,
    runtime_dir,
    terminal_session,
    working_dir,
)

__all__ = [
    "MAX_REPLY",
    "MAX_REQUEST",
    "MAX_WAIT",
    "ControlError",
    "ControlServer",
    "LauncherEntry",
    "ask",
    "launchers",
    "runtime_dir",
]

MAX_REQUEST = 64 * 1024
MAX_REPLY = 64 * 1024 * 1024
READ_TIMEOUT = 10.0  # for a connected client to send its whole request line
SEND_TIMEOUT = 30.0  # for a client to take the reply
MAX_WAIT = 300.0  # the longest args["timeout"] a handler is given
MAX_ASK = 3600.0  # the longest `ask` waits
MAX_ANSWERING = 16  # requests answered at once; more get a "busy" reply
MAX_READING = 64  # connections whose request is being read (or drained) at once
DRAIN_TIME = 1.0  # for a client to close after our error reply, while we read what it sends
_DRAIN_BYTES = 16 * MAX_REQUEST  # read at most this of it
_MAX_SOCKET_PATH = 107  # bytes of a Unix socket's path (sun_path holds 108 with its NUL)

log = logging.getLogger("slurmrun")
_warned: list[bool] = []  # a launch without control socket is said once per process
_in_use: set[Path] = set()  # sockets of this process's running servers
_in_use_lock = threading.Lock()


def _seconds(value: object, most: float, what: str = "timeout") -> float:
    """`value` as a number of seconds: > 0 (finite) and at most `most`.

    Raises:
        ValueError: it is not (NaN, infinite, negative, zero, too large, not a number).
    """
    if (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 < value <= most
    ):
        return float(value)
    raise ValueError(f"{what} must be a number of seconds > 0 and at most {most:g}, got {value!r}")


def ask(
    entry: LauncherEntry,
    op: str,
    args: dict[str, Any] | None = None,
    timeout: float = 30.0,
) -> str:
    """Sends one request to a launcher and returns its reply text.

    Args:
        entry: the launcher (from `launchers`).
        op: what to ask (``"stacks"``).
        args: the request's arguments (JSON-serialisable).
        timeout: seconds for the whole exchange (> 0, at most `MAX_ASK`).

    Raises:
        ValueError: `timeout` is not such a number of seconds.
        ControlError: the launcher answered with an error, its socket refused or vanished (it
            probably ended), no reply came within `timeout`, or the reply was over `MAX_REPLY`.
    """
    timeout = _seconds(timeout, MAX_ASK)
    who = f"launcher pid {entry.pid} ({entry.what})"
    request = json.dumps({"op": op, "args": args or {}}).encode() + b"\n"
    if len(request) > MAX_REQUEST:
        raise ControlError(f"request to {who} is {len(request)} bytes, over {MAX_REQUEST}")
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.settimeout(timeout)
            sock.connect(str(entry.socket))
            sock.sendall(request)
            reply = _read_reply(sock, deadline, who)
        except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError) as e:
            raise ControlError(
                f"{who} does not answer on {entry.socket} ({e.strerror}): it probably ended"
            ) from e
        except TimeoutError as e:
            raise ControlError(f"{who} did not answer within {timeout:g} s") from e
        except OSError as e:
            raise ControlError(f"cannot reach {who} on {entry.socket}: {e}") from e
    try:
        answer = json.loads(reply)
        ok, text = bool(answer["ok"]), answer["text" if answer["ok"] else "error"]
    except (ValueError, TypeError, KeyError) as e:
        raise ControlError(f"{who} sent a garbled reply: {reply[:200]!r}") from e
    if not ok:
        raise ControlError(f"{who}: {text}")
    return str(text)


def _read_reply(sock: socket.socket, deadline: float, who: str) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_REPLY:
            raise ControlError(f"{who} sent a reply over {MAX_REPLY} bytes")
        if chunk.endswith(b"\n"):
            break
    if not chunks:
        raise ConnectionResetError(0, "closed without a reply")
    return b"".join(chunks)


class ControlServer:
    """A launcher's end of the control channel: answers requests with `handler`.

    Args:
        handler: ``handler(op, args) -> text``; it runs on a thread of its own per request and
            may block a while (bounded by the caller's ``args["timeout"]``, checked and cut to
            `MAX_WAIT` before it is called); what it raises becomes the error reply.
        what: what the launcher runs (``"train.py"``, ``"my_func"``), for `LauncherEntry`.
        job_id: the launcher's SLURM_JOB_ID ("" outside a job).
    """

    def __init__(
        self, handler: Callable[[str, dict[str, Any]], str], *, what: str, job_id: str = ""
    ) -> None:
        self.handler = handler
        self.what = what
        self.job_id = job_id
        self.socket: Path | None = None
        self._entry: Path | None = None
        self._listener: socket.socket | None = None
        self._owner = os.getpid()  # a forked child must not remove its parent's files
        self._answering = threading.BoundedSemaphore(MAX_ANSWERING)
        self._closed = threading.Event()
        self._lock = threading.Lock()

    def start(self) -> None:
        """Binds ``<runtime_dir>/<host>-<pid>.sock`` (0600), writes its ``.json`` and serves.

        Where that fails (no private writable directory), it logs one warning per process and
        returns: the launch goes on without a control channel (`socket` stays None).
        """
        if self._listener is not None:  # started already
            return
        try:
            listener = self._bind()
        except (OSError, ControlError) as e:
            self.close()
            self.socket = None
            if not _warned:
                _warned.append(True)
                log.warning("slurmrun: no control socket (slurmrun stacks cannot reach it): %s", e)
            return
        requests = _Requests(listener, self._answering, self._answer, self._closed)
        threading.Thread(target=requests.serve, name="slurmrun-control", daemon=True).start()

    def _bind(self) -> socket.socket:
        directory = runtime_dir()
        path = _free_name(directory)
        self.socket = path
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a stale one: nobody listens on it (`_free_name` asked)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener = listener
        listener.bind(str(path))
        os.chmod(path, 0o600)  # the directory is private already; the socket too
        listener.listen(MAX_ANSWERING)
        listener.setblocking(False)
        entry = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "job_id": self.job_id,
            "started": time.time(),
            "what": self.what,
            "socket": str(path),
            "cwd": working_dir(),
            "session": terminal_session(),
        }
        self._entry = path.with_suffix(".json")
        tmp = directory / f".{path.stem}.json.tmp"
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f)
        tmp.rename(self._entry)
        return listener

    def close(self) -> None:
        """Stops serving and removes the socket and its entry; idempotent."""
        self._closed.set()
        with self._lock:
            listener, self._listener = self._listener, None
            entry, self._entry = self._entry, None
            path = self.socket
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes the select of `_Requests.serve`
            listener.close()
        if path is None or os.getpid() != self._owner:
            return
        for owned in (entry, path):
            if owned is not None:
                with contextlib.suppress(OSError):
                    owned.unlink()
        with _in_use_lock:
            _in_use.discard(path)

    def __enter__(self) -> ControlServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _answer(self, conn: socket.socket, op: str, args: dict[str, Any]) -> None:
        """Answers one request (on a thread of its own, holding one of `_answering`)."""
        try:
            with conn:
                reply = self._call(op, args)
                conn.settimeout(SEND_TIMEOUT)
                with contextlib.suppress(OSError):
                    conn.sendall(reply)
        finally:
            self._answering.release()

    def _call(self, op: str, args: dict[str, Any]) -> bytes:
        try:
            text = self.handler(op, args)
        except Exception as e:  # the client gets it, the launcher goes on
            return _reply(ok=False, text=f"{type(e).__name__}: {e}")
        if not isinstance(text, str):
            return _reply(ok=False, text=f"the handler returned {type(text).__name__}, not str")
        reply = _reply(ok=True, text=text)
        if len(reply) > MAX_REPLY:
            return _reply(ok=False, text=f"the reply is {len(reply)} bytes, over {MAX_REPLY}")
        return reply


def _free_name(directory: Path) -> Path:
    """``<host>-<pid>.sock`` in `directory`, or ``-1``, ``-2``...: one no process listens on.

    Taken: another server of this process has it, or a live process listens there (one
    of another pid namespace with our pid, sharing the directory). Its file is never removed.
    """
    host = socket.gethostname().replace(os.sep, "_")
    if len(str(directory / f"{host}-{os.getpid()}-99.sock").encode()) > _MAX_SOCKET_PATH:
        host = host.split(".")[0]
    base = f"{host}-{os.getpid()}"
    with _in_use_lock:
        for n in range(100):
            path = directory / (f"{base}.sock" if n == 0 else f"{base}-{n}.sock")
            if path not in _in_use and not answers(path):
                _in_use.add(path)
                return path
    raise ControlError(f"{directory}: live sockets hold {base}.sock to {base}-99.sock")


@dataclasses.dataclass
class _Pending:
    """A connection whose request is being read, or (after our error reply) drained."""

    conn: socket.socket
    deadline: float  # monotonic
    data: bytearray = dataclasses.field(default_factory=bytearray)
    draining: bool = False
    left: int = _DRAIN_BYTES  # while draining


class _Requests:
    """Reads the requests of every connection at once, each whole within READ_TIMEOUT s.

    One thread (`serve`) owns the listener and the connections being read, at most
    MAX_READING (more wait in the listen backlog). A whole request goes to `answer` on a thread
    of its own while one of `slots` is free; else it gets the busy reply. A garbled, late or
    busy request gets its error reply here, and what the client still sends is then read for up
    to DRAIN_TIME s: closing with data unread would reset the connection, and the client would
    get ECONNRESET instead of the reply.
    """

    def __init__(
        self,
        listener: socket.socket,
        slots: threading.BoundedSemaphore,
        answer: Callable[[socket.socket, str, dict[str, Any]], None],
        closed: threading.Event,
    ) -> None:
        self.listener = listener
        self.slots = slots
        self.answer = answer
        self.closed = closed
        self.pending: dict[socket.socket, _Pending] = {}
        self.selector = selectors.DefaultSelector()
        self.listening = False

    def serve(self) -> None:
        """Runs until the listener is closed; closes what it still reads then."""
        try:
            while not self.closed.is_set() and self._turn():
                pass
        except (OSError, ValueError):  # the listener closed under us
            pass
        finally:
            for pending in list(self.pending.values()):
                self._close(pending)
            self.selector.close()

    def _turn(self) -> bool:
        """One wait for what comes (at most 1 s); False once the listener is closed."""
        now = time.monotonic()
        for late in [p for p in self.pending.values() if p.deadline <= now]:
            self._late(late)
        self._listen(len(self.pending) < MAX_READING)
        wait = min([p.deadline for p in self.pending.values()], default=now + 1.0) - now
        for key, _ in self.selector.select(min(max(wait, 0.0), 1.0)):
            pending = self.pending.get(key.fileobj)  # type: ignore[call-overload]
            if pending is not None:
                self._read(pending)
            elif key.fileobj is self.listener and not self._accept():
                return False
        return True

    def _listen(self, more: bool) -> None:
        """Takes new connections while fewer than MAX_READING are being read."""
        if more != self.listening:
            self.listening = more
            if more:
                self.selector.register(self.listener, selectors.EVENT_READ)
            else:
                self.selector.unregister(self.listener)

    def _accept(self) -> bool:
        """Takes a waiting connection; False once the listener is closed."""
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):  # it went away meanwhile
            return True
        except OSError:
            return False
        if _peer_uid(conn) != os.getuid():
            conn.close()  # not a word to another user
            return True
        conn.setblocking(False)
        self.pending[conn] = _Pending(conn, time.monotonic() + READ_TIMEOUT)
        self.selector.register(conn, selectors.EVENT_READ)
        return True

    def _read(self, pending: _Pending) -> None:
        try:
            chunk = pending.conn.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(pending)
            return
        if pending.draining:
            pending.left -= len(chunk)
            if not chunk or pending.left <= 0:
                self._close(pending)
            return
        pending.data += chunk
        line, newline, _ = pending.data.partition(b"\n")
        if len(line) > MAX_REQUEST:
            self._refuse(pending, f"request longer than {MAX_REQUEST} bytes")
        elif newline or not chunk:  # else more is to come
            self._take(pending, bytes(line))

    def _take(self, pending: _Pending, line: bytes) -> None:
        """A whole request: to a thread that answers it, or the error reply."""
        try:
            op, args = _parse(line)
        except (ValueError, TypeError) as e:
            self._refuse(pending, str(e))
            return
        if not self.slots.acquire(blocking=False):
            self._refuse(pending, f"busy: {MAX_ANSWERING} requests are being answered; try again")
            return
        self.selector.unregister(pending.conn)
        del self.pending[pending.conn]
        pending.conn.setblocking(True)
        threading.Thread(
            target=self.answer,
            args=(pending.conn, op, args),
            name="slurmrun-control-request",
            daemon=True,
        ).start()

    def _late(self, pending: _Pending) -> None:
        if pending.draining:
            self._close(pending)
        else:
            self._refuse(pending, f"no request in {READ_TIMEOUT:g} s")

    def _refuse(self, pending: _Pending, error: str) -> None:
        """Sends the error reply, then drains (see the class's docstring)."""
        try:
            pending.conn.send(_reply(ok=False, text=error))  # small: the buffer takes it
            pending.conn.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(pending)
            return
        pending.draining = True
        pending.deadline = time.monotonic() + DRAIN_TIME
        pending.data.clear()

    def _close(self, pending: _Pending) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(pending.conn)
        self.pending.pop(pending.conn, None)
        pending.conn.close()


def _peer_uid(conn: socket.socket) -> int | None:
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def _parse(line: bytes) -> tuple[str, dict[str, Any]]:
    """The request line's op and args; ValueError or TypeError for one garbled or bad."""
    try:
        request = json.loads(line)
    except ValueError as e:
        raise ValueError(f'garbled request: not a JSON line {{"op": ..., "args": ...}}: {e}') from e
    op = request.get("op") if isinstance(request, dict) else None
    args = request.get("args", {}) if isinstance(request, dict) else None
    if not isinstance(op, str) or not isinstance(args, dict):
        raise TypeError('garbled request: expected {"op": "<name>", "args": {...}}')
    if "timeout" in args:
        timeout = args["timeout"]
        number = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
        if number and math.isfinite(timeout) and timeout > MAX_WAIT:
            timeout = MAX_WAIT
        args["timeout"] = _seconds(timeout, MAX_WAIT, "the request's timeout")
    return op, args


def _reply(*, ok: bool, text: str) -> bytes:
    return json.dumps({"ok": ok, "text" if ok else "error": text}).encode() + b"\n"
