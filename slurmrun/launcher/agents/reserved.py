"""Agents a reservation keeps (`slurmrun.reserve`), reached from outside its job.

The agents run already: the reservation's keeper (`slurmrun.batch.keeper`) started them and
is their launcher. A launcher with ``job=JOB_ID`` reads the reservation's record
(`slurmrun.reservations`: the keeper's address and a secret only this user can read),
attaches to the keeper (``ATTACH``; refused while another launcher holds the agents), and
then, for each agent, joins a connection of the keeper (``JOIN``) to a connection of its own
to its pool's listener, which listens on loopback only and is proven the launch's own secret
as ever: the pool sees each agent connect and say hello, as agents of any kind do, and the
keeper carries frames between them. The launch's secret never leaves this machine.

Closing the pool closes every agent's connection (the keeper keeps the agents); this process
going away, or its network, ends the session at the keeper, which ends its run on every node.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from slurmrun import protocol
from slurmrun.authentication import client_handshake
from slurmrun.errors import AgentFailedError, OptionsValueError, ReservationRequeuedError
from slurmrun.launcher.address import Address, loopback
from slurmrun.launcher.agents.common import silence as launcher_silence
from slurmrun.launcher.agents.kind import AgentKind, AgentStart, DryRoute, DryWorkers, StartOrder
from slurmrun.launcher.agents.reserved_relay import SrunRelay, relay_command
from slurmrun.reservations import ReservationError, ReservationRecord, record_path
from slurmrun.slurm.fields import first_record
from slurmrun.slurm.pending import job_wait
from slurmrun.slurm.scontrol import scontrol_show_job
from slurmrun.transport import Connection
from slurmrun.variables import LAUNCHER_ADDR_VAR, PORT_VAR, SECRET_VAR

if TYPE_CHECKING:
    from slurmrun.launcher.agents.starters import AgentStarter
    from slurmrun.launcher.options import Options
    from slurmrun.log_dirs import LogDir
    from slurmrun.providers import Hosts

__all__ = ["ReservationBusy", "Reserved", "ReservedAgents", "Route", "choose_route"]

CONNECT_TIMEOUT = 10.0  # the keeper's node answers within this, or is not reachable
PROBE_TIMEOUT = 3.0  # the keeper's port answers within this, or srun is the way
VIA_VAR = "SLURMRUN_RESERVE_VIA"  # direct, srun, or auto: how to reach the keeper
BUSY_RETRY = 0.5  # between two tries while another launcher's session ends
_CHUNK = 1 << 20
WAIT_POLL = 0.5  # seconds between two looks at a reservation that is starting
# A job in these states may still write its record: its launcher waits for it.
STARTING = frozenset({"PENDING", "CONFIGURING", "RUNNING", "REQUEUED"})
# ... and these too, while a keeper SLURM ends (requeued, it runs again) leaves no record.
WAITED = STARTING | {"COMPLETING", "REQUEUE_HOLD", "REQUEUE_FED", "PREEMPTED"}


class ReservationBusy(ReservationError):
    """Another launcher holds the reservation's agents (or its run is still ending)."""


