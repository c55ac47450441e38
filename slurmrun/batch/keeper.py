"""A reservation's batch step: the keeper, which starts the agents once and lends them out.

`slurmrun.reserve` submits a job whose batch script runs ``python -m slurmrun.batch.keeper``.
The keeper starts the agents as a launch would (one srun step, one agent per node), with
itself as their launcher, and keeps them: heartbeats, and the output of no one's run given
back. Launchers outside the job (`slurmrun.launcher.agents.reserved`) attach one at a time,
authenticated by the secret of the reservation's record (`slurmrun.reservations`, readable by
the reserving user only), and the keeper carries frames between them and the agents
(`slurmrun.batch.keeper_links`). A launcher that goes (its connection ends, or falls silent
for the heartbeat timeout) ends its session: its run ends on every node. With no launcher
attached for `idle_timeout` seconds the keeper ends the job, and says so in the job's log.

Outside a job (no ``SLURM_JOB_ID``), ``--job-id NAME`` names the record, and the agents start
as a launch's would there (localhost): kept workers across launchers on a machine without
SLURM, as the GPU suite runs them.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from slurmrun import protocol
from slurmrun.authentication import AuthenticationError, new_secret, server_handshake
from slurmrun.batch.keeper_links import AgentLink, Session
from slurmrun.batch.keeper_streams import (
    HANDSHAKE_TIMEOUT,
    Streams,
    accept_each,
    set_timeouts,
)
from slurmrun.launcher.address import address_toward, listen
from slurmrun.launcher.agents.common import silence as agent_silence
from slurmrun.launcher.agents.srun_step import SrunAgents
from slurmrun.launcher.agents.starters import AgentStarter
from slurmrun.launcher.options import Options
from slurmrun.launcher.plan import make_plan
from slurmrun.log_dirs import LOG_DIR_VAR, resolve_log_dir
from slurmrun.reservations import ReservationRecord
from slurmrun.transport import Connection
from slurmrun.variables import HEARTBEAT_VAR
from slurmrun.waiting import wait_readable

__all__ = ["Keeper", "main"]


def say(line: str) -> None:
    """A line of the keeper's in the job's log."""
    print(f"slurmrun reservation: {line}", file=sys.stderr, flush=True)


@dataclass
class Keeper:
    """The agents of a reservation, and the launcher attached to them (one at a time)."""

    links: list[AgentLink]
    secret: bytes  # what launchers prove
    silence: float  # a launcher or agent silent this long is gone
    heartbeat: float
    idle_timeout: float
    sessions: int = 0
    session: Session | None = None
    last_run: int = 0  # the highest agent-side run id handed out
    idle_since: float = field(default_factory=time.monotonic)
    ended: str = ""  # why the reservation ends
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: threading.Event = field(default_factory=threading.Event)
    streams: Streams | None = None  # the workers' own connections, set by `take_streams`
    record: ReservationRecord | None = None  # rewritten when a launcher comes or goes

    def _rewrite(self, change: Callable[[ReservationRecord], ReservationRecord]) -> None:
        """Rewrites the record (`slurmrun jobs` reads it) as `change` makes it, until the end."""
        with self.lock:  # never after `end`: the record may be removed then
            if self.record is not None and not self.done.is_set():
                self.record = change(self.record)
                with contextlib.suppress(OSError):
                    self.record.write()

    def _note(self, attached: str) -> None:
        """Says in the record who is attached (`slurmrun jobs` shows it)."""
        idle = 0.0 if attached else time.time()
        self._rewrite(lambda record: replace(record, attached=attached, idle_since=idle))

    def lose(self, link: AgentLink, why: str) -> None:
        """Agent `link` is gone: the reservation goes on with the others, and ends with the last.

        The attached launcher's run fails on that node (its connection closes), as a launch's
        whose agent died: with ``min_hosts`` it restarts on the others. The record names the
        node lost, so that later launches leave it out.
        """
        with self.lock:
            if link.lost or self.done.is_set():
                return
            link.lost = why
            live = [other.hostname for other in self.links if other is not link and not other.lost]
        link.lose(why)
        if not live:
            self.end(why)
            return
        say(f"{why}; going on with {', '.join(live)}")
        self._rewrite(lambda record: replace(record, lost={**record.lost, link.hostname: why}))

    def end(self, why: str) -> None:
        """The reservation ends (the first reason is kept); no launcher attaches from now on."""
        with self.lock:
            self.ended = self.ended or why
            self.done.set()

    def note_run(self, run: int) -> None:
        """An agent-side run id was handed out."""
        with self.lock:
            self.last_run = max(self.last_run, run)

    def serve(self, server: socket.socket) -> None:
        """Takes launchers on `server` until the reservation ends."""
        for link in self.links:
            lost = functools.partial(self.lose, link)
            threading.Thread(target=link.read_agent, args=(lost,), daemon=True).start()
        threading.Thread(target=self._clock, daemon=True).start()
        accept_each(server, self._take, self.done)

    def _clock(self) -> None:
        beat = protocol.Heartbeat().header()
        while not self.done.wait(self.heartbeat):
            now = time.monotonic()
            for link in self.links:
                if link.lost:
                    continue
                with contextlib.suppress(OSError):
                    link.conn.send_nowait(beat)
                if now - link.heard > self.silence:
                    silent = f"the agent on {link.hostname} was silent for {self.silence:g} s"
                    self.lose(link, silent)
            with self.lock:
                idle = self.session is None and now - self.idle_since > self.idle_timeout
            if idle:
                self.end(f"no launcher attached for {self.idle_timeout:g} s (idle_timeout)")

    def _take(self, sock: socket.socket) -> None:
        """One launcher's connection: proven, then a session's control, or an agent's."""
        try:
            server_handshake(sock, self.secret, HANDSHAKE_TIMEOUT)
            sock.settimeout(HANDSHAKE_TIMEOUT)
            conn = Connection(sock)
            frame = conn.recv()
            if frame is None:
                sock.close()
                return
            message = protocol.parse(frame.header)
        except (AuthenticationError, OSError, EOFError, protocol.ProtocolError):
            sock.close()
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        set_timeouts(sock, self.silence)
        if isinstance(message, protocol.Attach):
            self._attach(conn, message)
        elif isinstance(message, protocol.Join):
            self._join(conn, message)
        else:
            conn.close()

    def _attach(self, conn: Connection, attach: protocol.Attach) -> None:
        with self.lock:
            held = self.session
            busy = [link.hostname for link in self.links if link.run and not link.lost]
            if self.done.is_set():
                held, busy = None, ["every node (the reservation is ending)"]
            elif held is None and not busy:
                self.sessions += 1
                silence = max(self.silence, attach.silence)
                held = self.session = Session(
                    self.sessions, conn, self.last_run, attach.pid, attach.host, silence
                )
                session: Session | None = held
            else:
                session = None
        if session is None:
            why = (
                f"a launcher (pid {held.pid} on {held.host}) holds the reservation's agents"
                if held is not None
                else f"the last launcher's run is still ending on {busy}"
            )
            with contextlib.suppress(OSError):
                conn.send(protocol.Refused(why=why, busy=True).header())
            conn.close()
            return
        say(f"launcher pid {attach.pid} on {attach.host} attached (session {session.id})")
        self._note(f"pid {attach.pid} on {attach.host}")
        hostnames = [link.hostname for link in self.links]
        try:
            conn.send(protocol.Attached(session=session.id, hostnames=hostnames).header())
        except OSError:
            self._detach(session)
            return
        threading.Thread(target=self._watch, args=(session,), daemon=True).start()

    def _watch(self, session: Session) -> None:
        """Waits for the session's control connection to end, then ends the session.

        The launcher sends nothing on it after ATTACH: its liveness is judged on its agents'
        connections, where its heartbeats come. Once none of those is left for `silence` s
        (never joined, or all closed), the session ends too.
        """
        sock = session.control.sock
        set_timeouts(sock, 0.0)
        with contextlib.suppress(OSError, EOFError):
            while True:
                if wait_readable([sock.fileno()], session.silence):
                    if session.control.recv() is None:
                        break
                elif not any(link.session is session for link in self.links):
                    break
        self._detach(session)

    def _detach(self, session: Session) -> None:
        with self.lock:
            if session.ended.is_set():
                return
            session.ended.set()
        for link in self.links:
            if link.session is session:
                link.detach()
        session.control.close()
        with self.lock:
            if self.session is session:
                self.session = None
                self.idle_since = time.monotonic()
        say(f"launcher pid {session.pid} on {session.host} detached (session {session.id})")
        self._note("")

    def _join(self, conn: Connection, join: protocol.Join) -> None:
        if join.stream:
            if self.streams is None:
                conn.close()
            else:
                self.streams.join(conn, join)
            return
        with self.lock:
            session = self.session
        ok = session is not None and session.id == join.session
        if not ok or not 0 <= join.node_rank < len(self.links) or self.links[join.node_rank].lost:
            conn.close()
            return
        assert session is not None  # noqa: S101 - ok says so
        set_timeouts(conn.sock, 0.0)  # its heartbeats are waited for as agents do (keeper_links)
        link = self.links[join.node_rank]
        try:
            link.attach(session, conn)
        except OSError:
            conn.close()
            return
        link.read_launcher(session, conn, self.note_run)

    def take_streams(self, server: socket.socket, secret: bytes) -> None:
        """Takes the workers' own connections (large results) on the agents' `server`."""
        self.streams = Streams(secret, self.silence, self._attached, self.done)
        accept_each(server, self.streams.take, self.done)

    def _attached(self) -> Session | None:
        with self.lock:
            return self.session

    def close(self, starter: AgentStarter, grace: float = 5.0) -> None:
        """Tells every agent to exit, and stops their step."""
        with self.lock:
            session = self.session
        if session is not None:
            self._detach(session)
        close = protocol.Close().header()
        for link in self.links:
            with contextlib.suppress(OSError):
                if not link.lost:
                    link.conn.send(close)
        starter.stop(grace)
        for link in self.links:
            link.conn.close()


