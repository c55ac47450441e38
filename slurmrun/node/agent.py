"""The agent: one per node. It connects back to the launcher, forks workers and relays results.

Started by `slurmrun.node.agent_main` (which forks the worker spawner first) with the launcher's
address, port and secret in the environment (``SLURMRUN_LAUNCHER_ADDR``,
``SLURMRUN_LAUNCHER_PORT``, ``SLURMRUN_SECRET``). The spawner is forked before the secret is
read into any Python object, and both processes wipe every copy of it from their environment
(`slurmrun.node.spawner.forget_variable`), so no worker can find it in its memory.

The agent lives as long as its launcher keeps it (`slurmrun.protocol` draws the exchange):
each START forks that run's workers from the spawner, and END stops them; the agent then says
IDLE and waits for the next run, until CLOSE, the launcher's connection ending, or the
launcher's silence.

The agent never unpickles anything: `func` travels from the launcher to the workers, and the
workers' results travel back, as opaque bytes that the agent only forwards.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import signal
import socket
import struct
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from slurmrun import protocol, variables
from slurmrun.authentication import client_handshake
from slurmrun.environment import FORWARDED_SIGNALS
from slurmrun.node.agent_connect import connect_with_backoff
from slurmrun.node.health_check import healthy
from slurmrun.node.kept import KeptWorkers, ended_by, lost_after
from slurmrun.node.launcher_silence import wait_for_launcher
from slurmrun.node.link import LauncherConnection, say
from slurmrun.node.proctitle import node_name
from slurmrun.node.relay import Relay, WorkerLink
from slurmrun.node.slot_workers import SlotWorkers
from slurmrun.node.spawner import Spawner, SpawnError
from slurmrun.node.store_port import StorePort
from slurmrun.node.supervisor import RunWorkers, ToWorker, no_stacks
from slurmrun.protocol import HEARTBEATS_PER_TIMEOUT
from slurmrun.slurm.job import agent_auto_workers
from slurmrun.slurm.step import step_id
from slurmrun.transport import Frame, bound_unacknowledged_sends
from slurmrun.variables import HEARTBEAT_VAR
from slurmrun.versions import protocol_fingerprint, slurmrun_version, where_installed

__all__ = ["Agent", "RunEnds", "main"]

HANDSHAKE_TIMEOUT = 30.0
# How long an agent keeps trying to reach its launcher (seconds; the agent then exits with 1,
# which fails the launch at once, naming this host). A launcher that thousands of agents reach
# within a second can see its listen backlog full: such connects are refused or time out.
CONNECT_RETRY_VAR = "SLURMRUN_CONNECT_RETRY"
CONNECT_RETRY = 60.0
STREAM_CONNECT_RETRY = 2.0


class RunEnds:
    """Which runs the launcher ended (END carries the run's id), or all of them (it is gone).

    A run's end is its own: an END that arrives while the agent still finishes an earlier run,
    or a START that arrives right behind an END, never ends or revives the wrong run.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._through = 0  # every run up to this one is ended
        self._all = False
        self._keep = 0  # the last run whose END said to keep its workers
        self._after_sigterm = 0  # the last run whose END came from a launcher that got SIGTERM

    def end(self, run: int, keep: bool = False, after_sigterm: bool = False) -> None:
        """The launcher ended `run` (and so every run before it); `keep`: keep its workers.

        `after_sigterm`: the launcher got SIGTERM (`protocol.End.after_sigterm`).
        """
        with self._cond:
            self._through = max(self._through, run)
            if keep:
                self._keep = run
            if after_sigterm:
                self._after_sigterm = run
            self._cond.notify_all()

    def sigterm_lag(self, run: int) -> float:
        """How long to wait for SLURM's SIGTERM before signalling `run`'s workers (`End`)."""
        return protocol.SIGTERM_LAG if self._after_sigterm == run else 0.0

    def keeps(self, run: int) -> bool:
        """Whether the launcher ended `run` keeping its workers (and is still here)."""
        return not self._all and self._keep == run

    def end_all(self) -> None:
        """The launcher is gone: every run is over."""
        with self._cond:
            self._all = True
            self._cond.notify_all()

    def ended(self, run: int) -> bool:
        """Whether `run` is over."""
        return self._all or run <= self._through

    def gone(self) -> bool:
        """Whether the launcher is gone (no run will come)."""
        return self._all

    def wait(self, run: int) -> None:
        """Waits until `run` is over (the launcher's silence ends every wait: `_read_launcher`)."""
        with self._cond:
            self._cond.wait_for(lambda: self.ended(run))

    def wait_gone(self, timeout: float) -> bool:
        """Waits up to `timeout` s for the launcher to be gone; whether it is."""
        with self._cond:
            return self._cond.wait_for(self.gone, timeout)


@dataclass
class Agent:
    """State of one agent process, kept from run to run; each run's workers are a `RunWorkers`."""

    launcher: LauncherConnection
    hostname: str
    spawner: Spawner | None  # None: workers cannot start here (hello said why)
    connect: Callable[[], socket.socket]  # a new authenticated connection to the launcher
    store_port: StorePort = field(default_factory=StorePort)  # for the next run's rank 0
    silence: float = 15.0  # a launcher silent this long is gone (see _expect_heartbeats)
    # START frames, then None once the launcher closed, went away or went silent.
    inbox: queue.Queue[Frame | None] = field(default_factory=queue.Queue)
    runs: RunEnds = field(default_factory=RunEnds)
    current: RunWorkers | None = None  # the run in progress
    kept: KeptWorkers | None = None  # the last run's workers, waiting for the next run
    lost: str = ""  # why the last run's workers, to be kept, were not
    relay: Relay = field(init=False)  # carries the workers' output and frames to the launcher
    # SLURM is ending our step: the workers got its SIGTERM and have until its SIGKILL.
    slurm_ending: threading.Event = field(default_factory=threading.Event)
    in_step: bool = False  # in a SLURM step: SLURM's SIGTERM reaches the workers itself
    # TERMINATING was sent (once, and before any DIED that follows)
    _ending_said: bool = field(default=False, init=False)
    _ending_lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        self.relay = Relay(self.launcher, self.connect, before_error=self._say_terminating)

    def _read_launcher(self) -> None:
        try:
            while True:
                wait_for_launcher(self.launcher.sock, self.silence, self.launcher.hostname)
                frame = self.launcher.recv()
                if frame is None:
                    break
                message = protocol.parse(frame.header)
                if isinstance(message, protocol.Close):
                    break
                self._take(message, frame)
        except BlockingIOError:
            _say(f"the launcher sent nothing for {self.silence:g} s: stopping the workers.")
        except protocol.ProtocolError as e:
            _say(f"the launcher sent a message this agent does not know ({e}): stopping.")
        except (OSError, EOFError):  # EOFError: the launcher died in the middle of a frame
            pass
        finally:
            # Whatever ended the reader, the agent must stop waiting for runs: nothing else
            # would ever wake `serve`, and the agent would outlive its launcher.
            self.relay.window.close()
            self.runs.end_all()
            self.inbox.put(None)

    def _take(self, message: protocol.Message, frame: Frame) -> None:
        """One message of the launcher (but CLOSE, which ends the reader)."""
        if isinstance(message, protocol.Credit):
            self.relay.window.release(message.cost, message.run)
        elif isinstance(message, protocol.Start):
            self.relay.window.begin(message.run, message.output_window)
            self.inbox.put(frame)
        elif isinstance(message, protocol.End):
            self.runs.end(message.run, message.keep, message.after_sigterm)
        elif isinstance(message, protocol.AskStacks):
            self._stacks(message)
        elif isinstance(message, ToWorker):  # a debugger's line, a map's item
            current = self.current
            if current is not None and current.start.run == message.run:
                current.pass_on(message, bytes(frame.body))

    def _stacks(self, ask: protocol.AskStacks) -> None:
        """Answers ASK_STACKS: a report on a thread of its own, a sample at once.

        A report waits for the workers' answers and dumps the silent; a sample is only passed
        on (the workers answer it; the launcher waits).
        """
        current = self.current
        if current is not None and current.start.run == ask.run:
            if not ask.dumps():
                current.stacks(ask)  # passed on at once: no wait
                return
            threading.Thread(target=current.stacks, args=(ask,), daemon=True).start()
            return
        no_stacks(self.launcher, ask, "no workers of that run here")

    def _heartbeat(self, interval: float) -> None:
        beat = protocol.Heartbeat().header()
        while not self.runs.wait_gone(interval):
            try:
                self.launcher.send(beat)
            except OSError:
                self.runs.end_all()
                return

    def serve(self) -> None:
        """Runs every run the launcher starts, until it closes, goes away or goes silent."""
        while (frame := self.inbox.get()) is not None:
            if self.spawner is None:
                continue  # the launcher fails the run on our hello's error, and closes
            start = protocol.Start.from_header(frame.header)
            kept, fresh_why = self._take_kept(start)
            if kept is None and not healthy(start, self.launcher):
                return
            run = self._workers(start)
            self.current = run
            keep = False
            try:
                run.spawn(bytes(frame.body), kept, fresh_why)
                lag = functools.partial(self._sigterm_lag, start.run)
                run.supervise(functools.partial(self.runs.ended, start.run), lag)
                self.runs.wait(start.run)
                keep = start.keep and self.runs.keeps(start.run)
            except SpawnError as e:
                self.launcher.cut(f"cannot start workers: {e}")
                raise
            finally:
                links = run.finish(keep, self._sigterm_lag(start.run))
                self.current = None
                if links is not None:
                    self.kept = KeptWorkers(start, links)
                elif start.keep:
                    self.lost = lost_after(start.run)
            if not self.runs.gone():
                idle = protocol.Idle(run=start.run, master_port=self.store_port.renew())
                with contextlib.suppress(OSError):  # cut: the launcher sees the end
                    self.launcher.send(idle.header())

    def _sigterm_lag(self, run: int) -> float:
        """How long to wait for SLURM's SIGTERM before signalling `run`'s workers ourselves."""
        return self.runs.sigterm_lag(run) if self.in_step else 0.0

    def _workers(self, start: protocol.Start, links: list[WorkerLink] | None = None) -> RunWorkers:
        if self.spawner is None:
            raise SpawnError("workers cannot start here (the agent's hello said why)")
        return (SlotWorkers if start.workers_per_item else RunWorkers)(  # a map's, or a run's
            start=start,
            spawner=self.spawner,
            hostname=self.hostname,
            launcher=self.launcher,
            relay=self.relay,
            store_port=self.store_port,
            slurm_ending=self.slurm_ending,
            say_terminating=self._say_terminating,
            in_step=self.in_step,
            workers=list(links or []),
        )

    def _take_kept(self, start: protocol.Start) -> tuple[list[WorkerLink] | None, str]:
        """The kept workers if they can take `start`, else None (they are stopped) and why."""
        kept, self.kept = self.kept, None
        lost, self.lost = self.lost, ""
        why = lost
        if kept is not None:
            why = kept.why_not(start) if start.keep else ""
            if start.keep and not why:
                return kept.links, ""
            self._workers(kept.start, kept.links).finish()
            self.lost = "" if start.keep else ended_by(start.run, kept.start.run)  # (a map's)
        return None, why if start.keep else ""

    def forward_signal(self, signum: int) -> None:
        """Passes a signal from SLURM (e.g. ``--signal=USR1@60``) on to every live worker."""
        current = self.current
        if current is not None:
            current.forward_signal(signum)

    def on_slurm_sigterm(self) -> None:
        """SLURM ends this step: every worker got the same SIGTERM, and SLURM's SIGKILL follows.

        The workers may use that time (to checkpoint): `RunWorkers.stop` then waits for them,
        and the launcher is told (by `announce_slurm_ending`'s thread: a signal handler must
        not take locks the main thread may hold), so that it waits for this agent as long.
        """
        self.slurm_ending.set()

    def announce_slurm_ending(self) -> None:
        """Runs in a thread of its own: tells the launcher once SLURM is ending the step."""
        while not self.slurm_ending.wait(1.0):
            if self.runs.gone():
                return
        self._say_terminating()

    def _say_terminating(self) -> None:
        """Tells the launcher (once) that SLURM is ending this step, if it is."""
        with self._ending_lock:
            if self._ending_said or not self.slurm_ending.is_set():
                return
            self._ending_said = True
            _say(
                "SLURM is ending this step (SIGTERM, which the workers got too): waiting up to "
                f"{protocol.SLURM_TERM_WAIT:g} s for them to exit, or for SLURM to kill them."
            )
            with contextlib.suppress(OSError):  # cut: the launcher sees the end
                self.launcher.send(protocol.Terminating().header())

    def stop_workers(self) -> None:
        """Stops the run in progress, if any, and kept workers (on the agent's way out)."""
        current = self.current
        if current is not None:
            current.stop()
        kept, self.kept = self.kept, None
        if kept is not None and self.spawner is not None:
            self._workers(kept.start, kept.links).finish()


def _say(message: str) -> None:
    say(node_name(os.environ), message)


def _expect_heartbeats(sock: socket.socket, silence: float) -> None:
    """Makes every receive on `sock` fail (BlockingIOError) after `silence` s without data.

    The launcher sends heartbeats; when its host vanishes (no FIN, no RST), nothing else would
    ever end a read, and the workers would keep their GPUs. Sends that stay unacknowledged
    that long fail too, so no thread waits on a launcher that is gone.
    """
    seconds, fraction = divmod(silence, 1.0)
    sock.setsockopt(
        socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(seconds), int(fraction * 1e6))
    )
    bound_unacknowledged_sends(sock, silence)


