"""The keeper's side of each agent: its frames carried to the attached launcher, or answered.

Each agent of a reservation connected once, to the keeper (`slurmrun.batch.keeper`), which is
its launcher for its whole life. While no launcher is attached, the keeper answers it as a
launcher would between runs: heartbeats, and credit for output that arrives late. While one
is, every frame goes through unchanged but for its run id: the agents count runs over the
reservation's life (a run id they ended once stays ended), each launcher from 1, so a session
adds its `offset` on the way in and takes it off on the way out; a frame of an earlier
session's run is not the launcher's, and is answered here.

Frames are read whole and then sent, never streamed through half-read: a launcher that goes
away in the middle of one leaves the agent's stream at a frame's boundary.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slurmrun import protocol
from slurmrun.peer_acks import STOPPED_WAIT, host_answers
from slurmrun.transport import Connection, Frame
from slurmrun.waiting import wait_readable

__all__ = ["AgentLink", "Session"]


def _launcher_speaks(sock: socket.socket, silence: float) -> bool:
    """Waits for the launcher's next frame; True once one comes (or its connection ends).

    As an agent does (`slurmrun.node.launcher_silence`): after `silence` s without a
    heartbeat the launcher is gone only if its host does not acknowledge what the keeper
    sends either (a launcher stopped with Ctrl-Z is waited for, up to `STOPPED_WAIT`).

    Raises:
        BlockingIOError: the launcher is gone.
    """
    if wait_readable([sock.fileno()], silence):
        return True
    since = time.monotonic() - silence
    while host_answers(sock, silence / 2) and time.monotonic() - since < STOPPED_WAIT:
        if wait_readable([sock.fileno()], silence):
            return True
    raise BlockingIOError(f"the launcher sent nothing for {silence:g} s")


@dataclass
class Session:
    """One attached launcher: its control connection, and the run ids it is given."""

    id: int
    control: Connection
    offset: int  # agent-side run id = launcher's run id + offset
    pid: int
    host: str
    silence: float  # the launcher silent this long is gone
    ended: threading.Event = field(default_factory=threading.Event)


@dataclass
class AgentLink:
    """One agent, kept by the keeper; its frames go to `launcher` while one is attached."""

    rank: int
    hostname: str
    conn: Connection
    hello: dict[str, Any]  # its hello, its master port kept current (IDLE renews it)
    heard: float = field(default_factory=time.monotonic)
    run: int = 0  # the agent-side id of the run it has not said IDLE for (0: none)
    launcher: Connection | None = None
    session: Session | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    lost: str = ""  # why the keeper gave it up (it died or fell silent); "": it serves

    def attach(self, session: Session, conn: Connection) -> None:
        """`conn` carries this agent's frames for `session` from now on (hello first)."""
        with self.lock:
            conn.send(dict(self.hello))
            self.launcher, self.session = conn, session

    def detach(self) -> None:
        """No launcher any more: a run still in progress is ended, and answered here."""
        with self.lock:
            conn, self.launcher, self.session = self.launcher, None, None
            run = self.run
        if conn is not None:
            conn.close()
        if run:
            with contextlib.suppress(OSError):
                self.conn.send(protocol.End(run=run).header())

    def lose(self, why: str) -> None:
        """The agent is gone for good: its launcher's connection closes (its run fails there)."""
        with self.lock:
            conn, self.launcher, self.session = self.launcher, None, None
            self.lost, self.run = why, 0
        if conn is not None:
            conn.close()
        self.conn.close()

    def read_agent(self, on_lost: Callable[[str], None]) -> None:
        """Carries the agent's frames until its connection ends (then `on_lost` says why)."""
        why = "it closed its connection"
        try:
            while (frame := self.conn.recv()) is not None:
                self.heard = time.monotonic()
                self._from_agent(frame)
        except (OSError, EOFError) as e:
            why = f"its connection broke ({e})"
        on_lost(f"the agent on {self.hostname} is gone: {why}")

    def _from_agent(self, frame: Frame) -> None:
        header = frame.header
        kind, run = header.get("t"), header.get("run", 0)
        with self.lock:
            if kind == protocol.Idle.kind and run == self.run:
                self.run = 0
                self.hello["master_port"] = header.get("master_port", 0)
            conn, session = self.launcher, self.session
        if conn is not None and session is not None and (not run or run > session.offset):
            if run:
                header["run"] = run - session.offset
            try:
                conn.send(header, memoryview(frame.body), [memoryview(b) for b in frame.buffers])
            except OSError:
                session.control.close()  # the session's watcher ends it
            else:
                return
        if kind == protocol.Log.kind:  # shown by no one: the window is given back all the same
            cost = protocol.log_cost(len(frame.body))
            with contextlib.suppress(OSError):
                self.conn.send(protocol.Credit(cost=cost, run=run).header())

    def read_launcher(
        self, session: Session, conn: Connection, last_run: Callable[[int], None]
    ) -> None:
        """Carries the launcher's frames to the agent, until CLOSE or the connection ends.

        A CLOSE is the launcher's, not the agent's: the agent stays, and only this
        connection closes (the launcher sees its agent gone, as it expects); a run the agent
        has not said IDLE for ends, as it would with the agent (a launcher that failed a run
        on another agent closes without ending it here). Anything else that ends the
        connection ends the session.
        """
        closed = False
        try:
            while _launcher_speaks(conn.sock, session.silence) and (
                (frame := conn.recv()) is not None
            ):
                header = frame.header
                kind = header.get("t")
                if kind == protocol.Close.kind:
                    closed = True
                    break
                if kind == protocol.Heartbeat.kind:
                    continue  # the keeper's own heartbeats keep the agent
                run = header.get("run", 0)
                if run:
                    header["run"] = run + session.offset
                if kind == protocol.Start.kind:
                    with self.lock:
                        self.run = header["run"]
                    last_run(header["run"])
                self.conn.send(
                    header, memoryview(frame.body), [memoryview(b) for b in frame.buffers]
                )
        except (OSError, EOFError):
            pass
        if closed or self.lost:  # an agent lost ends its own connection, not the session
            with self.lock:
                mine = self.launcher is conn
            if mine:
                self.detach()
            conn.close()
        else:
            session.control.close()