def _accept_agents(
    server: socket.socket, secret: bytes, hostnames: Sequence[str], timeout: float
) -> list[AgentLink]:
    """Each agent's connection and hello, in node-rank order (bounded by `timeout`)."""
    links: dict[int, AgentLink] = {}
    deadline = time.monotonic() + timeout
    while len(links) < len(hostnames):
        left = deadline - time.monotonic()
        if left <= 0:
            missing = [h for i, h in enumerate(hostnames) if i not in links]
            raise TimeoutError(f"the agents on {missing} did not connect within {timeout:g} s")
        server.settimeout(left)
        sock, _ = server.accept()
        try:
            server_handshake(sock, secret, HANDSHAKE_TIMEOUT)
            sock.settimeout(HANDSHAKE_TIMEOUT)
            conn = Connection(sock)
            frame = conn.recv()
        except (AuthenticationError, OSError, EOFError):
            sock.close()
            continue
        if frame is None or frame.header.get("t") != protocol.Hello.kind:
            sock.close()
            continue
        hello = protocol.Hello.from_header(frame.header)
        rank = hello.node_rank if hello.node_rank >= 0 else hostnames.index(hello.hostname)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        links[rank] = AgentLink(rank, hostnames[rank], conn, dict(frame.header))
    return [links[i] for i in range(len(hostnames))]


