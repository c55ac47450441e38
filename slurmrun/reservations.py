"""Where a reservation's keeper is, for launchers outside the job: one private record per job.

The keeper (`slurmrun.batch.keeper`) writes ``$XDG_CONFIG_HOME/slurmrun/reservations/<job
id>.json`` (``~/.config/...``; the directory 0700, the file 0600, both checked to be the
user's alone before they are read), in the home directory that the nodes share with the
login node, as the job key (`slurmrun.batch.seal`). It holds the keeper's address and port
and a fresh secret that every launcher proves before the keeper reads a frame of it: only
the reserving user can read it, so another user's launcher finds no record (or cannot read
it) and runs nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["ReservationError", "ReservationRecord", "record_path"]


class ReservationError(RuntimeError):
    """There is no reservation of this user with that job id here, or it cannot be used."""


def record_path(job_id: str) -> Path:
    """The record of reservation `job_id`: ``$XDG_CONFIG_HOME/slurmrun/reservations/<id>.json``."""
    config = os.environ.get("XDG_CONFIG_HOME", "")
    root = Path(config) if os.path.isabs(config) else Path.home() / ".config"
    return root / "slurmrun" / "reservations" / f"{job_id}.json"


@dataclass(frozen=True)
class ReservationRecord:
    """What a launcher needs to reach a reservation's keeper.

    Attributes:
        job_id: the reservation's SLURM job id.
        host: the keeper's address (its node's, on the route toward the login node).
        port: the keeper's port for launchers.
        secret: what every launcher proves (hex).
        hostnames: the reservation's nodes, one agent each, in node-rank order.
        folder: the job's folder (the keeper's log, the agents' logs).
        pid: the keeper's process id on its node.
        node: the keeper's node (where a relay reaches its port from).
        attached: the launcher attached now (``pid 123 on login1``); empty: none.
        idle_since: since when none is (seconds since the epoch; 0 while one is).
        restarts: how often SLURM had requeued the job when this keeper started
            (``SLURM_RESTART_COUNT``).
        started: when this keeper's agents were ready (seconds since the epoch).
        lost: the nodes of `hostnames` whose agent was lost since (it died or fell silent),
            and why: the reservation goes on with the others (`Launcher.min_hosts`).
    """

    job_id: str
    host: str
    port: int
    secret: str
    hostnames: list[str]
    folder: str
    pid: int
    node: str = ""
    attached: str = ""
    idle_since: float = 0.0
    restarts: int = 0
    started: float = 0.0
    lost: dict[str, str] = field(default_factory=dict)

    @staticmethod
    def new_secret() -> str:
        """A fresh secret for launchers (hex of 32 random bytes)."""
        return secrets.token_hex(32)

    def write(self) -> Path:
        """Writes the record (atomically, mode 0600, its directory 0700); returns its path."""
        path = record_path(self.job_id)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check(path.parent, directory=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(asdict(self), f)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    @classmethod
    def read(cls, job_id: str) -> ReservationRecord | None:
        """The record of reservation `job_id`; None while there is none (not running yet).

        Raises:
            ReservationError: the record, or its directory, is not this user's alone.
        """
        path = record_path(job_id)
        try:
            _check(path.parent, directory=True)
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise ReservationError(
                f"cannot read the record of reservation {job_id} ({path}): {e.strerror}; only "
                "the user who reserved it can use it"
            ) from e
        with os.fdopen(fd) as f:
            _check_stat(path, os.fstat(f.fileno()), directory=False)
            try:
                fields = json.load(f)
                return cls(**fields)
            except (ValueError, TypeError) as e:
                raise ReservationError(f"{path} is not a reservation record: {e}") from e

    @classmethod
    def all(cls) -> list[ReservationRecord]:
        """This user's records, by job id (those that cannot be read are left out)."""
        folder = record_path("0").parent
        found = []
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            with contextlib.suppress(ReservationError):
                record = cls.read(path.stem)
                if record is not None:
                    found.append(record)
        return found

    @staticmethod
    def remove(job_id: str) -> None:
        """Removes the record of `job_id` (no error if there is none)."""
        record_path(job_id).unlink(missing_ok=True)


def _check(path: Path, *, directory: bool) -> None:
    _check_stat(path, os.stat(path), directory=directory)


def _check_stat(path: Path, st: os.stat_result, *, directory: bool) -> None:
    uid = os.geteuid()
    if st.st_uid != uid:
        raise ReservationError(
            f"{path} belongs to uid {st.st_uid}, not to you (uid {uid}): slurmrun does not use "
            "a reservation record that another user could have written"
        )
    if stat.S_ISDIR(st.st_mode) != directory:
        raise ReservationError(f"{path} is not a {'directory' if directory else 'file'}")
    if st.st_mode & 0o077:
        raise ReservationError(
            f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: others may read or change it; "
            f"run `chmod go-rwx {path}` (and release the reservation: its secret may be known)"
        )