@dataclass(frozen=True)
class Reserved(AgentKind):
    """The agents of reservation `record.job_id` (`slurmrun.launcher.agents.kind.AgentKind`)."""

    name: ClassVar[str] = "reserved"
    shown: ClassVar[str] = "the agents a reservation keeps, through its keeper"
    env_on_stdin: ClassVar[bool] = False
    local_master: ClassVar[bool] = False
    writes_logs: ClassVar[bool] = True  # srun agents, started by the keeper

    record: ReservationRecord

    @classmethod
    def provided(cls, cfg: Options, found: Hosts) -> Reserved:
        """See `AgentKind`: a reservation is asked for with ``job=``, not found by a provider.

        Raises:
            ValueError: always.
        """
        raise ValueError("a reservation's agents are asked for with job=JOB_ID")

    @classmethod
    def of_job(cls, job_id: str, wait: float = 0.0) -> Reserved:
        """The kind for reservation `job_id`, from its record; waits for it while it starts.

        While the job is pending (or starting its agents) this waits up to `wait` seconds,
        saying why on stderr when that changes (SLURM's reason, its expected start).

        Raises:
            ReservationError: there is no record of it and it is not starting (not this
                user's, or ended), or it is not this user's alone.
            TimeoutError: it did not start within `wait` seconds.
        """
        deadline = time.monotonic() + wait
        said = ""
        while (record := ReservationRecord.read(job_id)) is None:
            job = job_wait(job_id)
            if job is None or job.state not in WAITED or job.uid not in {-1, os.getuid()}:
                raise ReservationError(
                    f"no reservation {job_id} of yours is running (its record "
                    f"{record_path(job_id)} is not there, and SLURM says "
                    f"{job.state if job else 'nothing of it'}): reserve with slurmrun.reserve() "
                    "or `slurmrun reserve`"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"reservation {job_id} is not ready after timeout={wait:g} s: {job}"
                    if wait > 0
                    else f"reservation {job_id} is not ready yet: {job} (a launch waits for "
                    "it, up to its timeout)"
                )
            line = f"slurmrun: waiting for reservation {job_id}: {job}"
            if line != said:
                print(line, file=sys.stderr, flush=True)
                said = line
            time.sleep(WAIT_POLL)
        return cls(record)

    def hostnames(self, min_hosts: int | None) -> list[str]:
        """The nodes a launch runs on: every one whose agent the keeper still has.

        Raises:
            ReservationError: the keeper lost agents since the reservation started, and
                `min_hosts` does not allow a launch on the others.
        """
        record = self.record
        left = [host for host in record.hostnames if host not in record.lost]
        if record.lost and (min_hosts is None or len(left) < min_hosts):
            lost = "; ".join(f"{host} ({why})" for host, why in record.lost.items())
            allowed = "min_hosts is not set" if min_hosts is None else f"min_hosts={min_hosts}"
            raise ReservationError(
                f"reservation {record.job_id} lost {lost}; {len(left)} of its "
                f"{len(record.hostnames)} nodes are left ({', '.join(left) or 'none'}) and "
                f"{allowed}: run on them with min_hosts={len(left) or 1} and max_restarts >= 1, "
                "or release it and reserve again"
            )
        return left

    def address(self, hostnames: Sequence[str]) -> Address:
        """See `AgentKind`: loopback; only this process's own bridges connect."""
        return Address(loopback().bind, loopback().advertise, "loopback: the keeper's bridges")

    def start(self, order: StartOrder) -> AgentStart:
        """See `AgentKind`: the agents run already; this joins them to the pool."""
        env = dict(order.control)
        starter = ReservedAgents(
            self.record, order.log_dir.path, float(order.cfg.timeout), launcher_silence(order.cfg),
            hostnames=tuple(order.hostnames),
        )  # fmt: skip
        where = f"{self.record.host}:{self.record.port}"
        names = tuple(sorted(k for k in env if k != SECRET_VAR))
        return AgentStart(starter, env, (("attach", f"job {self.record.job_id}", where),), names)

    def dry_workers(self, hostnames: Sequence[str], env: dict[str, str]) -> DryWorkers:
        """See `AgentKind`: each agent decided when the reservation started."""
        return DryWorkers(0, [0] * len(hostnames), "each agent decides on its node (0: unknown)")

    def dry_route(self) -> DryRoute:
        """See `AgentKind`: the way `choose_route` takes now (it may knock on the keeper's port).

        Raises:
            OptionsValueError: ``SLURMRUN_RESERVE_VIA`` holds something else.
        """
        way, record = choose_route(self.record), self.record
        attach = ("attach", f"job {record.job_id}", f"{record.host}:{record.port}")
        commands = (tuple(relay_command(record)),) if way.srun else (attach,)
        return DryRoute(record.job_id, way.text, commands)

    def explain(
        self,
        error: AgentFailedError,
        starter: AgentStarter,
        hostnames: Sequence[str],
        log_dir: LogDir | None,
    ) -> AgentFailedError:
        """See `AgentKind`: an agent lost because SLURM requeues the reservation says so."""
        record = starter.record if isinstance(starter, ReservedAgents) else self.record
        why = requeued(record)
        if why is None or isinstance(error, ReservationRequeuedError):
            return error
        explained = ReservationRequeuedError(
            f"reservation {record.job_id} was requeued ({why}): this run is lost; SLURM runs "
            f"the job again under the same id, with new agents, and the next run on it waits "
            f"for that (up to its timeout). What the agent said: {error}",
            job_id=record.job_id,
            hostname=error.hostname,
            log_file=error.log_file,
            stderr_tail=error.stderr_tail,
            node_rank=error.node_rank,
        )
        explained.__cause__ = error
        return explained


