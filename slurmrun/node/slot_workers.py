"""The workers of a map's run on one node (`Launcher.map`): slots that outlive their deaths.

In a map's run (`protocol.Start.workers_per_item`) each worker is a slot's
(`slurmrun.node.slot`), and its death ends only that slot's item: the agent reports it (DIED)
and the run goes on. The launcher then decides: it kills a worker whose item ran past its
timeout (ITEM_CANCEL), and asks for a dead slot's worker again (SLOT_RESTART) while it has
items for it; the new worker is forked as the first was, with the run's call, on the
supervising thread (`SlotWorkers._between`), and makes its slot's world again.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

from slurmrun import protocol
from slurmrun.map_messages import ITEMS_FOLDER, Item, ItemCancel, SlotRestart
from slurmrun.node.relay import WorkerLink, begin_item
from slurmrun.node.supervisor import RunWorkers, ToWorker, signal_group
from slurmrun.node.worker import WorkerSpec, place_of

__all__ = ["SlotWorkers"]

_WAIT = 0.05  # how often a node whose workers all exited looks for a restart or the run's end
# How long a message for a worker waits for the run's workers to be forked (they are: the
# launcher sends one only after that worker said ITEM_READY).
SPAWN_WAIT = 30.0


@dataclass
class SlotWorkers(RunWorkers):
    """The workers of a map's run on this node (the module's docstring)."""

    _restarts: queue.SimpleQueue[int] = field(default_factory=queue.SimpleQueue, init=False)
    _replaced: list[WorkerLink] = field(default_factory=list, init=False)  # dead, restarted
    _payload: bytes = field(default=b"", init=False)

    def spawn(
        self, func_payload: bytes, kept: list[WorkerLink] | None = None, fresh_why: str = ""
    ) -> None:
        """Forks the workers (`RunWorkers.spawn`), keeping the call for restarts."""
        self._payload = func_payload
        super().spawn(func_payload, kept, fresh_why)

    def pass_on(self, message: ToWorker, body: bytes) -> None:
        """Kills a worker (ITEM_CANCEL), restarts a dead one (SLOT_RESTART), or passes on.

        A worker's first ITEM can come while the supervising thread still hands the call to
        the others (this one asked for it already): it waits for that, not dropped.
        """
        if not self.spawned.wait(SPAWN_WAIT) or not 0 <= message.local_rank < len(self.workers):
            return
        if isinstance(message, ItemCancel):
            # Its item may hold the GIL in C code: the worker could not end itself.
            signal_group(self.workers[message.local_rank].process, signal.SIGKILL)
        elif isinstance(message, SlotRestart):
            self._restarts.put(message.local_rank)
            self._wake_up()
        else:
            if isinstance(message, Item) and message.index >= 0 and self.start.log_dir:
                begin_item(self.workers[message.local_rank], self._item_path(message))
            super().pass_on(message, body)

    def _item_path(self, item: Item) -> str:
        """``<log dir>/items/<index>.log`` (a slot's rank r > 0: ``<index>.r<r>.log``)."""
        rank = item.local_rank % max(1, self.start.workers_per_item)
        name = f"{item.index}.log" if rank == 0 else f"{item.index}.r{rank}.log"
        return os.path.join(self.start.log_dir or "", ITEMS_FOLDER, name)

    def supervise(self, ended: Callable[[], bool], lag: Callable[[], float]) -> None:
        """`RunWorkers.supervise`, and again after a restart once every worker had exited.

        With every worker exited the node said DONE; a restart may still come (the launcher
        has items left) until the run ends.
        """
        while True:
            super().supervise(ended, lag)
            if not self._restarted(ended):
                return

    def _restarted(self, ended: Callable[[], bool]) -> bool:
        """Waits for a restart (True, done) or the run's end (False)."""
        while not ended():
            with contextlib.suppress(queue.Empty):
                if self._restart(self._restarts.get(timeout=_WAIT)):
                    return True
        return False

    def _between(self) -> None:
        while True:
            try:
                local_rank = self._restarts.get_nowait()
            except queue.Empty:
                return
            self._restart(local_rank)

    def _ends_run(self, worker: WorkerLink) -> bool:
        return False  # a slot's death is its own: the launcher retries its item

    def _restart(self, local_rank: int) -> bool:
        """Forks worker `local_rank` again if it was judged dead; whether it was."""
        old = self.workers[local_rank]
        if not old.judged:
            return False
        spec = WorkerSpec(self.hostname, self.start, place_of(self.start, local_rank))
        new = self._fork(spec, None)
        self._replaced.append(old)
        self.workers[local_rank] = new
        with contextlib.suppress(OSError):  # it died already: judged as such
            new.conn.send(protocol.Func(run=self.start.run).header(), self._payload)
        return True

    def finish(self, keep: bool = False, lag: float = 0.0) -> list[WorkerLink] | None:
        """`RunWorkers.finish`, for the dead workers that were restarted too."""
        self.workers.extend(self._replaced)
        self._replaced.clear()
        return super().finish(keep, lag)
