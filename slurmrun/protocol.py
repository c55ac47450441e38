"""The contract between launcher, agents and workers: variable names and messages.

Both sides import this module and nothing of each other (the agent imports only the standard
library and this before it forks its spawner). A message is one frame of `slurmrun.transport`:
a JSON header whose ``"t"`` names its kind, and for some kinds a body (a pickle, or a `Log`'s
text). Every kind is a frozen dataclass here, built with ``Kind(...).header()`` and read with
`parse`; every message of a run carries the run's id (``run``: START gives it, the agent
stamps its workers' frames with it), and the launcher drops what belongs to another run.
Texts in a header are clipped (`clip`): a header is small, and what is cut stays in the
worker's log file.

One agent's life, as the launcher sees it::

    agent                      launcher
    HELLO  ------------------>            (once; then heartbeats both ways, always)
           <------------------  START + pickled call      \
    STARTED ----------------->                             |
    LOG, RESULT, ERROR, DIED -->                           |  one run; again for every run
    DONE   ------------------>                             |  of a warm launcher
           <------------------  END                        |
    IDLE   ------------------>            (workers gone)  /
           <------------------  CLOSE     (or the connection closes, or the launcher is silent)

At any time an agent may say TERMINATING: SLURM is ending its step, and its workers (which got
SLURM's SIGTERM too) have until SLURM's kill, not the launcher's short grace, to exit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

__all__ = [
    "CLOSE",
    "DIED",
    "DONE",
    "END",
    "ERROR",
    "FUNC",
    "HEARTBEAT",
    "HELLO",
    "IDLE",
    "KINDS",
    "LOG",
    "RESULT",
    "START",
    "STARTED",
    "STOP",
    "STREAM",
    "TERMINATING",
    "TEXT_LIMIT",
    "Close",
    "Died",
    "Done",
    "End",
    "Error",
    "Func",
    "Heartbeat",
    "Hello",
    "Idle",
    "Log",
    "Message",
    "ProtocolError",
    "Result",
    "Start",
    "Started",
    "Stop",
    "StreamRequest",
    "Terminating",
    "clip",
    "parse",
    "stamp",
    "start_header",
]

# ------------------------------------------------------------ environment variables
# Set by the launcher for its agents:
SECRET_VAR = "SLURMRUN_SECRET"  # noqa: S105 - the variable's name, not a secret
LAUNCHER_ADDR_VAR = "SLURMRUN_LAUNCHER_ADDR"  # also read from the user: the address to advertise
PORT_VAR = "SLURMRUN_LAUNCHER_PORT"  # also read from the user: the port to listen on
# "1": the secret comes on stdin, which stays open for the agent's life (ssh agents)
SECRET_STDIN_VAR = "SLURMRUN_SECRET_STDIN"  # noqa: S105 - a variable's name
PRELOAD_VAR = "SLURMRUN_PRELOAD"  # modules the spawner imports (comma-separated)
HEARTBEAT_VAR = "SLURMRUN_HEARTBEAT_INTERVAL"  # seconds between heartbeats, each way
ENV_FILE_VAR = "SLURMRUN_ENV_FILE"  # a bash file the agent sources before forking its spawner
# srun rewrites SLURM_TASKS_PER_NODE with the step's layout (1 per node for the agents' step),
# so the job's own layout travels to agents under this name (comma-separated counts).
JOB_TASKS_VAR = "SLURMRUN_JOB_TASKS_PER_NODE"
# srun reads some of the job's variables as its options, so they travel to srun agents under
# this name (JSON, `slurmrun.worker_env.job_vars`), for the workers to see the job's values.
JOB_ENV_VAR = "SLURMRUN_JOB_ENV"
# Local agents only (srun agents are known by their node name):
NODE_RANK_VAR = "SLURMRUN_NODE_RANK"
HOSTNAME_VAR = "SLURMRUN_HOSTNAME"
# Set by the launcher for workers (through `Start.env`):
RESTART_VAR = "SLURMRUN_RESTART_COUNT"
# Set in a submitted job: signals (names, comma-separated) that workers keep ignored, as their
# agent set them, instead of restoring the default action (SLURM's --signal=USR2@90).
IGNORED_SIGNALS_VAR = "SLURMRUN_IGNORED_SIGNALS"

# Heartbeats (each way) per heartbeat timeout: the interval is the timeout divided by this.
HEARTBEATS_PER_TIMEOUT = 5

# SLURM ends a step (preemption with a GraceTime, the time limit, scancel) with SIGTERM to
# every process of the step, workers included, and SIGKILL after the GraceTime or KillWait.
# The agent then waits for its workers (to checkpoint) without signalling them again, for up
# to this long (SLURM's kill normally comes first; `scancel --signal=TERM` sends none), and
# the launcher waits for such an agent as long.
SLURM_TERM_WAIT = 900.0

# ------------------------------------------------------------ message kinds
# launcher -> agent
START = "start"  # `Start`, with the pickled call as body: fork the workers of one run
END = "end"  # `End`: the run is over: stop its workers (if any are left), then say IDLE
CLOSE = "close"  # `Close`: exit (stopping workers first)
HEARTBEAT = "hb"  # `Heartbeat`, both ways
# agent -> launcher
HELLO = "hello"  # `Hello`, first thing after the handshake
STARTED = "started"  # `Started`: the run's workers' process ids, by local rank
IDLE = "idle"  # `Idle`: the run's workers are gone and their output was forwarded
DONE = "done"  # `Done`: every worker exited, and its result and output were forwarded
DIED = "died"  # `Died`: a worker exited without a result
TERMINATING = "terminating"  # `Terminating`: SLURM is ending this step (see SLURM_TERM_WAIT)
# worker -> agent -> launcher (the agent stamps "run" and "local_rank": `stamp`)
LOG = "log"  # `Log`
RESULT = "result"  # `Result`, with the pickled return value as body
ERROR = "error"  # `Error`, with the pickled exception as body
# worker <-> agent
STREAM = "stream"  # `StreamRequest`: a worker asks for a connection of its own (large result)
FUNC = "func"  # `Func`, agent -> worker, with the pickled call as body
STOP = "stop"  # `Stop`, agent -> worker: stop now

# ------------------------------------------------------------ bounded texts
# The most characters of one text field (a message, a traceback, an output tail) in a header.
# JSON escapes a non-ASCII character as 6 bytes, so a field takes at most ~200 KiB: a header's
# few such fields stay well under `transport.MAX_HEADER_BYTES` (1 MiB).
TEXT_LIMIT = 32 * 1024


def clip(text: str, limit: int = TEXT_LIMIT, *, where: str | None = None) -> str:
    """`text`, or its head and tail with a marker saying how much was cut from the middle.

    Args:
        text: any text bound for a frame header.
        limit: the most characters returned, the marker included (clipping twice changes
            nothing); a limit shorter than the marker returns the marker alone.
        where: where the whole text is (a log file), for the marker.

    Returns:
        `text` itself when it has at most `limit` characters.

    Example:
        >>> clip("a" * 20 + "b" * 20, 30)
        'aa... [37 characters cut] ...b'
    """
    if len(text) <= limit:
        return text
    whole = f": the whole text is in {where}" if where else ""

    def marker(cut: int) -> str:
        return f"... [{cut:,} characters cut{whole}] ..."

    keep = max(0, limit - len(marker(len(text))))  # the longest marker this text can need
    tail = keep // 2
    return text[: keep - tail] + marker(len(text) - keep) + text[len(text) - tail :]


M = TypeVar("M", bound="Message")


class ProtocolError(ValueError):
    """A header that is no message of this protocol (unknown kind, missing or wrong fields)."""


@dataclass(frozen=True)
class Message:
    """A message: its header is ``{"t": KIND, **fields}``; some kinds also carry a body."""

    KIND: ClassVar[str]

    def header(self) -> dict[str, Any]:
        """The frame header that carries this message.

        Its values are the message's own (not copies, as `dataclasses.asdict` would make):
        a header is only encoded, and a run sends one START per agent.
        """
        shape = _shape(type(self))
        header: dict[str, Any] = {"t": self.KIND}
        for name in shape.order:
            value = getattr(self, name)
            # A default is left out (`from_header` puts it back): smaller frames to encode,
            # send, decode and keep (a 4096-node run's launcher holds 32,768 results' headers).
            if name not in shape.constant or value != shape.constant[name]:
                header[name] = value
        return header

    @classmethod
    def from_header(cls: type[M], header: dict[str, Any]) -> M:
        """The message in `header` (unknown keys ignored).

        What was sent is taken as it was sent (the sender made it through the class, clipped
        texts and all): the fields are set without the class's ``__init__``, which costs
        several times as much, and a launcher reads ~50,000 messages in a 4096-node run.

        Raises:
            ProtocolError: a field without a default is missing.
        """
        shape = _shape(cls)
        keys = header.keys()
        if not shape.required <= keys:
            missing = sorted(shape.required - keys)
            raise ProtocolError(f"a {cls.KIND!r} message without its fields {missing}")
        values = shape.defaults()
        if keys <= shape.allowed:
            values.update(header)
            values.pop("t", None)
        else:  # keys of a newer sender: left out
            values.update({k: v for k, v in header.items() if k in shape.names})
        message = object.__new__(cls)
        object.__setattr__(message, "__dict__", values)
        return message


@dataclass(frozen=True)
class _Shape:
    """A message class's fields, as `Message.header` and `Message.from_header` need them."""

    names: frozenset[str]
    order: tuple[str, ...]  # the names, in the class's order
    allowed: frozenset[str]  # the names and "t"
    required: frozenset[str]
    constant: dict[str, Any]  # defaults that are values
    factories: dict[str, Any]  # defaults made by a factory (a new list each time)

    def defaults(self) -> dict[str, Any]:
        """A fresh dict of every default."""
        values = self.constant.copy()
        if self.factories:
            for name, factory in self.factories.items():
                values[name] = factory()
        return values


