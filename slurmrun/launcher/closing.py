"""Closing a pool's agents: each is told to exit, waited for (bounded), then stopped.

The pool's loop goes on while they close (`_Closing`): their connections end, SLURM may say it
ends their step, and connections that arrive too late are turned away. A Ctrl-C meanwhile is
held back (`interrupts_held`) until nothing is left running.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from slurmrun import protocol
from slurmrun.events import Trace
from slurmrun.launcher.agents.starters import AgentStarter
from slurmrun.launcher.health import StepEndings
from slurmrun.launcher.listener import Listener
from slurmrun.launcher.pump import Closed, Event, Events, Local, all_of, drain, pump
from slurmrun.launcher.share import PoolAgent
from slurmrun.transport import Connection

__all__ = ["Closable", "close_agents", "interrupts_held"]

# Once agents closed their connections, how long their processes (or srun) may take to exit.
STOP_WAIT = 1.0


class Closable(Protocol):
    """What closing takes of a pool of agents (`slurmrun.launcher.pool.AgentPool`)."""

    @property
    def listener(self) -> Listener:
        """Its listener, closed first: no agent connects any more."""

    @property
    def events(self) -> Events:
        """The listener's events, pumped until every agent's connection ended."""

    @property
    def starter(self) -> AgentStarter:
        """What started the agents, stopped last."""

    @property
    def endings(self) -> StepEndings:
        """The agents SLURM is ending the step of: their workers may take longer."""

    @property
    def trace(self) -> Trace | None:
        """The launch's events."""

    @property
    def agents(self) -> Mapping[int, PoolAgent]:
        """Its agents by node rank."""

    @property
    def dead(self) -> set[int]:
        """The node ranks of agents known dead: nothing is sent to them."""

    def agent_of(self, conn: Connection) -> PoolAgent | None:
        """The agent of a connection; None for another (a late one, turned away)."""


def close_agents(pool: Closable, grace: float) -> None:
    """Tells every live agent of `pool` to exit, waits (bounded), then stops what is left."""
    pool.listener.close()
    live = [a for a in pool.agents.values() if not a.closed and a.node_rank not in pool.dead]
    close = protocol.Close().header()
    for agent in live:
        with contextlib.suppress(OSError):
            agent.conn.send(close)
    deadline = time.monotonic() + pool.endings.stop_wait(grace) + 3.0

    all_closed = False
    try:
        all_gone = all_of(live, lambda agent: agent.closed)
        all_closed = pump(pool.events, _Closing(pool), all_gone, deadline)
    finally:  # also on Ctrl-C during a long wait for SLURM: nothing may be left running
        with interrupts_held():  # a second Ctrl-C must not cut this short
            pool.starter.stop(STOP_WAIT if all_closed else 0.0)
            for agent in pool.agents.values():
                agent.conn.close()
            drain(pool.events, _Closing(pool))  # connections still in the accept queue
            pool.listener.join()


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Holds Ctrl-C (SIGINT) back until the block is done, then raises KeyboardInterrupt.

    For what stops processes: interrupted, it would leave them running. Only the main
    thread can install the handler; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


def _parsed(header: dict[str, Any]) -> protocol.Message | None:
    """The message in `header`; None for one this launcher does not know (it is closing)."""
    try:
        return protocol.parse(header)
    except protocol.ProtocolError:
        return None


@dataclass
class _Closing:
    """The pool's loop while it closes: connections end, late ones are turned away."""

    pool: Closable

    def on_event(self, event: Event, now: float) -> None:
        if isinstance(event, Local):
            event.unowned()
            return
        agent = self.pool.agent_of(event.conn)
        if isinstance(event, Closed):
            if agent is not None:
                agent.closed = True
        elif agent is None:
            event.conn.close()  # authenticated, but too late to take part
        elif isinstance(_parsed(event.frame.header), protocol.Terminating):
            self.pool.endings.note(agent, self.pool.trace)

    def on_tick(self, now: float) -> None:
        """Nothing to judge: the pool is going."""
