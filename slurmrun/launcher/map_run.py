"""A map's run (`Launcher.map`): one run on the pool whose workers are cut into slots.

Every worker runs the node's slot loop (`slurmrun.map_messages`); this run hands the items
out from the queue of a `MapBook`, one to each slot that is idle, and takes each item's value
or exception back. A failed item (it raised, its worker died, it ran past ``item_timeout``)
goes back to the queue for another slot while it has tries left. A slot whose worker died, or
was killed for its item's timeout, is started again by its agent (`SLOT_RESTART`; its node's
other slots go on meanwhile), unless it died before it was ready: then it retires. Once every
item has its outcome, each slot is told there are no more; its worker returns, and the run
ends as any run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slurmrun import protocol
from slurmrun.errors import ItemTimeoutError
from slurmrun.launcher.failures import WorkerPlace, worker_died, worker_error
from slurmrun.launcher.map_book import MapBook, Slot, SlotKey
from slurmrun.launcher.run import Run
from slurmrun.launcher.share import PoolAgent
from slurmrun.map_messages import (
    NO_MORE,
    Item,
    ItemCancel,
    ItemRaised,
    ItemReady,
    ItemValue,
    SlotRestart,
)
from slurmrun.pickling import loads
from slurmrun.result import LaunchResult
from slurmrun.transport import Frame

__all__ = ["MapRun"]


@dataclass
class MapRun(Run):
    """The run of one map: `items` (each pickled) by `book`, on slots of `per_item` workers."""

    items: list[bytes] = field(default_factory=list)
    per_item: int = 1
    retries: int = 0
    item_timeout: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.book = MapBook(len(self.items), self.retries)
        self.slots: dict[SlotKey, Slot] = {}

    def _hand_out(self) -> None:
        super()._hand_out()
        for node_rank, share in self._shares.items():
            for first in range(0, share.workers - share.workers % self.per_item, self.per_item):
                self.slots[node_rank, first] = Slot((node_rank, first))
        if not self.slots:
            self.book.give_up(lambda index: RuntimeError("the map's run has no slot"))

    # ------------------------------------------------------------------ messages
    def on_message(
        self, agent: PoolAgent, message: protocol.Message, frame: Frame, now: float
    ) -> None:
        """A message of this run: a slot's, or one of any run (`Run.on_message`)."""
        if self.ending or not isinstance(
            message, ItemReady | ItemValue | ItemRaised | protocol.Died
        ):
            super().on_message(agent, message, frame, now)
            return
        first = message.local_rank - message.local_rank % self.per_item
        slot = self.slots.get((agent.node_rank, first))
        if slot is None:  # a worker left over, which runs no item: judged as in any run
            super().on_message(agent, message, frame, now)
            return
        self.watch.heard(now)
        if isinstance(message, ItemReady):
            slot.ready = True
        elif isinstance(message, ItemValue) and slot.item == message.index:
            self._settle_value(slot, message.index, frame)
        elif isinstance(message, ItemRaised) and slot.item == message.index:
            error = _as_error(message)
            self._failed(slot, worker_error(self._where(slot), error, frame))
        elif isinstance(message, protocol.Died):
            self._slot_died(slot, message)
        self._feed(now)

    def on_tick(self, now: float) -> None:
        """Kills the workers of items past `item_timeout` (their items fail), then as `Run`."""
        if not self.ending and self.item_timeout is not None:
            for slot in self.slots.values():
                if slot.item is not None and now - slot.since > self.item_timeout:
                    self._time_out(slot, now)
            self._feed(now)
        super().on_tick(now)

    # ------------------------------------------------------------------ slots
    def _feed(self, now: float) -> None:
        """Gives every idle slot an item; once all are settled, tells each there are no more."""
        alive = [s for s in self.slots.values() if not s.retired]
        if not alive:
            self.book.give_up(lambda index: RuntimeError(_NO_SLOT))
        for slot in alive:
            if not slot.idle:
                continue
            if self.book.finished:
                self._send(slot, NO_MORE)
                slot.told_no_more = True
                continue
            index = self.book.next_for(slot.key, alone=len(alive) == 1)
            if index is not None:
                slot.item, slot.since = index, now
                self._send(slot, index, self.items[index])

    def _send(self, slot: Slot, index: int, body: bytes = b"") -> None:
        agent = self._shares[slot.key[0]].agent
        item = Item(run=self.id, local_rank=slot.key[1], index=index)
        self.pool.send(agent, item.header(), body)

    def _settle_value(self, slot: Slot, index: int, frame: Frame) -> None:
        slot.item = None
        try:
            value = loads(frame.body, frame.buffers)
        except Exception as e:
            error = RuntimeError(
                f"the value of item {index} could not be unpickled in the launcher: "
                f"{type(e).__name__}: {e}. Return types that the launcher's Python can import."
            )
            error.__cause__ = e
            self.book.failed_on(index, slot.key, error)
            return
        self.book.succeeded(index, value)

    def _failed(self, slot: Slot, error: BaseException) -> None:
        index, slot.item = slot.item, None
        if index is not None:
            self.book.failed_on(index, slot.key, error)

    def _slot_died(self, slot: Slot, died: protocol.Died) -> None:
        """A worker of `slot` died: its item fails (unless its timeout failed it already).

        A slot that was ready is started again while items are left (its agent forks the
        worker again, which says ITEM_READY once more); one that died making its world
        retires, so that a slot that cannot start is not started forever.
        """
        self.watch.sessions.rank_ended((slot.key[0], died.local_rank))
        if slot.item is not None:
            self._failed(slot, worker_died(self._where(slot), died))
        slot.killing = False
        if slot.ready and not slot.retired and not self.book.finished:
            slot.ready = False
            slot.restarts += 1
            restart = SlotRestart(run=self.id, local_rank=slot.key[1])
            self.pool.send(self._shares[slot.key[0]].agent, restart.header())
        elif not slot.retired:
            slot.retired = True
            self._results_left -= 1  # its result will never come

    def _time_out(self, slot: Slot, now: float) -> None:
        """Kills `slot`'s workers (by their agent) and fails its item (`_slot_died` follows)."""
        agent = self._shares[slot.key[0]].agent
        cancel = ItemCancel(run=self.id, local_rank=slot.key[1])
        self.pool.send(agent, cancel.header())
        seconds = now - slot.since
        slot.killing = True
        self._failed(
            slot,
            ItemTimeoutError(
                f"item ran {seconds:.1f} s, past item_timeout={self.item_timeout:g} s, on "
                f"{self._where(slot)}: its worker was killed"
            ),
        )

    def _where(self, slot: Slot) -> WorkerPlace:
        share = self._shares[slot.key[0]]
        local_rank = slot.key[1]
        return WorkerPlace(share.hostname, local_rank, share.rank_offset + local_rank, None)

    # ------------------------------------------------------------------ the end
    def _finished(self) -> bool:
        return self.book.finished and super()._finished()

    def _collect(self) -> LaunchResult[Any]:
        """Nothing: the slots return nothing (a retired slot's worker, not even that)."""
        return LaunchResult(hostnames=list(self.pool.hostnames), return_values=[])

    def outcomes(self) -> list[Any]:
        """Every item's value or exception, in the items' order."""
        return list(self.book.outcomes)


_NO_SLOT = (
    "no slot of the map is left to run this item: every slot's worker died or was killed "
    "(their items' errors say why)"
)


def _as_error(raised: ItemRaised) -> protocol.Error:
    """An item's exception as a run's `protocol.Error` (`worker_error` rebuilds it)."""
    return protocol.Error(
        exc_type=raised.exc_type,
        message=raised.message,
        traceback=raised.traceback,
        unpicklable=raised.unpicklable,
        local_rank=raised.local_rank,
        run=raised.run,
    )
