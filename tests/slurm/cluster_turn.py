"""Turns on the shared SLURM test cluster for concurrent pytest-xdist workers.

The cluster tests run in a few xdist groups at once (tests/slurm/conftest.py). Most tests
only submit jobs of their own and look at their own processes, so they share the cluster: a
job or process is a worker's when it was submitted from below that worker's basetemp, and each
worker runs its tests one after the other. A test that changes the whole cluster (kills a
node's slurmd, marks a node down, preempts every job of `debug`, changes a partition,
firewalls the nodes) is marked ``cluster_exclusive`` and has the cluster to itself.

`ClusterTurns` is that rule: a readers-writer lock of two ``flock`` files that every pytest
process on the cluster opens (the workers of a run, and other sessions on the same cluster: a
lost node is lost to their jobs too). A shared turn waits while an exclusive one runs or waits
(the gate), so a stream of shared tests on two workers cannot keep an exclusive one out; an
exclusive turn waits for the shared ones in progress to end. Each wait is bounded.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Literal

import pytest

Mode = Literal["shared", "exclusive"]


# The mode of the turn this process holds (None between turns). Module-level here, not in the
# conftest: test files import the conftest's helpers as `tests.slurm.conftest`, a second copy of
# the module pytest loaded as a plugin; this module is imported once by both.
_held: list[Mode] = []


def held_mode() -> Mode | None:
    """The mode of this process's current turn on the cluster, if it holds one."""
    return _held[0] if _held else None


def require_exclusive(what: str) -> None:
    """Fails the test unless it has the cluster to itself: `what` changes the whole cluster."""
    if held_mode() != "exclusive":
        pytest.fail(
            f"{what} changes the whole cluster, for the tests of the other xdist groups too: "
            "mark the test @pytest.mark.cluster_exclusive",
            pytrace=False,
        )


class ClusterTurnTimeout(Exception):
    """The cluster did not come free for a turn within its bound."""


class ClusterTurnUpgrade(Exception):
    """An exclusive turn asked for inside a shared one of the same worker (it would deadlock)."""


class ClusterTurns:
    """One process's turns on the cluster; the lock files live in `folder`.

    Args:
        folder: the directory of the lock files, the same for every process on the cluster.
        wait: how long a turn may wait for the cluster, in seconds.
    """

    def __init__(self, folder: Path, wait: float = 240.0) -> None:
        self.folder = folder
        self.wait = wait

    @contextlib.contextmanager
    def hold(self, mode: Mode, who: str) -> Iterator[None]:
        """The cluster in `mode` for the block; `who` (a test's id) is named to waiting workers.

        A turn inside one of this process's own turns is part of it (a module's shared turn
        covers its tests), but an exclusive turn inside a shared one raises
        `ClusterTurnUpgrade`: the shared turn would keep it waiting for ever.
        """
        if (held := held_mode()) is not None:
            if mode == "exclusive" and held == "shared":
                raise ClusterTurnUpgrade(
                    f"{who} needs the cluster to itself (cluster_exclusive) but runs inside a "
                    "shared turn of its own worker (a module fixture's): move it to a module "
                    "that holds no shared turn"
                )
            yield
            return
        deadline = time.monotonic() + self.wait
        with (
            open(self.folder / "cluster-turn.gate", "a") as gate,
            open(self.folder / "cluster-turn.lock", "a") as lock,
        ):
            self._take(gate, fcntl.LOCK_EX, deadline, who)
            how = fcntl.LOCK_EX if mode == "exclusive" else fcntl.LOCK_SH
            try:
                self._take(lock, how, deadline, who)
            finally:
                if mode == "shared":  # an exclusive turn keeps the gate: no new shared turn
                    fcntl.flock(gate, fcntl.LOCK_UN)
            holder = self.folder / f"cluster-turn.{os.getpid()}"
            holder.write_text(f"{mode} {who}\n")
            _held[:] = [mode]
            try:
                yield
            finally:
                _held.clear()
                holder.unlink(missing_ok=True)
        # closing the files ended the locks

    def _take(self, file: IO[str], how: int, deadline: float, who: str) -> None:
        """Polls for the flock `how` of `file` until `deadline`, then raises naming the holders."""
        while True:
            try:
                fcntl.flock(file, how | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() > deadline:
                    holders = []
                    for path in self.folder.glob("cluster-turn.[0-9]*"):
                        # its turn may just have ended; a SIGKILLed holder left its file
                        with contextlib.suppress(OSError):
                            os.kill(int(path.suffix[1:]), 0)
                            holders.append(path.read_text().strip())
                    raise ClusterTurnTimeout(
                        f"{who} waited {self.wait:g} s for its turn on the SLURM test cluster; "
                        f"held by: {holders or 'nobody known'}"
                    ) from None
                time.sleep(0.05)
            else:
                return
