"""The private control channel of a running launcher: ``slurmrun stacks`` reaches it here.

A launcher starts a `ControlServer`: a Unix socket ``<pid>.sock`` and a description
``<pid>.json`` (a `LauncherEntry`) in `runtime_dir`, a directory only this user can enter.
Another process of the same user on the same host finds it with `launchers` and sends one
request with `ask`. Nothing listens on the network, and a connection from another user is
closed unanswered (``SO_PEERCRED``), should the directory's and socket's modes not keep it out.

The protocol: the client sends one JSON line ``{"op": ..., "args": {...}}`` (at most
`MAX_REQUEST` bytes); the server answers one JSON line, ``{"ok": true, "text": ...}`` or
``{"ok": false, "error": ...}``, and closes the connection.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "MAX_REPLY",
    "MAX_REQUEST",
    "ControlError",
    "ControlServer",
    "LauncherEntry",
    "ask",
    "launchers",
    "runtime_dir",
]

MAX_REQUEST = 64 * 1024
MAX_REPLY = 64 * 1024 * 1024
READ_TIMEOUT = 10.0  # for a connected client to send its request line
SEND_TIMEOUT = 30.0  # for a client to take the reply
MAX_ANSWERING = 16  # requests answered at once; more get a "busy" reply
MAX_ENTRY = 64 * 1024  # a <pid>.json larger than this is not ours
# Literal /tmp, not $TMPDIR: a job's steps may each get their own TMPDIR, and the `srun` of
# `slurmrun stacks JOB_ID` must look where the job's launcher wrote.
FALLBACK_ROOT = Path("/tmp")  # noqa: S108 - private per-user directory, checked below

log = logging.getLogger("slurmrun")
_warned: list[bool] = []  # a launch without control socket is said once per process
_in_use: set[Path] = set()  # sockets of this process's running servers
_in_use_lock = threading.Lock()


class ControlError(RuntimeError):
    """A launcher's control channel cannot be used (or answered with an error)."""


@dataclasses.dataclass(frozen=True)
class LauncherEntry:
    """A running launcher, as its ``<pid>.json`` in `runtime_dir` describes it."""

    pid: int
    host: str
    job_id: str  # its SLURM_JOB_ID; "" outside a job
    started: float  # time.time() when it started its server
    what: str  # what it runs: "train.py", "my_func"
    socket: Path


def runtime_dir(create: bool = True) -> Path:
    """The private per-user directory of running launchers.

    ``$XDG_RUNTIME_DIR/slurmrun`` when ``XDG_RUNTIME_DIR`` is set, is a directory and is ours;
    else ``/tmp/slurmrun-<uid>``.

    Args:
        create: create it (mode 0700) when missing; False returns its path all the same.

    Raises:
        ControlError: it exists but is not a directory of ours that only we can enter (a
            symlink in its place included): it is never used, and the message says what to do.
    """
    path = _preferred_dir()
    if create:
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700)
    _check_private(path)
    return path


def _preferred_dir() -> Path:
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isabs(xdg):
        try:
            st = os.stat(xdg)
        except OSError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
            return Path(xdg) / "slurmrun"
    return FALLBACK_ROOT / f"slurmrun-{os.getuid()}"