REQUEUED_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "PREEMPTED"})


def requeued(record: ReservationRecord) -> str | None:
    """Why SLURM is requeueing reservation `record.job_id` since its keeper started; or None.

    One ``scontrol show job``: requeued since (``Restarts``), back in the queue, or preempted
    (``PreemptTime``, the job requeueable) after its keeper's agents were ready.
    """
    fields = first_record(scontrol_show_job(record.job_id) or "").fields
    restarts, state = fields.get("Restarts", ""), fields.get("JobState", "")
    if restarts.isdigit() and int(restarts) > record.restarts:
        return f"SLURM restarted it {int(restarts) - record.restarts} time(s) since it started"
    if state in REQUEUED_STATES:
        return f"SLURM says {state}"
    with contextlib.suppress(ValueError):
        when = datetime.datetime.fromisoformat(fields.get("PreemptTime", "")).timestamp()
        if fields.get("Requeue") == "1" and when >= record.started - 60:  # clock skew
            return f"preempted at {fields['PreemptTime']}"
    return None


Dial = Callable[[], socket.socket]  # a new connection toward the keeper's port


def direct(record: ReservationRecord, timeout: float = CONNECT_TIMEOUT) -> Dial:
    """Connections straight to the keeper's port."""

    def dial() -> socket.socket:
        sock = socket.create_connection((record.host, record.port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    return dial


@dataclass(frozen=True)
class Route:
    """The way to a reservation's keeper (`choose_route`).

    Attributes:
        srun: through ``srun --jobid J --overlap`` (a relay on the keeper's node), else
            straight to the keeper's port.
        text: the way, and why (what ``slurmrun info --job`` and a dry run say).
        asked: ``SLURMRUN_RESERVE_VIA`` chose it, not a knock on the port.
    """

    srun: bool
    text: str
    asked: bool


def choose_route(record: ReservationRecord) -> Route:
    """How this process would reach the keeper of `record`, and why; starts nothing.

    ``SLURMRUN_RESERVE_VIA`` (`VIA_VAR`) decides: ``direct``, ``srun``, or by default the
    keeper's port if it answers within `PROBE_TIMEOUT` (a connection, closed at once), else
    srun: where the nodes are firewalled from this machine.

    Raises:
        OptionsValueError: the variable holds something else.
    """
    via = os.environ.get(VIA_VAR, "auto") or "auto"
    if via not in {"auto", "direct", "srun"}:
        raise OptionsValueError(f"{VIA_VAR}={via!r}: set direct, srun or auto (the default)")
    port = f"the keeper's port {record.host}:{record.port}"
    relay = (
        f"through `srun --jobid {record.job_id} --overlap` on {record.node or record.hostnames[0]}"
        " (a relay to the keeper on its stdin and stdout)"
    )
    if via == "srun":
        return Route(True, f"{relay}: {VIA_VAR}=srun", asked=True)
    if via == "direct":
        return Route(False, f"straight to {port}: {VIA_VAR}=direct", asked=True)
    try:
        direct(record, PROBE_TIMEOUT)().close()
    except OSError as e:
        why = f"{port} does not answer from here within {PROBE_TIMEOUT:g} s ({e})"
        return Route(True, f"{relay}: {why}", asked=False)
    return Route(False, f"straight to {port}, which answers from here", asked=False)


def route(record: ReservationRecord, log_dir: str) -> tuple[Dial, SrunRelay | None]:
    """How this process reaches the keeper (`choose_route`): its dial, and the relay if any.

    Raises:
        OptionsValueError: ``SLURMRUN_RESERVE_VIA`` holds something else.
        AgentFailedError: ``direct`` was asked for and the port does not answer.
    """
    way = choose_route(record)
    if not way.srun:
        if way.asked:
            try:
                direct(record)().close()
            except OSError as e:
                raise AgentFailedError(
                    f"cannot reach the keeper of reservation {record.job_id} at "
                    f"{record.host}:{record.port}: {e} ({VIA_VAR}=direct)"
                ) from e
        return direct(record), None
    if not way.asked:
        print(f"slurmrun: reservation {record.job_id}: {way.text}", file=sys.stderr, flush=True)
    relay = SrunRelay(record, os.path.join(log_dir, "relay.log"))
    return relay.connect, relay


def _connect(record: ReservationRecord, dial: Dial) -> Connection:
    sock = dial()
    try:
        client_handshake(sock, bytes.fromhex(record.secret), CONNECT_TIMEOUT)
    except BaseException:
        sock.close()
        raise
    return Connection(sock)


def attach(
    record: ReservationRecord, dial: Dial, deadline: float, silence: float
) -> tuple[Connection, int]:
    """The session's control connection and id, trying again while another session ends.

    Raises:
        ReservationBusy: another launcher held the agents until `deadline`.
        AgentFailedError: the keeper cannot be reached, or answers something else.
    """
    said = False
    while True:
        try:
            conn = _connect(record, dial)
            hello = protocol.Attach(pid=os.getpid(), host=socket.gethostname(), silence=silence)
            conn.send(hello.header())
            conn.sock.settimeout(CONNECT_TIMEOUT)
            frame = conn.recv()
        except (OSError, EOFError) as e:
            raise AgentFailedError(
                f"cannot reach the keeper of reservation {record.job_id} at {record.host}:"
                f"{record.port}: {e} (has it ended? `slurmrun jobs`, or its log "
                f"{record.folder}/{record.job_id}.log)"
            ) from e
        message = None if frame is None else protocol.parse(frame.header)
        if isinstance(message, protocol.Attached):
            conn.sock.settimeout(None)
            return conn, message.session
        conn.close()
        if isinstance(message, protocol.Refused) and message.busy:
            if time.monotonic() < deadline:
                if not said:
                    print(f"slurmrun: waiting: {message.why}", file=sys.stderr, flush=True)
                    said = True
                time.sleep(BUSY_RETRY)
                continue
            raise ReservationBusy(f"reservation {record.job_id}: {message.why}")
        raise AgentFailedError(f"the keeper of reservation {record.job_id} refused: {message}")


@dataclass
class ReservedAgents:
    """The bridges between the keeper's connections and the pool's listener, one per agent."""

    record: ReservationRecord
    log_dir: str
    busy_wait: float = 30.0  # how long another launcher may hold the agents (`timeout`)
    silence: float = 0.0  # this launcher's heartbeat timeout (`common.silence`)
    hostnames: tuple[str, ...] = ()  # the plan's nodes (after a lost one: fewer); (): all
    control: Connection | None = None
    dial: Dial | None = None
    relay: SrunRelay | None = None
    bridges: list[socket.socket] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self, env: Mapping[str, str]) -> None:
        """See `slurmrun.launcher.agents.starters.AgentStarter`.

        The record is read again first: a reservation that SLURM requeued since has a new
        keeper (or none yet: this waits for it, up to `busy_wait`).
        """
        deadline = time.monotonic() + self.busy_wait
        while True:
            left = max(0.0, deadline - time.monotonic())
            self.record = Reserved.of_job(self.record.job_id, wait=left).record
            try:
                self.dial, self.relay = route(self.record, self.log_dir)
                self.control, session = attach(self.record, self.dial, deadline, self.silence)
                break
            except AgentFailedError:
                if self.relay is not None:
                    self.relay.close()
                    self.relay = None
                if not _starting_again(self.record, deadline):
                    raise
        pool = (env[LAUNCHER_ADDR_VAR], int(env[PORT_VAR]))
        secret = bytes.fromhex(env[SECRET_VAR])
        for host in self.hostnames or self.record.hostnames:  # the keeper's node rank of each
            join = protocol.Join(session=session, node_rank=self.record.hostnames.index(host))
            self._bridge(join, pool, secret)
        streams = threading.Thread(
            target=self._streams, args=(self.control, session, pool, secret), daemon=True
        )
        streams.start()
        self.threads.append(streams)

    def _bridge(self, join: protocol.Join, pool: tuple[str, int], secret: bytes) -> None:
        """Joins a connection of the keeper's (`join` says which) to one of the pool's."""
        assert self.dial is not None  # noqa: S101 - start chose it
        keeper = _connect(self.record, self.dial)
        self.bridges.append(keeper.sock)
        keeper.send(join.header())
        ours = socket.create_connection(pool, timeout=CONNECT_TIMEOUT)
        self.bridges.append(ours)
        ours.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client_handshake(ours, secret, CONNECT_TIMEOUT)
        keeper.sock.settimeout(None)
        ours.settimeout(None)
        for src, dst in ((keeper.sock, ours), (ours, keeper.sock)):
            thread = threading.Thread(target=_pipe, args=(src, dst), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _streams(
        self, control: Connection, session: int, pool: tuple[str, int], secret: bytes
    ) -> None:
        """Bridges each stream the keeper announces (a worker's large result) to the pool."""
        with contextlib.suppress(OSError, EOFError):
            while (frame := control.recv()) is not None:
                message = protocol.parse(frame.header)
                if isinstance(message, protocol.Bridge):
                    join = protocol.Join(session=session, node_rank=-1, stream=message.channel)
                    self._bridge(join, pool, secret)

    def agent_hello(self, node_rank: int, hello: Mapping[str, Any]) -> None:
        """See `slurmrun.launcher.agents.starters.AgentStarter`."""

    def exit_codes(self) -> dict[int | None, int]:
        """See `slurmrun.launcher.agents.starters.AgentStarter`: the keeper's, none here."""
        return {}

    def log_file(self, node_rank: int | None) -> str | None:
        """See `slurmrun.launcher.agents.starters.AgentStarter`: the reservation's job log."""
        return f"{self.record.folder}/{self.record.job_id}.log"

    def stop(self, grace: float) -> None:
        """See `slurmrun.launcher.agents.starters.AgentStarter`: ends the session.

        The control connection closes first: the keeper then ends a run still in progress
        on every node and closes its side of every bridge, which ends their threads.
        """
        if self.control is not None:
            self.control.close()
        deadline = time.monotonic() + grace
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        for sock in list(self.bridges):
            _shut(sock)
        for thread in self.threads:
            thread.join(1.0)
        if self.relay is not None:
            self.relay.close()


def _starting_again(record: ReservationRecord, deadline: float) -> bool:
    """Whether the keeper of `record` is gone because SLURM runs the job again (requeued).

    Then waits a moment (the job ends its old keeper, or starts its new one): its record is
    read again. False past `deadline`, or when SLURM ends the job for good.
    """
    job = job_wait(record.job_id)
    again = job is not None and job.state in WAITED
    if not again or time.monotonic() + WAIT_POLL > deadline or requeued(record) is None:
        return False
    print(
        f"slurmrun: waiting for reservation {record.job_id} to run again: {job}",
        file=sys.stderr,
        flush=True,
    )
    time.sleep(WAIT_POLL)
    return True


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    """Copies `src` to `dst` until either ends; then ends both (the other pipe stops too)."""
    buffer = memoryview(bytearray(_CHUNK))
    with contextlib.suppress(OSError):
        while (n := src.recv_into(buffer)) > 0:
            dst.sendall(buffer[:n])
    for sock in (src, dst):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
