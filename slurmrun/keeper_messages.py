"""The messages between a launcher outside a reserved job and the job's keeper.

A launcher reaches the keeper that holds the reservation's agents (`slurmrun.batch.keeper`):
first an ATTACH connection (the session), then one JOIN connection per agent, whose frames the
keeper then carries to and from that agent. `slurmrun.protocol` re-exports them, so that its
`parse` knows these kinds on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from slurmrun.messages import Message

__all__ = ["Attach", "Attached", "Bridge", "Join", "Refused"]


@dataclass(frozen=True)
class Attach(Message):
    """A launcher asks the keeper for the reservation's agents (its first frame)."""

    kind: ClassVar[str] = "attach"
    pid: int
    host: str
    # Seconds of its silence after which it counts as gone: its heartbeats come five times in
    # that (0: the keeper's own heartbeat timeout).
    silence: float = 0.0


@dataclass(frozen=True)
class Attached(Message):
    """The keeper gives the agents to the launcher that asked, for session `session`."""

    kind: ClassVar[str] = "attached"
    session: int
    hostnames: list[str]


@dataclass(frozen=True)
class Refused(Message):
    """The keeper cannot give the agents now (`why`: another launcher holds them)."""

    kind: ClassVar[str] = "refused"
    why: str
    busy: bool = False  # another launcher holds them: worth another try later


@dataclass(frozen=True)
class Join(Message):
    """This connection carries agent `node_rank`'s frames for session `session`."""

    kind: ClassVar[str] = "join"
    session: int
    node_rank: int
    stream: int = 0  # the channel of a `Bridge` this connection takes; 0: the agent's frames


@dataclass(frozen=True)
class Bridge(Message):
    """A worker's stream (a large result) reached the keeper: JOIN it as `channel`."""

    kind: ClassVar[str] = "bridge"
    channel: int