_SHAPES: dict[type[Message], _Shape] = {}


def _shape(cls: type[Message]) -> _Shape:
    shape = _SHAPES.get(cls)
    if shape is None:
        fields = dataclasses.fields(cls)
        missing = dataclasses.MISSING
        names = frozenset(f.name for f in fields)
        shape = _SHAPES[cls] = _Shape(
            names=names,
            order=tuple(f.name for f in fields),
            allowed=names | {"t"},
            required=frozenset(
                f.name for f in fields if f.default is missing and f.default_factory is missing
            ),
            constant={f.name: f.default for f in fields if f.default is not missing},
            factories={
                f.name: f.default_factory for f in fields if f.default_factory is not missing
            },
        )
    return shape


# ------------------------------------------------------------ launcher -> agent


@dataclass(frozen=True)
class Start(Message):
    """One run's share of an agent: its workers and where they meet."""

    KIND: ClassVar[str] = START
    run: int  # the run's id: every message of the run carries it back
    workers: int
    rank_offset: int
    world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    backend: str | None
    timeout: float
    grace: float  # seconds from SIGTERM to SIGKILL when workers are stopped
    log_level: int
    sys_path: list[str]
    cwd: str
    env: dict[str, str]  # set in every worker, on top of the agent's environment
    # Where the agent writes each worker's finished lines (`slurmrun.logs.WorkerLog`); None:
    # it does not (the launcher writes files, or there are none).
    log_dir: str | None = None
    # The local ranks whose output and logging records go to the launcher (None: every
    # rank's). The agent's own always do.
    forward_ranks: list[int] | None = None
    unset: list[str] = dataclasses.field(default_factory=list)  # removed from every worker's env
    # The agent's name in log file names (`slurmrun.logs.host_labels`: a host named twice has
    # one per node); empty: its hostname.
    log_name: str = ""
    # Every node's worker count in SLURM's compressed form ("2(x2),1"): the run's layout, as
    # workers see it in SLURM_TASKS_PER_NODE (`slurmrun.worker_env`). Empty: `workers` per node.
    tasks_per_node: str = ""


