"""Names slurmrun's processes in ps and top: ``slurmrun: train.py rank 5 (node2:1)``.

Every process on a node would otherwise show as ``python3 -m slurmrun.node.agent_main``: the
spawner and the workers are forks of the agent. Each sets two names:

- its title, what ``ps aux``, ``ps -f``, ``top -c`` and ``pgrep -f`` show (``/proc/<pid>/cmdline``):
  ``slurmrun agent (node2)``, ``slurmrun spawner (node2)``, ``slurmrun: train.py rank 5
  (node2:1)``;
- its ``comm``, what ``top`` and ``ps -o comm`` show and ``pgrep``/``killall`` match (15 bytes at
  most, set with ``prctl(PR_SET_NAME)``): ``slurmrun-agent``, ``slurmrun-spawn``, ``slurmrun-r5``.

The title is written over the process's original argument strings (their address is in
``/proc/self/stat``), so it is as long as the agent's command line at most (its interpreter's
path plus `` -m slurmrun.node.agent_main``: 45 bytes for ``/usr/bin/python3``); a longer one is
cut. The `setproctitle` package does the same writing (measured: 1.3.8); it is not used because
it reaches further only by also overwriting the environment block, which would leave
``/proc/<pid>/environ`` of every agent, spawner and worker blank (users read it to see a
worker's variables), and its ``comm`` is the title's first 15 bytes (``slurmrun: train``: no
rank). Best effort: on a system without ``/proc`` nothing changes.

A title holds no argument and no variable: only the function's name (a script's base name, or
``-m module``), the ranks and the node's name.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import socket
from collections.abc import Mapping

from slurmrun.variables import HOSTNAME_VAR

__all__ = [
    "AGENT_COMM",
    "SPAWNER_COMM",
    "node_name",
    "set_title",
    "worker_comm",
    "worker_title",
]

AGENT_COMM = "slurmrun-agent"
SPAWNER_COMM = "slurmrun-spawn"
_PR_SET_NAME = 15
# What a script run by the ``slurmrun`` command is, as workers receive it (not imported: the
# node side imports nothing of the command line's).


def node_name(environ: Mapping[str, str]) -> str:
    """This node's name as slurmrun shows it: the launcher's name for it, SLURM's, or the host's."""
    return environ.get(HOSTNAME_VAR) or environ.get("SLURMD_NODENAME") or socket.gethostname()


def worker_title(rank: int, host: str, local_rank: int, what: str = "") -> str:
    """A worker's title: ``slurmrun: train.py rank 5 (node2:1)`` (without `what` until known).

    Where the title would not fit (`set_title`), `what` is cut first: the ranks tell workers apart.
    """
    where = f"rank {rank} ({host}:{local_rank})"
    if not what:
        return f"slurmrun: {where}"
    size = _argument_area()[1]
    room = size - 1 - len(f"slurmrun:  {where}".encode())
    if size and len(what.encode()) > room:
        what = what.encode()[: max(room - 3, 1)].decode(errors="ignore") + "..."
    return f"slurmrun: {what} {where}"


def worker_comm(rank: int) -> str:
    """A worker's ``comm`` (15 bytes): ``slurmrun-r5``."""
    return f"slurmrun-r{rank}"


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)


@functools.lru_cache(maxsize=1)
def _argument_area() -> tuple[int, int]:
    """Where this process's original argument strings lie: (address, size); (0, 0): unknown.

    Forks inherit the answer (and the area, at the same address).
    """
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (man 5 proc)
    except (OSError, ValueError, IndexError):
        return 0, 0
    return (start, end - start) if 0 < start < end else (0, 0)


def set_title(title: str, comm: str | None = None) -> None:
    """Sets this process's title (cut to fit), and its ``comm`` when given; best effort.

    ``comm`` is the calling thread's name, and a new thread starts with its creator's: set it
    from the main thread before starting others.
    """
    if comm is not None:
        with contextlib.suppress(OSError, AttributeError):  # not Linux
            _libc().prctl(_PR_SET_NAME, comm.encode(errors="replace")[:15], 0, 0, 0)
    start, size = _argument_area()
    if size < 2:
        return
    # Cut at a character's boundary; the area ends with a NUL either way.
    data = title.encode(errors="replace")[: size - 1].decode(errors="ignore").encode()
    ctypes.memset(start, 0, size)
    ctypes.memmove(start, data, len(data))
    if len(data) < size - 1:
        # The kernel shows a whole area that ends with a NUL, padding included (psutil would
        # read "title", "", "", ...); one whose last byte is not a NUL it shows up to the
        # first NUL, as set by setproctitle(3) (fs/proc/base.c, get_mm_cmdline).
        ctypes.memset(start + size - 1, ord(" "), 1)
