"""One agent as the pool holds it, and its part of a run.

`PoolAgent` is a connected agent for as long as the pool lives; `Share`, its part of one run:
its workers, their ranks, and what came back from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slurmrun import protocol
from slurmrun.transport import Connection, Frame

__all__ = ["PoolAgent", "Share"]


@dataclass
class PoolAgent:
    """One connected agent, as long as the pool lives."""

    node_rank: int
    hostname: str
    conn: Connection
    hello: protocol.Hello
    master_port: int  # for the next run's rank 0, if this agent hosts it
    closed: bool = False  # its connection ended
    run: int | None = None  # the run whose workers it has (until its IDLE)


@dataclass
class Share:
    """One agent's part of the run."""

    agent: PoolAgent
    workers: int = 0
    rank_offset: int = 0  # global rank of its local rank 0
    results: dict[int, Frame] = field(default_factory=dict)
    # Large results come over connections of their own (the frame), announced by the agent
    # behind the worker's earlier output (the local rank); a result counts once both arrived.
    streamed: dict[int, Frame] = field(default_factory=dict)
    announced: set[int] = field(default_factory=set)
    started: bool = False  # its agent reported its workers' pids
    done: bool = False  # all its workers exited and their output was forwarded

    @property
    def hostname(self) -> str:
        """The agent's host."""
        return self.agent.hostname
