"""The messages of a map (`Launcher.map`): items handed to slots, and what comes back.

A map is one run whose workers are cut into slots (`Launcher.map`'s ``workers_per_item``
workers of one node each). Each slot's worker runs `slurmrun.node.slot`'s loop (named here,
`SLOT_LOOP`, so that the launcher ships it without importing the node's side), which says
READY once its world is made, then runs each ITEM it is given and sends back its value
(ITEM_VALUE) or its exception (ITEM_RAISED), until an ITEM with no index (`NO_MORE`)::

    worker (slot)          agent                 launcher
    ITEM_READY  ---------------------------------->          (once; rank 0's with its port)
                <---------- ITEM <---------------  ITEM (WORLD: the port, to ranks > 0 of a
                                                   slot of several workers, once all are ready)
                <---------- ITEM <---------------  ITEM      (the item pickled in the body)
    ITEM_VALUE or ITEM_RAISED -------------------->          (one per item)
                <---------- ITEM (NO_MORE) ------            the loop returns: RESULT
                            ITEM_CANCEL <-------  (an item past its timeout: the agent kills
                                                   that worker's process group)
                            SLOT_RESTART <------  (a slot's worker died: the agent forks it
                                                   again, which says ITEM_READY once more)

The agent forwards the worker's frames as it forwards every other (stamped with the run and
the local rank), and passes ITEM on to the worker named by its local rank. `slurmrun.protocol`
imports this module, so that its `parse` knows these kinds on both sides.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, ClassVar

from slurmrun.messages import Message, clip

__all__ = [
    "ITEMS_FOLDER",
    "NO_MORE",
    "SLOT_LOOP",
    "WORLD",
    "ByName",
    "Item",
    "ItemCancel",
    "ItemRaised",
    "ItemReady",
    "ItemValue",
    "SlotRestart",
]

NO_MORE = -1  # an ITEM's index when the map has no more items for the slot
ITEMS_FOLDER = "items"  # in the run's log folder: each item's output, <index>.log
WORLD = -2  # an ITEM's index that gives a slot's rank > 0 its world's port (`Item.port`)


@dataclass(frozen=True)
class ByName:
    """A function named by its module and name, imported where it is called.

    The launcher ships the node's slot loop this way: neither side imports the other.
    """

    module: str
    name: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Imports the function and calls it."""
        return getattr(importlib.import_module(self.module), self.name)(*args, **kwargs)


SLOT_LOOP = ByName("slurmrun.node.slot", "serve")


@dataclass(frozen=True)
class Item(Message):
    """Launcher -> agent -> worker `local_rank`: run item `index` (pickled in the body)."""

    kind: ClassVar[str] = "item"
    run: int
    local_rank: int
    index: int  # NO_MORE: return; WORLD: join the slot's world at `port`
    port: int = 0


@dataclass(frozen=True)
class ItemCancel(Message):
    """Launcher -> agent: kill worker `local_rank` (its item ran past the map's timeout)."""

    kind: ClassVar[str] = "item_cancel"
    run: int
    local_rank: int


@dataclass(frozen=True)
class SlotRestart(Message):
    """Launcher -> agent: fork worker `local_rank` again (it died; its slot takes more items)."""

    kind: ClassVar[str] = "slot_restart"
    run: int
    local_rank: int


@dataclass(frozen=True)
class ItemReady(Message):
    """Worker -> launcher: the slot's world is made; it takes items."""

    kind: ClassVar[str] = "item_ready"
    port: int = 0  # rank 0's: its world's MASTER_PORT (its store listens there)
    local_rank: int = -1
    run: int = 0


@dataclass(frozen=True)
class ItemValue(Message):
    """Worker -> launcher: item `index` returned the value pickled in the body."""

    kind: ClassVar[str] = "item_value"
    index: int
    local_rank: int = -1
    run: int = 0


@dataclass(frozen=True)
class ItemRaised(Message):
    """Worker -> launcher: item `index` raised the exception pickled in the body (if it could be).

    Its fields are `slurmrun.protocol.Error`'s, so that the launcher rebuilds it as it
    rebuilds a run's error (remote traceback kept).
    """

    kind: ClassVar[str] = "item_raised"
    index: int
    exc_type: str
    message: str  # clipped to TEXT_LIMIT
    traceback: str  # clipped to TEXT_LIMIT
    unpicklable: str | None = None  # why the exception could not be pickled
    local_rank: int = -1
    run: int = 0

    def __post_init__(self) -> None:
        for name in ("exc_type", "message", "traceback"):
            object.__setattr__(self, name, clip(getattr(self, name)))
        if self.unpicklable is not None:
            object.__setattr__(self, "unpicklable", clip(self.unpicklable))