def _check_private(path: Path) -> None:
    """Raises ControlError unless `path` is missing or a directory of ours, mode 0700 or less."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise ControlError(f"cannot read {path}: {e}") from e
    fix = f"remove it (rm -r {path}) and slurmrun creates it anew, only for you"
    if not stat.S_ISDIR(st.st_mode):
        raise ControlError(f"{path} is not a directory (it should be slurmrun's, private): {fix}")
    if st.st_uid != os.getuid():
        raise ControlError(
            f"{path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}): slurmrun does "
            f"not use it; ask its owner or an admin to {fix}"
        )
    if st.st_mode & 0o077:
        raise ControlError(
            f"{path} has mode {stat.S_IMODE(st.st_mode):o}: others could reach it, so slurmrun "
            f"does not use it; `chmod 700 {path}` or {fix}"
        )


def _search_dirs() -> list[Path]:
    """Where launchers may be: `runtime_dir`, then the other candidates that are private.

    A launcher and ``slurmrun stacks`` may disagree on XDG_RUNTIME_DIR: srun and sbatch pass
    on the login side's, which may not exist on the node; an ssh session there has its own.
    """
    dirs = [runtime_dir(create=False)]
    uid = os.getuid()
    for other in (Path(f"/run/user/{uid}/slurmrun"), FALLBACK_ROOT / f"slurmrun-{uid}"):
        if other not in dirs:
            with contextlib.suppress(ControlError):
                _check_private(other)
                dirs.append(other)
    return [d for d in dirs if d.is_dir()]


def launchers(job_id: str | None = None) -> list[LauncherEntry]:
    """Running launchers of this user on this host, newest first.

    Entries of this host whose process ended are removed; entries of other hosts (a shared
    /tmp) are left alone.

    Args:
        job_id: only the launchers of this SLURM job (their SLURM_JOB_ID).

    Raises:
        ControlError: the runtime directory is not private (`runtime_dir`).
    """
    host = socket.gethostname()
    found = []
    for directory in _search_dirs():
        for path in directory.glob("*.json"):
            entry = _read_entry(path)
            if entry is None or entry.host != host:
                continue
            if not _alive(entry.pid):
                for stale in (path, entry.socket):
                    with contextlib.suppress(OSError):
                        stale.unlink()
                continue
            if job_id is None or entry.job_id == job_id:
                found.append(entry)
    return sorted(found, key=lambda e: e.started, reverse=True)


def _read_entry(path: Path) -> LauncherEntry | None:
    """The entry `path` describes, or None when it is not one (too large, garbled)."""
    try:
        with path.open("rb") as f:
            data = json.loads(f.read(MAX_ENTRY))
        return LauncherEntry(
            pid=int(data["pid"]),
            host=str(data["host"]),
            job_id=str(data["job_id"]),
            started=float(data["started"]),
            what=str(data["what"]),
            socket=path.with_suffix(".sock"),  # not the file's word: next to it, in our dir
        )
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process took the pid: alive, not ours
        return True
    return True


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
        timeout: seconds for the whole exchange.

    Raises:
        ControlError: the launcher answered with an error, its socket refused or vanished (it
            probably ended), no reply came within `timeout`, or the reply was over `MAX_REPLY`.
    """
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
            may block a while (bounded by the caller's ``args["timeout"]``); what it raises
            becomes the error reply.
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
        self._lock = threading.Lock()

    def start(self) -> None:
        """Binds ``<runtime_dir>/<pid>.sock`` (0600), writes ``<pid>.json`` and starts serving.

        Where that fails (no private writable directory), it logs one warning per process and
        returns: the launch goes on without a control channel (`socket` stays None).
        """
        if self._listener is not None:  # started already
            return
        try:
            self._bind()
        except (OSError, ControlError) as e:
            self.close()
            self.socket = None
            if not _warned:
                _warned.append(True)
                log.warning("slurmrun: no control socket (slurmrun stacks cannot reach it): %s", e)
            return
        threading.Thread(target=self._serve, name="slurmrun-control", daemon=True).start()

    def _bind(self) -> None:
        directory = runtime_dir()
        with _in_use_lock:
            stem, n = str(os.getpid()), 0
            while directory / f"{stem}.sock" in _in_use:  # another server of this process
                n += 1
                stem = f"{os.getpid()}-{n}"
            path = directory / f"{stem}.sock"
            _in_use.add(path)
        self.socket = path
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # left by an ended process whose pid we got
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener = listener
        listener.bind(str(path))
        os.chmod(path, 0o600)  # the directory is private already; the socket too
        listener.listen(MAX_ANSWERING)
        entry = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "job_id": self.job_id,
            "started": time.time(),
            "what": self.what,
            "socket": str(path),
        }
        self._entry = path.with_suffix(".json")
        tmp = directory / f".{stem}.json.tmp"
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f)
        tmp.rename(self._entry)

    def close(self) -> None:
        """Stops serving and removes the socket and its entry; idempotent."""
        with self._lock:
            listener, self._listener = self._listener, None
            entry, self._entry = self._entry, None
            path = self.socket
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() of _serve
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

    def _serve(self) -> None:
        listener = self._listener
        while listener is not None:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed
                return
            if _peer_uid(conn) != os.getuid():
                conn.close()  # not a word to another user
                continue
            if not self._answering.acquire(blocking=False):
                with conn:
                    conn.settimeout(1.0)
                    busy = f"busy: {MAX_ANSWERING} requests are being answered; try again"
                    with contextlib.suppress(OSError):
                        conn.sendall(_reply(ok=False, text=busy))
                continue
            threading.Thread(
                target=self._answer, args=(conn,), name="slurmrun-control-request", daemon=True
            ).start()

    def _answer(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(READ_TIMEOUT)
                try:
                    op, args = _read_request(conn)
                except TimeoutError:
                    reply, unread = _reply(ok=False, text=f"no request in {READ_TIMEOUT:g} s"), True
                except (OSError, ValueError, TypeError) as e:  # too long, garbled
                    reply, unread = _reply(ok=False, text=str(e)), True
                else:
                    reply, unread = self._call(op, args), False
                conn.settimeout(SEND_TIMEOUT)
                with contextlib.suppress(OSError):
                    conn.sendall(reply)
                    if unread:
                        _drain(conn)
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


def _peer_uid(conn: socket.socket) -> int | None:
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def _read_request(conn: socket.socket) -> tuple[str, dict[str, Any]]:
    """The request line's op and args; ValueError or TypeError for one too long or garbled."""
    buf = b""
    while b"\n" not in buf:
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        buf += chunk
        if len(buf.split(b"\n", 1)[0]) > MAX_REQUEST:
            raise ValueError(f"request longer than {MAX_REQUEST} bytes")
    line = buf.split(b"\n", 1)[0]
    try:
        request = json.loads(line)
    except ValueError as e:
        raise ValueError(f'garbled request: not a JSON line {{"op": ..., "args": ...}}: {e}') from e
    op = request.get("op") if isinstance(request, dict) else None
    args = request.get("args", {}) if isinstance(request, dict) else None
    if not isinstance(op, str) or not isinstance(args, dict):
        raise TypeError('garbled request: expected {"op": "<name>", "args": {...}}')
    return op, args


def _drain(conn: socket.socket) -> None:
    """Reads what the client still sends, up to a bound, after our reply.

    Closing a Unix socket with data unread resets the connection: the client would get
    ECONNRESET instead of our error reply.
    """
    conn.shutdown(socket.SHUT_WR)
    conn.settimeout(1.0)
    left = 16 * MAX_REQUEST
    while left > 0 and (chunk := conn.recv(1 << 16)):
        left -= len(chunk)


def _reply(*, ok: bool, text: str) -> bytes:
    return json.dumps({"ok": ok, "text" if ok else "error": text}).encode() + b"\n"
