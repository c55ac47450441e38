"""A map's items and slots, as the launcher keeps them (`Launcher.map`): no process, no socket.

`MapBook` holds the queue of items waiting for a slot, each item's tries, and each item's
outcome (its value or its last exception) in the items' order; `Slot` is one slot of the
map's run. `slurmrun.launcher.map_run` moves them as the slots' messages come.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

__all__ = ["MapBook", "Slot", "SlotKey"]

SlotKey = tuple[int, int]  # (node rank, local rank of the slot's first worker)


@dataclass
class Slot:
    """One slot of a map's run: `per_item` workers of one node, from `key`'s local rank on."""

    key: SlotKey
    ready: bool = False  # it said ITEM_READY: its world is made
    item: int | None = None  # the item it runs
    since: float = 0.0  # when it was given that item
    retired: bool = False  # its worker died before it was ready: it takes no more items
    told_no_more: bool = False  # it was sent NO_MORE: its workers return
    killing: bool = False  # its item ran past the timeout: its worker is being killed
    restarts: int = 0  # how many times its worker was forked again after a death

    @property
    def idle(self) -> bool:
        """Whether it can take an item now."""
        busy = self.item is not None or self.killing or self.told_no_more
        return self.ready and not busy and not self.retired


_PENDING = object()  # an item with no outcome yet


class MapBook:
    """Every item's place in the queue, tries and outcome.

    Args:
        count: how many items.
        retries: how many times a failed item is tried again (on another slot where one is
            alive), before its failure is its outcome.
    """

    def __init__(self, count: int, retries: int) -> None:
        self.retries = retries
        self.queue: deque[int] = deque(range(count))
        self.tries = [0] * count
        self.outcomes: list[Any] = [_PENDING] * count
        self.failed: set[int] = set()  # items whose outcome is an exception
        self.where_failed: dict[int, SlotKey] = {}  # the slot an item last failed on
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
        if self.tries[index] <= self.retries:
            self.where_failed[index] = slot
            self.queue.appendleft(index)  # before the items never tried: it is retried soon
            return True
        self.failed.add(index)
        self._settle(index, error)
        return False

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

    def _settle(self, index: int, outcome: Any) -> None:
        if self.outcomes[index] is _PENDING:
            self._left -= 1
        self.outcomes[index] = outcome
