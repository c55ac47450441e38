"""A map's items and slots, as the launcher keeps them (`Launcher.map`): no process, no socket.

`MapBook` holds the queue of items waiting for a slot, each item's tries, and each item's
outcome (its value or its last exception) in the items' order; `Slot` is one slot of the
map's run. `slurmrun.launcher.map_run` moves them as the slots' messages come.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MapBook", "Slot", "SlotKey", "slots_of"]

SlotKey = tuple[int, int]  # (node rank, local rank of the slot's first worker)


@dataclass
class Slot:
    """One slot of a map's run: `size` workers of one node, from `key`'s local rank on."""

    key: SlotKey
    size: int = 1
    port: int = 0  # its world's MASTER_PORT, as its rank 0 said
    ready_ranks: set[int] = field(default_factory=set)  # those whose ITEM_READY came
    item: int | None = None  # the item it runs
    since: float = 0.0  # when it was given that item
    answers: dict[int, Any] = field(default_factory=dict)  # by rank: its item's value frame
    dead: set[int] = field(default_factory=set)  # its ranks whose worker died
    retired: bool = False  # its workers died before it was ready: it takes no more items
    told_no_more: bool = False  # it was sent NO_MORE: its workers return
    killing: bool = False  # its workers are being killed (a timeout, a failure, a death)
    restarts: int = 0  # how many times its workers were forked again

    @property
    def ready(self) -> bool:
        """Whether every worker of it made the slot's world."""
        return len(self.ready_ranks) == self.size

    @property
    def idle(self) -> bool:
        """Whether it can take an item now."""
        busy = self.item is not None or self.killing or self.told_no_more
        return self.ready and not busy and not self.retired

    @property
    def local_ranks(self) -> range:
        """Its workers' local ranks."""
        return range(self.key[1], self.key[1] + self.size)

    def became_ready(self, rank: int, port: int) -> bool:
        """Worker `rank` said ITEM_READY (rank 0 with its world's port); True: now all did."""
        if rank == 0:
            self.port = port
        was = self.ready
        self.ready_ranks.add(rank)
        return self.ready and not was

    def begin(self, index: int, now: float) -> None:
        """It runs item `index` from `now` on."""
        self.item, self.since = index, now
        self.answers.clear()

    def answered(self, rank: int, outcome: Any) -> bool:
        """Worker `rank` answered the item; True: every worker did."""
        self.answers[rank] = outcome
        return len(self.answers) == self.size

    def died(self, rank: int) -> bool:
        """Worker `rank` died; True: every worker of it is dead."""
        self.dead.add(rank)
        return len(self.dead) == self.size

    def restarted(self) -> None:
        """Its workers are forked again: it is ready once each says so."""
        self.ready_ranks.clear()
        self.dead.clear()
        self.killing = False
        self.restarts += 1


def slots_of(workers: dict[int, int], size: int) -> dict[SlotKey, Slot]:
    """The slots of `size` workers that nodes of `workers` (by node rank) hold.

    Raises:
        RuntimeError: no node holds one.
    """
    slots = {
        (node_rank, first): Slot((node_rank, first), size)
        for node_rank, count in workers.items()
        for first in range(0, count - count % size, size)
    }
    if not slots:
        counts = sorted(set(workers.values()))
        raise RuntimeError(
            f"no node runs workers_per_item={size} workers (they run {counts}): the map "
            "has no slot. Ask for fewer workers per item, or more workers per host."
        )
    return slots


_PENDING = object()  # an item with no outcome yet


class MapBook:
    """Every item's place in the queue, tries and outcome.

    Args:
        count: how many items.
        retries: how many times a failed item is tried again (on another slot where one is
            alive), before its failure is its outcome.
        on_settle: called with each item's index and outcome once it has one (`Launcher.imap`).
    """

    def __init__(
        self, count: int, retries: int, on_settle: Callable[[int, Any], None] | None = None
    ) -> None:
        self.retries = retries
        self.on_settle = on_settle  # called with each item's index and outcome, once
        self.queue: deque[int] = deque(range(count))
        self.tries = [0] * count
        self.outcomes: list[Any] = [_PENDING] * count
        self.failed: set[int] = set()  # items whose outcome is an exception
        self.where_failed: dict[int, SlotKey] = {}  # the slot an item last failed on
        self.free: set[int] = set()  # items whose node was lost once: that try did not count
        self._left = count

    def next_for(self, slot: SlotKey, *, alone: bool) -> int | None:
        """The item `slot` runs next, taken from the queue; None: none for it now.

        An item that failed on `slot` waits for another slot, unless `slot` is the only one
        alive (`alone`).
        """
        for position, index in enumerate(self.queue):
            if alone or self.where_failed.get(index) != slot:
                del self.queue[position]
                self.tries[index] += 1
                return index
        return None

    def succeeded(self, index: int, value: Any) -> None:
        """Item `index` returned `value`."""
        self._settle(index, value)

    def failed_on(self, index: int, slot: SlotKey, error: BaseException) -> bool:
        """Item `index` failed on `slot` with `error`; True: it waits in the queue again."""
        if self.tries[index] - (index in self.free) <= self.retries:
            self.where_failed[index] = slot
            self.queue.appendleft(index)  # before the items never tried: it is retried soon
            return True
        self.failed.add(index)
        self._settle(index, error)
        return False

    def lost_on(self, index: int, slot: SlotKey, error: BaseException) -> bool:
        """Item `index` ran on `slot` when its node was lost; True: it waits in the queue again.

        The first such loss does not use one of its tries (the node's loss need not be the
        item's doing); a second one counts as a failed try (`failed_on`), so that an item
        which kills its node cannot go on to kill every node.
        """
        if index in self.free:
            return self.failed_on(index, slot, error)
        self.free.add(index)
        self.queue.appendleft(index)
        return True

    def abandon(self, error: BaseException) -> None:
        """Every item without an outcome fails with `error`: the map ends now."""
        self.queue.clear()
        for index, outcome in enumerate(self.outcomes):
            if outcome is _PENDING:
                self.failed.add(index)
                self._settle(index, error)

    def give_up(self, error_for: Any) -> None:
        """Every item still queued fails with ``error_for(index)`` (no slot is left to run it)."""
        while self.queue:
            index = self.queue.popleft()
            self.failed.add(index)
            self._settle(index, error_for(index))

    @property
    def finished(self) -> bool:
        """Whether every item has its outcome."""
        return self._left == 0

    @property
    def left(self) -> int:
        """How many items have no outcome yet."""
        return self._left

    def _settle(self, index: int, outcome: Any) -> None:
        if self.outcomes[index] is not _PENDING:
            return
        self._left -= 1
        self.outcomes[index] = outcome
        if self.on_settle is not None:
            self.on_settle(index, outcome)