def main(secret: bytes, spawner: Spawner | str, unseen: str = "") -> int:
    """Runs the agent; returns its exit code.

    Args:
        secret: the launch secret, already removed from the environment.
        spawner: the started worker spawner, or why workers cannot be started here (a broken
            env file), for the launcher.
        unseen: the launcher's log directory mark that this node cannot see
            (`slurmrun.log_mark.unseen_mark`), for the launcher.
    """
    try:
        return _run(secret, spawner, unseen)
    finally:
        if isinstance(spawner, Spawner):
            spawner.close()


def _run(secret: bytes, spawner: Spawner | str, unseen: str) -> int:
    problem = spawner if isinstance(spawner, str) else None
    addr = os.environ[variables.LAUNCHER_ADDR_VAR]
    port = int(os.environ[variables.PORT_VAR])
    heartbeat = float(os.environ.get(HEARTBEAT_VAR, "1.0"))
    silence = heartbeat * HEARTBEATS_PER_TIMEOUT
    hostname = node_name(os.environ)

    retry = float(os.environ.get(CONNECT_RETRY_VAR, CONNECT_RETRY))

    def connect_once() -> socket.socket:
        sock = socket.create_connection((addr, port), timeout=HANDSHAKE_TIMEOUT)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client_handshake(sock, secret, HANDSHAKE_TIMEOUT)
        except BaseException:
            sock.close()
            raise
        return sock

    def connect() -> socket.socket:
        # A large result's own connection: a short try, as the agent can relay it instead.
        return connect_with_backoff(connect_once, min(retry, STREAM_CONNECT_RETRY))[0]

    try:
        sock = connect_with_backoff(connect_once, retry)[0]
    except ConnectionError as e:
        _say(f"cannot reach the launcher at {addr}:{port}: {e}")
        return 1
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    _expect_heartbeats(sock, silence)
    launcher = LauncherConnection(sock, hostname)
    # The store listens where the other nodes reach this one: our side of the launcher's route.
    store_port = StorePort(sock.getsockname()[0])
    step = step_id(os.environ)
    hello = protocol.Hello(
        hostname=hostname,
        node_rank=int(os.environ.get(variables.NODE_RANK_VAR, "-1")),
        addr=sock.getsockname()[0],
        auto_workers=agent_auto_workers(os.environ, hostname) if problem is None else 0,
        master_port=store_port.port,
        pid=os.getpid(),
        slurm_job=os.environ.get("SLURM_JOB_ID", ""),
        slurm_step="" if step is None else str(step),
        error=problem,
        unseen_mark=unseen,
        version=slurmrun_version(),
        protocol=protocol_fingerprint(),
        python=sys.executable,
        where=where_installed(),
    )
    launcher.send(hello.header())
    agent = Agent(
        launcher=launcher,
        hostname=hostname,
        spawner=spawner if isinstance(spawner, Spawner) else None,
        connect=connect,
        store_port=store_port,
        silence=silence,
    )
    agent.in_step = step is not None
    if not agent.in_step:
        # Inside a SLURM step, slurmstepd signals every process of the step itself (workers
        # included); forwarding there would deliver each signal twice.
        for signum in FORWARDED_SIGNALS:
            signal.signal(signum, lambda s, _: agent.forward_signal(s))
    else:
        signal.signal(signal.SIGTERM, lambda *_: agent.on_slurm_sigterm())
        threading.Thread(target=agent.announce_slurm_ending, daemon=True).start()
    threading.Thread(target=agent._read_launcher, daemon=True).start()
    threading.Thread(target=agent._heartbeat, args=(heartbeat,), daemon=True).start()
    try:
        agent.serve()
    except SpawnError:
        return 1
    finally:
        agent.runs.end_all()
        agent.stop_workers()
        launcher.close()
    return 0
