"""Whether only this user controls a directory: the check before trusting what it holds.

Two questions, asked of every directory whose files slurmrun reads back or runs (a job's
folder, the control channel's runtime directory): who owns it and who may write to it
(`problem`), and who could replace it, by renaming it away in a directory above and putting
their own in its place (`replaceable`). Each answer is a sentence naming the directory and
its owner; the caller adds what to do and raises its own error type.

A directory that is group-writable counts as written by others unless its group is the
user's private group (named as the user, with no other member): that is how ``umask 002``
systems give each user a group of their own.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = [
    "PRIVATE_UMASK",
    "SLURM_UMASK_VAR",
    "Problem",
    "owner_name",
    "private_umask",
    "problem",
    "replaceable",
    "umask",
]

PRIVATE_UMASK = 0o077  # what slurmrun creates under it: directories 0700, files 0600
SLURM_UMASK_VAR = "SLURM_UMASK"  # sbatch's and srun's input: the umask of the job or step


@dataclass(frozen=True)
class Problem:
    """Why a directory is not this user's alone.

    Attributes:
        text: the sentence (names the directory, its owner or its mode).
        kind: ``"owner"`` (another user's: only they or root can fix it), ``"mode"`` (ours,
            but others may write to it or reach it: chmod fixes it), ``"replaceable"`` (a
            directory above lets others replace it), ``"other"`` (not a directory, unreadable).
        owner: the uid that owns the directory in question.
    """

    text: str
    kind: Literal["owner", "mode", "replaceable", "other"]
    owner: int

    def __str__(self) -> str:
        return self.text


def owner_name(uid: int) -> str:
    """``uid 65534 (nobody)``; ``uid 1234`` where the name is unknown."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _own_group(gid: int) -> bool:
    """Whether `gid` is this user's private group (``alice:alice``, no other member)."""
    try:
        name = pwd.getpwuid(os.getuid()).pw_name
        group = grp.getgrgid(gid)
    except KeyError:
        return False
    return gid == os.getgid() and group.gr_name == name and set(group.gr_mem) <= {name}


def _others_write(st: os.stat_result) -> str:
    """Who else may write to a directory: "" (no one), "other users" or "group <name>"."""
    if st.st_mode & stat.S_IWOTH:
        return "other users"
    if st.st_mode & stat.S_IWGRP and not _own_group(st.st_gid):
        try:
            return f"group {grp.getgrgid(st.st_gid).gr_name}"
        except KeyError:
            return f"group {st.st_gid}"
    return ""


def problem(path: Path, *, others_may_read: bool = True) -> Problem | None:
    """Why `path` is not a private directory of this user's; None when it is (or is missing).

    Args:
        path: the directory (a symlink in its place is refused: it is not the directory).
        others_may_read: False also refuses read and search bits for group and others.
    """
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # missing: making it will say why not
        return None
    except OSError as e:
        return Problem(f"{path} cannot be read ({e.strerror})", "other", -1)
    return _problem_of(path, st, others_may_read)


def _problem_of(path: Path, st: os.stat_result, others_may_read: bool) -> Problem | None:
    if not stat.S_ISDIR(st.st_mode):
        return Problem(f"{path} is not a directory", "other", st.st_uid)
    if st.st_uid != os.getuid():
        mine = owner_name(os.getuid())
        text = f"{path} belongs to {owner_name(st.st_uid)}, not to you ({mine})"
        return Problem(text, "owner", st.st_uid)
    mode = stat.S_IMODE(st.st_mode)
    if not others_may_read and mode & 0o077:
        return Problem(f"{path} has mode {mode:o}: others can reach it", "mode", st.st_uid)
    writers = _others_write(st)
    if writers:
        return Problem(f"{path} has mode {mode:o}: {writers} can write to it", "mode", st.st_uid)
    return None


def replaceable(path: Path) -> Problem | None:
    """Why others could replace `path` through a directory above it; None when no one can.

    A directory above `path` (above its real path too, where symlinks lead elsewhere) that
    others can write to lets them rename the entry on the way to `path` and make their own,
    unless it has the sticky bit (as ``/tmp``) and the entry is this user's or root's.
    """
    absolute = Path(os.path.abspath(path))
    entries = {absolute, *absolute.parents, Path(os.path.realpath(absolute))}
    entries |= set(Path(os.path.realpath(absolute)).parents)
    for entry in sorted(entries, key=lambda p: len(p.parts)):
        parent = entry.parent
        if parent == entry:  # "/"
            continue
        try:
            st = os.stat(parent)
        except OSError:
            continue  # a missing directory above: mkdir will say so
        writers = _others_write(st)
        if not writers:
            continue
        mode = stat.S_IMODE(st.st_mode)
        if not st.st_mode & stat.S_ISVTX:
            text = (
                f"{parent} has mode {mode:o}: {writers} can write to it, so they can replace "
                f"{entry} with a directory of their own"
            )
            return Problem(text, "replaceable", st.st_uid)
        try:
            owner = os.lstat(entry).st_uid
        except FileNotFoundError:
            continue  # made by this user below (a sticky directory keeps it theirs)
        except OSError:
            continue
        if owner not in (os.getuid(), 0):
            text = (
                f"{entry} belongs to {owner_name(owner)}, in {parent} (mode {mode:o}), so they "
                "can replace what is in it"
            )
            return Problem(text, "replaceable", owner)
    return None


def umask() -> int:
    """This process's umask (from /proc where it says, without changing it meanwhile)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(PRIVATE_UMASK)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def private_umask() -> Iterator[None]:
    """Runs the body under umask 077: what it creates, and what SLURM creates for it, is private.

    sbatch and srun pass ``SLURM_UMASK`` on to the job or step (SLURM creates its output files
    under it, and its processes start with it); one set by the user would win over the umask.
    Both are the process's, so threads that create files meanwhile make them private too.
    """
    old = os.umask(PRIVATE_UMASK)
    slurm = os.environ.get(SLURM_UMASK_VAR)
    os.environ[SLURM_UMASK_VAR] = f"{PRIVATE_UMASK:04o}"
    try:
        yield
    finally:
        os.umask(old)
        if slurm is None:
            os.environ.pop(SLURM_UMASK_VAR, None)
        else:
            os.environ[SLURM_UMASK_VAR] = slurm