def _survivable(srun: list[str]) -> list[str]:
    """The agents' srun command, of a step that goes on when one of its agents or nodes is lost.

    A launch's step ends every agent when one fails (its next attempt starts a new step); the
    keeper's step is the reservation's for its whole life: the others go on serving.
    """
    kept = [arg for arg in srun if not arg.startswith("--kill-on-bad-exit")]
    return [kept[0], "--kill-on-bad-exit=0", "--no-kill", *kept[1:]]


def _attach_address(first: str) -> str:
    """The keeper's address toward the login node (the job's submit host), else its node's.

    A name that resolves to loopback here (the submit host's own name on a one-machine
    cluster) says nothing of the route: the node's name is tried next.
    """
    for name in (os.environ.get("SLURM_SUBMIT_HOST", ""), os.environ.get("SLURMD_NODENAME", first)):
        with contextlib.suppress(RuntimeError, OSError):
            if name and not (found := address_toward(name)).startswith("127."):
                return found
            if name and not (found := socket.gethostbyname(name)).startswith("127."):
                return found
    return address_toward(first)


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m slurmrun.batch.keeper")
    parser.add_argument("--folder", required=True)
    parser.add_argument("--idle-timeout", type=float, required=True)
    parser.add_argument("--heartbeat-timeout", type=float, default=15.0)
    parser.add_argument("--connect-timeout", type=float, default=300.0)
    parser.add_argument("--job-id", default=os.environ.get("SLURM_JOB_ID"))
    args = parser.parse_args(argv)
    if not args.job_id:
        parser.error("--job-id is needed outside a SLURM job (SLURM_JOB_ID is not set)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """The keeper: starts the agents, serves launchers, ends the job when idle."""
    args = _arguments(argv)
    job_id: str = args.job_id
    job_dir = Path(args.folder) / job_id
    os.environ[LOG_DIR_VAR] = str(job_dir / "logs")
    cfg = Options(heartbeat_timeout=args.heartbeat_timeout, timeout=args.connect_timeout)
    plan = make_plan(cfg)
    address = plan.address()
    server = listen(address.bind)
    secret = new_secret()
    log_dir = resolve_log_dir()
    start = plan.start(
        cfg, log_dir, secret=secret.hex(), advertise=address.advertise,
        port=str(server.getsockname()[1]),
    )  # fmt: skip
    if isinstance(start.starter, SrunAgents):  # an agent lost leaves the others (min_hosts)
        start.starter.command[:] = _survivable(start.starter.command)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    start.starter.start(start.env)
    try:
        links = _accept_agents(server, secret, plan.hostnames, args.connect_timeout)
    except (TimeoutError, OSError) as e:
        server.close()
        say(f"the agents did not start: {e}")
        start.starter.stop(0.0)
        return 1
    host = _attach_address(plan.hostnames[0])
    attach = socket.create_server((host, 0))
    silence = agent_silence(cfg)
    record = ReservationRecord(
        job_id=job_id,
        host=host,
        port=attach.getsockname()[1],
        secret=ReservationRecord.new_secret(),
        hostnames=list(plan.hostnames),
        folder=str(Path(args.folder).resolve()),
        pid=os.getpid(),
        node=os.environ.get("SLURMD_NODENAME", plan.hostnames[0]),
        idle_since=time.time(),
        restarts=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        started=time.time(),
    )
    keeper = Keeper(
        links,
        bytes.fromhex(record.secret),
        silence,
        float(start.env[HEARTBEAT_VAR]),
        args.idle_timeout,
        record=record,
    )

    def on_sigterm() -> None:
        stopped.wait()
        keeper.end("SLURM ended the job (SIGTERM)")  # no launcher attaches from now on
        # At once, not at the end: a launcher must not find agents SLURM is ending (requeued,
        # the job writes a new record when it runs again).
        ReservationRecord.remove(job_id)

    threading.Thread(target=on_sigterm, daemon=True).start()
    threading.Thread(target=keeper.take_streams, args=(server, secret), daemon=True).start()
    record.write()
    say(
        f"agents ready on {', '.join(plan.hostnames)}; launchers attach at {host}:"
        f"{record.port}; the job ends after {args.idle_timeout:g} s with no launcher attached"
    )
    try:
        keeper.serve(attach)
    finally:
        attach.close()
        server.close()
        ReservationRecord.remove(job_id)
        say(f"ending: {keeper.ended or 'interrupted'}")
        keeper.close(start.starter)
    return 0


if __name__ == "__main__":
    sys.exit(main())