def start_header(
    shared: dict[str, Any],
    *,
    workers: int,
    rank_offset: int,
    node_rank: int,
    forward_ranks: list[int] | None,
    log_name: str = "",
) -> dict[str, Any]:
    """One agent's START: `shared` (a `Start(...).header()` made once per run) with its share.

    A run sends one to every agent; a `Start` built for each would cost ~25x as much.
    """
    share = {
        "workers": workers,
        "rank_offset": rank_offset,
        "node_rank": node_rank,
        "forward_ranks": forward_ranks,
        "log_name": log_name,
    }
    return shared | share


@dataclass(frozen=True)
class End(Message):
    """The run is over: stop its workers if any are left, then say `Idle`."""

    KIND: ClassVar[str] = END
    run: int


@dataclass(frozen=True)
class Close(Message):
    """Exit, stopping the workers first."""

    KIND: ClassVar[str] = CLOSE


@dataclass(frozen=True)
class Heartbeat(Message):
    """I am alive (both ways, every heartbeat interval)."""

    KIND: ClassVar[str] = HEARTBEAT


# ------------------------------------------------------------ agent -> launcher


@dataclass(frozen=True)
class Hello(Message):
    """An agent introduces itself (once per connection, before anything else)."""

    KIND: ClassVar[str] = HELLO
    hostname: str
    node_rank: int  # -1: an srun agent, known by its hostname
    addr: str  # its address on the way to the launcher (MASTER_ADDR if it hosts rank 0)
    auto_workers: int  # its workers if workers_per_host is "auto"
    master_port: int  # a free port for the first run's rank 0
    pid: int
    slurm_job: str = ""
    slurm_step: str = ""
    error: str | None = None  # why it cannot start workers (a broken env file)


