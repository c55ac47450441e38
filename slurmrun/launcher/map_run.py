"""A map's run (`Launcher.map`): one run on the pool whose workers are cut into slots.

Every worker runs the node's slot loop (`slurmrun.map_messages`); this run hands the items
out from the queue of a `MapBook`, one to each slot that is idle, and takes each item's value
or exception back. A failed item (it raised, its worker died, it ran past ``item_timeout``)
goes back to the queue for another slot while it has tries left. A slot whose worker died, or
was killed for its item's timeout, is started again by its agent (`SLOT_RESTART`; its node's
other slots go on meanwhile), unless it died before it was ready: then it retires. Once every
item has its outcome, each slot is told there are no more; its worker returns, and the run
ends as any run. A node lost during the map retires its slots (`slurmrun.launcher.map_lost`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slurmrun import protocol
from slurmrun.errors import AgentFailedError, ItemTimeoutError
from slurmrun.events import Event, ItemFailed, ItemFinished, ItemStarted
from slurmrun.launcher.failures import WorkerPlace, worker_died, worker_error
from slurmrun.launcher.map_book import MapBook, Slot, SlotKey, slots_of
from slurmrun.launcher.map_lost import LostNode, lost_rank, retire
from slurmrun.launcher.map_progress import Progress
from slurmrun.launcher.run import Run
from slurmrun.launcher.share import PoolAgent
from slurmrun.map_messages import (
    NO_MORE,
    WORLD,
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

log = logging.getLogger("slurmrun")


@dataclass
class MapRun(Run):
    """The run of one map: `items` (each pickled) by `book`, on slots of `per_item` workers."""

    items: list[bytes] = field(default_factory=list)
    per_item: int = 1
    retries: int = 0
    item_timeout: float | None = None
    progress: Progress = field(default_factory=lambda: Progress(None))
    on_settle: Callable[[int, Any], None] | None = None  # `MapBook.on_settle`
    stop: threading.Event | None = None  # set by another thread: the run ends at once
    min_hosts: int | None = None  # `Launcher.min_hosts`: the map goes on without lost nodes

    def __post_init__(self) -> None:
        super().__post_init__()
        self.book = MapBook(len(self.items), self.retries, self.on_settle)
        self.stopped = False  # `StopMap`: the run ends, whatever is left
        self.slots: dict[SlotKey, Slot] = {}
        self.lost: dict[int, LostNode] = {}  # by node rank
        self.fatal: LostNode | None = None  # the loss that ended the map

    def _hand_out(self) -> None:
        super()._hand_out()
        workers = {node_rank: share.workers for node_rank, share in self._shares.items()}
        self.slots = slots_of(workers, self.per_item)

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
        if agent.node_rank in self.lost:
            return  # its slots retired: what it said last changes nothing
        first = message.local_rank - message.local_rank % self.per_item
        slot = self.slots.get((agent.node_rank, first))
        if slot is None:  # a worker left over, which runs no item: judged as in any run
            super().on_message(agent, message, frame, now)
            return
        self.watch.heard(now)
        rank = message.local_rank - first
        if isinstance(message, ItemReady):
            if slot.became_ready(rank, message.port) and slot.size > 1:
                self._send(slot, WORLD, port=slot.port, ranks=range(1, slot.size))
        elif isinstance(message, ItemValue) and slot.item == message.index:
            if slot.answered(rank, frame):
                self._settle(slot)
        elif isinstance(message, ItemRaised) and slot.item == message.index:
            error = worker_error(self._where(slot, rank), _as_error(message), frame)
            if slot.answered(rank, error):
                self._settle(slot)
            else:  # the others may wait for it in a collective forever
                self._fail_item(slot, error)
                self._kill(slot)
        elif isinstance(message, protocol.Died):
            self._slot_died(slot, rank, message)
        self._feed(now)

    def on_tick(self, now: float) -> None:
        """Kills the workers of items past `item_timeout` (their items fail), then as `Run`.

        A `stop` set ends the run (`Launcher.imap`'s consumer stopped).
        """
        self.stopped = self.stopped or (self.stop is not None and self.stop.is_set())
        if not self.ending and self.item_timeout is not None:
            for slot in self.slots.values():
                if slot.item is not None and now - slot.since > self.item_timeout:
                    self._time_out(slot, now)
            self._feed(now)
        self.progress.tick(self.book, len(self.slots), now)
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
                slot.begin(index, now)
                self._send(slot, index, self.items[index])
                self._emit(
                    ItemStarted(index=index, **self._at(slot), attempt=self.book.tries[index])
                )

    def _send(
        self,
        slot: Slot,
        index: int,
        body: bytes = b"",
        *,
        port: int = 0,
        ranks: range | None = None,
    ) -> None:
        """Sends ITEM `index` to the slot's workers (`ranks` of it: all)."""
        agent = self._shares[slot.key[0]].agent
        for rank in range(slot.size) if ranks is None else ranks:
            local_rank = slot.key[1] + rank
            item = Item(run=self.id, local_rank=local_rank, index=index, port=port)
            self.pool.send(agent, item.header(), body)

    def _settle(self, slot: Slot) -> None:
        """Every worker of the slot answered its item: the first error, or rank 0's value."""
        index = slot.item
        errors = [slot.answers[r] for r in sorted(slot.answers)]
        errors = [e for e in errors if isinstance(e, BaseException)]
        if index is None:
            return
        if errors:
            self._fail_item(slot, errors[0])
            return
        frame = slot.answers[0]
        slot.answers.clear()
        try:
            value = _unpickled(index, frame)
        except RuntimeError as e:
            self._fail_item(slot, e)
            return
        slot.item = None
        self.book.succeeded(index, value)
        seconds = time.monotonic() - slot.since
        self._emit(ItemFinished(index=index, **self._at(slot), seconds=seconds))

    def _fail_item(self, slot: Slot, error: BaseException, *, lost: bool = False) -> None:
        index, slot.item = slot.item, None
        if index is None:
            return
        retried = (self.book.lost_on if lost else self.book.failed_on)(index, slot.key, error)
        message = str(error).splitlines()[0] if str(error) else ""
        name = type(error).__name__
        self._emit(
            ItemFailed(index=index, **self._at(slot), error=name, message=message, retried=retried)
        )

    def _at(self, slot: Slot) -> dict[str, Any]:  # an item event's `host` and `local_rank`
        return {"host": self._shares[slot.key[0]].hostname, "local_rank": slot.key[1]}

    def _emit(self, event: Event) -> None:
        if self.watching.trace is not None:
            self.watching.trace.emit(event)

    def _kill(self, slot: Slot) -> None:
        """Has the slot's live workers killed by their agent (`_slot_died` follows for each)."""
        if slot.killing:
            return
        slot.killing = True
        agent = self._shares[slot.key[0]].agent
        for rank in range(slot.size):
            if rank not in slot.dead:
                cancel = ItemCancel(run=self.id, local_rank=slot.key[1] + rank)
                self.pool.send(agent, cancel.header())

    def _slot_died(self, slot: Slot, rank: int, died: protocol.Died) -> None:
        """A worker of `slot` died: its item fails (unless it failed already), the others die.

        Once all are dead, a slot that was ready is started again while items are left (its
        agent forks the workers again, which say ITEM_READY once more); one that died making
        its world retires, so that a slot that cannot start is not started forever.
        """
        self.watch.sessions.rank_ended((slot.key[0], slot.key[1] + rank))
        if slot.item is not None:
            self._fail_item(slot, worker_died(self._where(slot, rank), died))
        if not slot.died(rank):
            self._kill(slot)  # its world is broken: the others may wait in it forever
            return
        if slot.ready and not slot.retired and not self.book.finished:
            slot.restarted()
            agent = self._shares[slot.key[0]].agent
            for local_rank in slot.local_ranks:
                restart = SlotRestart(run=self.id, local_rank=local_rank)
                self.pool.send(agent, restart.header())
        elif not slot.retired:
            slot.retired = True
            self._results_left -= slot.size  # their results will never come

    def _time_out(self, slot: Slot, now: float) -> None:
        """Kills `slot`'s workers (by their agent) and fails its item (`_slot_died` follows)."""
        self._fail_item(slot, _timed_out(now - slot.since, self.item_timeout, self._where(slot, 0)))
        self._kill(slot)

    def _where(self, slot: Slot, rank: int) -> WorkerPlace:
        share, local_rank = self._shares[slot.key[0]], slot.key[1] + rank
        return WorkerPlace(share.hostname, local_rank, share.rank_offset + local_rank, None)

    # ------------------------------------------------------------------ lost nodes
    def _pump(self) -> None:
        """`Run._pump`, going on after each lost node (`_lose`) while the map can."""
        while True:
            try:
                super()._pump()
            except AgentFailedError as e:
                if not self._lose(e):
                    raise
            else:
                return

    def _lose(self, error: AgentFailedError) -> bool:
        """A node's agent failed: its slots retire (`map_lost`); False: `error` ends the run."""
        rank = lost_rank(error, self._shares)
        if rank is None or self.ending:
            return False
        if rank in self.lost:
            return True  # its connection's end, after its silence: the same loss
        share = self._shares[rank]
        share.agent.closed = True  # nothing more is waited for or judged of it
        left = len(self._shares) - len(self.lost) - 1
        loss = LostNode(self.labels[rank], error, left, len(self._shares), self.min_hosts)
        self.lost[rank] = loss
        slots = [slot for slot in self.slots.values() if slot.key[0] == rank]
        self._results_left -= retire(slots, share.workers, set(share.results))
        self._done_left -= not share.done
        share.done = True
        if loss.fatal:
            self.fatal = loss
            self.book.abandon(error)
            return True
        running = [slot for slot in slots if slot.item is not None]
        for slot in running:
            self._fail_item(slot, error, lost=True)
        log.warning(loss.warning(len(running)))
        self._feed(time.monotonic())
        return True

    # ------------------------------------------------------------------ the end
    def _finished(self) -> bool:
        if self.stopped or self.fatal is not None:
            return True
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


def _unpickled(index: int, frame: Frame) -> Any:
    """Item `index`'s value from its rank 0's `frame`.

    Raises:
        RuntimeError: it could not be unpickled here (the unpickling error: its cause).
    """
    try:
        return loads(frame.body, frame.buffers)
    except Exception as e:
        raise RuntimeError(
            f"the value of item {index} could not be unpickled in the launcher: "
            f"{type(e).__name__}: {e}. Return types that the launcher's Python can import."
        ) from e


def _timed_out(seconds: float, limit: float | None, where: WorkerPlace) -> ItemTimeoutError:
    return ItemTimeoutError(
        f"item ran {seconds:.1f} s, past item_timeout={limit:g} s, on {where}: its slot's "
        "workers were killed"
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
