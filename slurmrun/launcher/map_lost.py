"""A map's lost nodes (`Launcher.map` with ``min_hosts``): their slots retire, the map goes on.

A node is lost when its agent fails during the map: it died, closed its connection, went
silent past ``heartbeat_timeout``, or could not be sent to (an `AgentFailedError` naming its
place). With `Launcher.min_hosts` set and at least that many of the map's nodes left, the map
goes on without it: its slots retire, and the items they ran go back to the queue for the
other slots. The first time an item's node is lost does not use one of the item's tries (a
node's loss need not be the item's doing); a second loss counts as a failed try, so that an
item which kills its node cannot kill them all (`MapBook.lost_on`). Below ``min_hosts`` (or
without it: a map then needs every node, as a run does) the map ends at once: every item
without an outcome fails with the agent's error, and `MapFailedError` says which node was
lost, its ``results`` holding what finished.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from slurmrun.errors import AgentFailedError, ReservationRequeuedError, VersionMismatchError
from slurmrun.launcher.map_book import Slot
from slurmrun.launcher.pool import PoolBroken

__all__ = ["LostNode", "lost_rank", "retire"]

# Failures of every agent at once, or of none in particular: never one node's loss.
_NOT_ONE_NODE = (PoolBroken, VersionMismatchError, ReservationRequeuedError)


def lost_rank(error: BaseException, ranks: Collection[int]) -> int | None:
    """The node rank (one of `ranks`) whose agent `error` says failed; None: not a node's loss."""
    if not isinstance(error, AgentFailedError) or isinstance(error, _NOT_ONE_NODE):
        return None
    return error.node_rank if error.node_rank in ranks else None


def retire(slots: list[Slot], workers: int, answered: set[int]) -> int:
    """Retires a lost node's `slots`; how many results of its `workers` are no longer waited for.

    `answered`: the local ranks whose result came; a slot retired before had its own not
    waited for already.
    """
    waited = set(range(workers)) - answered
    for slot in slots:
        if slot.retired:
            waited -= set(slot.local_ranks)
        slot.retired = True
    return len(waited)


@dataclass(frozen=True)
class LostNode:
    """A node lost during a map, and whether the map goes on without it.

    Attributes:
        label: the node's label (its host, with its place if the host is named twice).
        error: its agent's failure.
        left: the map's nodes not lost.
        nodes: the map's nodes.
        min_hosts: `Launcher.min_hosts`.
    """

    label: str
    error: AgentFailedError
    left: int
    nodes: int
    min_hosts: int | None

    @property
    def fatal(self) -> bool:
        """Whether too few nodes are left for the map to go on."""
        return self.min_hosts is None or self.left < self.min_hosts

    def message(self) -> str:
        """What the map's `MapFailedError` says first when the loss ended it."""
        why = str(self.error).split("\n", 1)[0]
        if self.min_hosts is None:
            rule = (
                "and min_hosts is not set: a map needs every node. Set min_hosts (with "
                "max_restarts >= 1) for its items to go on on the nodes left"
            )
        else:
            rule = f"below min_hosts={self.min_hosts}"
        return (
            f"the map lost node {self.label} ({why}), which leaves {self.left} of its "
            f"{self.nodes} nodes, {rule}. The items that had not finished fail with that "
            "error; .results holds what finished."
        )

    def warning(self, requeued: int) -> str:
        """What the launcher logs when the map goes on without the node."""
        why = str(self.error).split("\n", 1)[0]
        return (
            f"slurmrun: the map lost node {self.label} ({why}); it goes on on the "
            f"{self.left} nodes left (min_hosts={self.min_hosts}), {requeued} item(s) it ran "
            "queued again"
        )
