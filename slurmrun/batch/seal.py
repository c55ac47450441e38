"""Sealed job files: nothing in a job's folder is unpickled unless the submitter wrote it.

A submitted job crosses the shared filesystem as pickles: the call (``<id>_submitted.pkl``,
read on the node) and the result (``<id>_0_result.pkl``, read on the login node). Whoever
can change them runs code as the user where they are unpickled. So every such file is
*sealed*: one header line, then the pickle::

    slurmrun-sealed-1 <nonce> <HMAC-SHA256 hex>
    <pickle bytes>

The HMAC is keyed by the user's *job key*, 32 random bytes in
``$XDG_CONFIG_HOME/slurmrun/job-key`` (``~/.config/slurmrun/job-key``), created mode 0600
on the first submission and seen by the nodes through the shared home filesystem; a key
that others can read, or that is not the user's, is refused (`JobKeyError`). The MAC
covers what the file is (its name less the job id: ``submitted.pkl``, a call, or
``result.pkl``), the submission's *nonce* (random, one per submission) and the pickle. A
file is read whole, checked, and only then unpickled from the bytes checked: a file without
a seal, or whose seal does not match, raises `JobFolderTamperedError` and nothing of it is
unpickled.

The nonce is what keeps two jobs of one id apart (ids repeat when a controller's state
is reset, or two clusters share a home): it is written into the job's command in the batch
script, which SLURM keeps, so the node runs only a call sealed with its own submission's
nonce and seals its result with it; the login side takes the nonce of the job's sealed
call, and a result sealed with another one is another job's (`slurmrun.batch.sealed_job`).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from slurmrun.errors import JobFolderTamperedError, JobKeyError

__all__ = ["Sealed", "job_key", "key_path", "new_nonce", "read_sealed", "write_sealed"]

KEY_BYTES = 32
MAGIC = b"slurmrun-sealed-1"
NONCE = re.compile(r"^[0-9a-f]{32}$")
_HEADER_MAX = 200  # the header line is about 115 bytes


@dataclass(frozen=True)
class Sealed:
    """A sealed file's content, checked.

    Attributes:
        nonce: the submission it was sealed for.
        payload: the pickle.
    """

    nonce: str
    payload: bytes


def new_nonce() -> str:
    """A fresh submission nonce (32 hex digits)."""
    return secrets.token_hex(16)


def key_path() -> Path:
    """The job key's file: ``$XDG_CONFIG_HOME/slurmrun/job-key``, else ``~/.config/...``."""
    config = os.environ.get("XDG_CONFIG_HOME", "")
    root = Path(config) if os.path.isabs(config) else Path.home() / ".config"
    return root / "slurmrun" / "job-key"


def job_key(*, create: bool) -> bytes:
    """The user's job key; with `create`, made (mode 0600, atomically) if there is none.

    Raises:
        JobKeyError: there is no key (and not `create`), or it (or its directory) belongs
            to another user or is open to others.
    """
    path = key_path()
    if create:
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise JobKeyError(
                f"cannot create {path.parent} for slurmrun's job key: {e.strerror}",
                path=str(path),
            ) from e
    _check_dir(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if create:
            return _create(path)
        raise JobKeyError(
            f"there is no job key {path} here (on {os.uname().nodename}): it is made when you "
            "submit, in your home directory, which the nodes must share with the login node "
            "(or set XDG_CONFIG_HOME to a shared directory for both)",
            path=str(path),
        ) from None
    except OSError as e:
        why = "it is a symbolic link" if e.errno == errno.ELOOP else e.strerror
        raise JobKeyError(f"cannot use the job key {path}: {why}", path=str(path)) from e
    with os.fdopen(fd, "rb") as f:
        _check_owner(path, os.fstat(f.fileno()), 0o077, "read", regular=True)
        key = f.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        raise JobKeyError(
            f"{path} is not a job key slurmrun made ({len(key)} bytes, not {KEY_BYTES}): "
            "remove it (the next submission makes a new one; the results of jobs sealed with "
            "the old one can no longer be read)",
            path=str(path),
        )
    return key


def _check_dir(path: Path) -> None:
    try:
        st = os.stat(path.parent)
    except FileNotFoundError:
        return  # no key either: the caller says so
    _check_owner(path.parent, st, 0o022, "replace the key in", regular=False)


def _check_owner(path: Path, st: os.stat_result, others: int, what: str, *, regular: bool) -> None:
    uid = os.geteuid()
    if st.st_uid != uid:
        raise JobKeyError(
            f"{path} belongs to uid {st.st_uid}, not to you (uid {uid}): slurmrun does not use "
            "a job key that another user could have read; remove it or set XDG_CONFIG_HOME",
            path=str(path),
        )
    if regular and not stat.S_ISREG(st.st_mode):
        raise JobKeyError(f"{path} is not a regular file", path=str(path))
    if st.st_mode & others:
        raise JobKeyError(
            f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: others may {what} it, and then "
            "run code as you in your jobs. Run `chmod go-rwx` on it (and, as others may have "
            "read the key, remove the key: the next submission makes a new one)",
            path=str(path),
        )


def _create(path: Path) -> bytes:
    key = secrets.token_bytes(KEY_BYTES)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(key)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # unlike a rename, never replaces a key made meanwhile
        except FileExistsError:
            return job_key(create=False)
    finally:
        tmp.unlink(missing_ok=True)
    return key


def _mac(key: bytes, path: Path, nonce: str, payload: bytes) -> bytes:
    role = path.name.rsplit("_", 1)[-1]  # 12_submitted.pkl, 12_3_0_result.pkl: what it holds
    mac = hmac.new(key, digestmod=hashlib.sha256)
    mac.update(b"\0".join((MAGIC, role.encode(), nonce.encode(), b"")))
    mac.update(payload)
    return mac.hexdigest().encode("ascii")


def write_sealed(path: Path, payload: bytes, *, key: bytes, nonce: str) -> None:
    """Writes `payload` sealed to `path` (mode 0600; replaced whole, never seen half-written)."""
    header = b" ".join((MAGIC, nonce.encode("ascii"), _mac(key, path, nonce, payload)))
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header + b"\n")
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_sealed(path: Path, *, key: bytes) -> Sealed:
    """Reads a file that `write_sealed` wrote and checks its seal; unpickles nothing.

    Raises:
        FileNotFoundError: there is no such file.
        JobFolderTamperedError: it has no seal, or its seal does not match its content.
    """
    data = path.read_bytes()
    header, newline, _ = data[: _HEADER_MAX + 1].partition(b"\n")
    parts = header.split(b" ")
    if not newline or len(parts) != 3 or parts[0] != MAGIC:
        raise _tampered(path, "it has no slurmrun seal")
    nonce = parts[1].decode("ascii", "replace")
    payload = data[len(header) + 1 :]
    if not NONCE.match(nonce) or not hmac.compare_digest(_mac(key, path, nonce, payload), parts[2]):
        raise _tampered(path, "its seal does not match its content")
    return Sealed(nonce, payload)


def _tampered(path: Path, why: str) -> JobFolderTamperedError:
    return JobFolderTamperedError(
        f"{path} was not written by your slurmrun ({why}): the job folder {path.parent} was "
        "tampered with, or the file was written by something else (a slurmrun older than "
        "sealed job files, or a job key other than yours). Nothing of it was unpickled or "
        f"run. Check who can write {path.parent.parent} (see docs/login.md)",
        path=str(path),
    )