@dataclass(frozen=True)
class Started(Message):
    """The run's workers were forked."""

    KIND: ClassVar[str] = STARTED
    run: int
    pids: list[int]  # by local rank


@dataclass(frozen=True)
class Idle(Message):
    """An agent is ready for the next run: the workers of `run` are gone."""

    KIND: ClassVar[str] = IDLE
    run: int
    master_port: int  # a free port for the next run's rank 0


@dataclass(frozen=True)
class Done(Message):
    """Every worker of the run exited, and its result and output were forwarded."""

    KIND: ClassVar[str] = DONE
    run: int


@dataclass(frozen=True)
class Died(Message):
    """A worker exited (or was killed) without a result."""

    KIND: ClassVar[str] = DIED
    run: int
    local_rank: int
    exitcode: int | None
    signal: str | None
    what: str  # "exited with code 3", "was killed by SIGKILL"
    stderr_tail: str  # clipped to TEXT_LIMIT

    def __post_init__(self) -> None:
        object.__setattr__(self, "stderr_tail", clip(self.stderr_tail))


@dataclass(frozen=True)
class Terminating(Message):
    """SLURM is ending the agent's step (SIGTERM): see `SLURM_TERM_WAIT`."""

    KIND: ClassVar[str] = TERMINATING


# ------------------------------------------------------------ worker -> agent -> launcher


@dataclass(frozen=True)
class Log(Message):
    """A piece of a worker's output, or a `logging` record; its text is the body.

    The body is the text's UTF-8 bytes (invalid bytes carried by ``surrogateescape``), never
    a pickle: `slurmrun.output` builds, cuts and joins them.
    """

    KIND: ClassVar[str] = LOG
    stream: str  # "stdout", "stderr" or "logging"
    level: int
    # "": the line goes on; "\n": it is finished; "\r": a state of it (a progress bar) ends
    end: str = "\n"
    name: str = ""  # the logger's (logging records)
    local_rank: int = -1
    run: int = 0


@dataclass(frozen=True)
class Result(Message):
    """A worker's return value (the body), or the announcement of one that was streamed."""

    KIND: ClassVar[str] = RESULT
    streamed: bool = False  # it came (or comes) on a connection of its own
    node_rank: int = -1  # set on a streamed result's own connection
    local_rank: int = -1
    run: int = 0


@dataclass(frozen=True)
class Error(Message):
    """A worker's exception (pickled in the body, if it could be)."""

    KIND: ClassVar[str] = ERROR
    exc_type: str
    message: str  # clipped to TEXT_LIMIT (the whole text is in the pickled exception)
    traceback: str  # clipped to TEXT_LIMIT
    secondary: bool = False  # likely a consequence of another rank's failure
    unpicklable: str | None = None  # why the exception could not be pickled
    # The whole traceback is the frame's last buffer (the agent writes it to the worker's log).
    full_traceback: bool = False
    local_rank: int = -1
    run: int = 0

    def __post_init__(self) -> None:
        for name in ("exc_type", "message", "traceback"):
            object.__setattr__(self, name, clip(getattr(self, name)))
        if self.unpicklable is not None:
            object.__setattr__(self, "unpicklable", clip(self.unpicklable))


def stamp(header: dict[str, Any], *, run: int, local_rank: int) -> None:
    """Marks a worker's header (forwarded as it is) with its run and local rank."""
    header["run"] = run
    header["local_rank"] = local_rank


# ------------------------------------------------------------ worker <-> agent


@dataclass(frozen=True)
class StreamRequest(Message):
    """A worker asks its agent for a connection of its own to the launcher (a large result)."""

    KIND: ClassVar[str] = STREAM


@dataclass(frozen=True)
class Func(Message):
    """The call to run (the body), agent -> worker."""

    KIND: ClassVar[str] = FUNC


@dataclass(frozen=True)
class Stop(Message):
    """Stop now, agent -> worker."""

    KIND: ClassVar[str] = STOP


KINDS: dict[str, type[Message]] = {
    cls.KIND: cls
    for cls in (
        Start, End, Close, Heartbeat, Hello, Started, Idle, Done, Died, Terminating,
        Log, Result, Error, StreamRequest, Func, Stop,
    )
}  # fmt: skip


def parse(header: dict[str, Any]) -> Message:
    """The message a frame header carries.

    Raises:
        ProtocolError: an unknown kind, or a missing field.
    """
    cls = KINDS.get(header.get("t"))  # type: ignore[arg-type]
    if cls is None:
        raise ProtocolError(f"unknown message kind {header.get('t')!r}")
    return cls.from_header(header)
