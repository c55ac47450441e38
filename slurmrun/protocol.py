"""The contract between launcher, agents and workers: the messages.

Both sides import this module and nothing of each other (the agent imports only the standard
library, this and `slurmrun.variables`, the environment's names, before it forks its
spawner). A message is one frame of `slurmrun.transport`:
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
           <------------------  CREDIT (for LOG shown)     |  of a warm launcher
    DONE   ------------------>                             |
           <------------------  END                        |
    IDLE   ------------------>            (workers gone)  /
           <------------------  CLOSE     (or the connection closes, or the launcher is silent)

At any time an agent may say TERMINATING: SLURM is ending its step, and its workers (which got
SLURM's SIGTERM too) have until SLURM's kill, not the launcher's short grace, to exit.

During a run, two exchanges look inside it (`slurmrun.stacks`, `slurmrun.node.debugger`)::

           <------------------  ASK_STACKS                 the agent asks each worker, or
    STACKS (one per worker) -->                            dumps it with faulthandler
    DEBUGGER (PROMPT) ------->                             a worker's pdb wants a line
           <------------------  DEBUG_INPUT                the user's line, for that worker
    DEBUGGER (ENDED) -------->                             its session is over

While a prompt waits, Tab asks that worker's pdb for completions (`DebugComplete`, launcher ->
agent -> worker; `DebugCompletions` back): the launcher waits for the answer a moment only.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, ClassVar

from slurmrun.messages import TEXT_LIMIT, Message, ProtocolError, clip

__all__ = [
    "ASK_STACKS",
    "ATTACH",
    "ATTACHED",
    "BRIDGE",
    "CLOSE",
    "CREDIT",
    "DEBUGGER",
    "DEBUG_COMPLETE",
    "DEBUG_COMPLETIONS",
    "DEBUG_INPUT",
    "DIED",
    "DONE",
    "END",
    "ERROR",
    "FUNC",
    "HEARTBEAT",
    "HELLO",
    "IDLE",
    "JOIN",
    "KINDS",
    "LOG",
    "LOG_FRAME_COST",
    "OUTPUT_WINDOW",
    "REFUSED",
    "RESULT",
    "STACKS",
    "START",
    "STARTED",
    "STOP",
    "STREAM",
    "TERMINATING",
    "TEXT_LIMIT",
    "AskStacks",
    "Attach",
    "Attached",
    "Bridge",
    "Close",
    "Credit",
    "DebugComplete",
    "DebugCompletions",
    "DebugInput",
    "DebugState",
    "Debugger",
    "Died",
    "Done",
    "End",
    "Error",
    "Func",
    "Heartbeat",
    "Hello",
    "Idle",
    "Join",
    "Log",
    "Message",
    "ProtocolError",
    "Refused",
    "Result",
    "Stacks",
    "Start",
    "Started",
    "Stop",
    "StreamRequest",
    "Terminating",
    "clip",
    "log_cost",
    "parse",
    "stamp",
    "start_header",
]

# Heartbeats (each way) per heartbeat timeout: the interval is the timeout divided by this.
HEARTBEATS_PER_TIMEOUT = 5

# SLURM ends a step (preemption with a GraceTime, the time limit, scancel) with SIGTERM to
# every process of the step, workers included, and SIGKILL after the GraceTime or KillWait.
# The agent then waits for its workers (to checkpoint) without signalling them again, for up
# to this long (SLURM's kill normally comes first; `scancel --signal=TERM` sends none), and
# the launcher waits for such an agent as long.
SLURM_TERM_WAIT = 900.0
# How long an agent waits for SLURM's SIGTERM when the launcher's END says it got one (`End`).
SIGTERM_LAG = 1.0

# Output flow control: an agent sends a LOG frame only while the LOG it sent, and the launcher
# has not yet shown (or dropped), costs at most its window; CREDIT gives the cost back. The
# launcher's memory for output is then bounded by the windows of its agents, however fast the
# workers print and however slowly its terminal takes lines: a full window makes the agent stop
# reading the workers' pipes, so that their writes wait, as they do on a slow terminal. A frame
# costs its body and `LOG_FRAME_COST` (about what one queued event costs the launcher).
OUTPUT_WINDOW = 8 << 20  # an agent's window until a START sets it (`Start.output_window`)
LOG_FRAME_COST = 1024


def log_cost(body_bytes: int) -> int:
    """What a LOG frame whose body has `body_bytes` bytes costs in its agent's window."""
    return body_bytes + LOG_FRAME_COST


# ------------------------------------------------------------ message kinds
# launcher -> agent
START = "start"  # `Start`, with the pickled call as body: fork the workers of one run
END = "end"  # `End`: the run is over: stop its workers (if any are left), then say IDLE
CLOSE = "close"  # `Close`: exit (stopping workers first)
HEARTBEAT = "hb"  # `Heartbeat`, both ways
ASK_STACKS = "ask_stacks"  # `AskStacks`: every worker's stacks, please (also agent -> worker)
DEBUG_INPUT = "debug_input"  # `DebugInput`: a line for a worker's debugger (also agent -> worker)
CREDIT = "credit"  # `Credit`: the launcher took LOG frames of this cost (see OUTPUT_WINDOW)
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
STACKS = "stacks"  # `Stacks`, with the worker's stacks as body
DEBUGGER = "debugger"  # `Debugger`, with the debugger's output as body
# worker <-> agent
STREAM = "stream"  # `StreamRequest`: a worker asks for a connection of its own (large result)
FUNC = "func"  # `Func`, agent -> worker, with the pickled call as body
STOP = "stop"  # `Stop`, agent -> worker: stop now

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
    # Keep the workers for the next run if this one succeeds (`Launcher.keep_workers`): the
    # agent then hands the next run to them (`slurmrun.node.kept`) instead of forking new ones.
    keep: bool = False
    # The workers run another interpreter than the launcher's (a container): they keep their
    # own ``sys.path`` after ``sys_path``, which then holds only the launcher's own entries
    # (its script's directory, PYTHONPATH), none of its interpreter's.
    own_path: bool = False
    # The agent's output window from now on, in `log_cost` units (see OUTPUT_WINDOW); 0: as is.
    output_window: int = 0
    # What the run runs (``func train``, ``script train.py``: `slurmrun.titles.run_title`),
    # for the header line that starts the run's part of each worker's log file.
    title: str = ""


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
    keep: bool = False  # the run succeeded and its workers serve the next one (Start.keep)
    # The launcher got SIGTERM: SLURM may be signalling this step's workers too (scancel, the
    # time limit), so the agent waits up to `SIGTERM_LAG` for that before it signals them itself
    # (a second SIGTERM would run a checkpointing handler twice).
    after_sigterm: bool = False


@dataclass(frozen=True)
class Close(Message):
    """Exit, stopping the workers first."""

    KIND: ClassVar[str] = CLOSE


@dataclass(frozen=True)
class Credit(Message):
    """The launcher showed (or dropped) LOG frames of run `run` that cost `cost` in all."""

    KIND: ClassVar[str] = CREDIT
    cost: int
    run: int = 0


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
    # Which slurmrun it runs (`slurmrun.versions`): the launcher refuses another one.
    version: str = ""
    protocol: str = ""
    python: str = ""  # its interpreter (sys.executable)
    where: str = ""  # where its slurmrun is imported from


@dataclass(frozen=True)
class Started(Message):
    """The run's workers were forked."""

    KIND: ClassVar[str] = STARTED
    run: int
    pids: list[int]  # by local rank
    reused: bool = False  # the last run's workers took this run (Start.keep)
    # Why this run has new workers although the last run's were to be kept ("" otherwise):
    # what those kept in `slurmrun.worker_state()` is gone.
    fresh_why: str = ""


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
    # "": the line goes on; "\n", "\r\n": it is finished; "\r": a state of it (a progress bar)
    # ends; "eof": the stream ended, and the line has no end (see `slurmrun.output`)
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
    stays: bool = False  # the worker waits for the next run's FUNC (`slurmrun.node.kept`)


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
    run: int = 0  # the run it belongs to (a kept worker serves several)


@dataclass(frozen=True)
class Stop(Message):
    """Stop now, agent -> worker."""

    KIND: ClassVar[str] = STOP


@dataclass(frozen=True)
class AskStacks(Message):
    """Every worker's stacks, please: launcher -> agent, and agent -> each worker."""

    KIND: ClassVar[str] = ASK_STACKS
    run: int
    request: int  # the answers carry it back
    # Seconds a worker has to answer itself before the agent dumps it (`slurmrun.stacks`).
    answer_wait: float = 1.0


@dataclass(frozen=True)
class Stacks(Message):
    """One worker's stacks (the body) for request `request`: worker or agent -> launcher.

    The body is `slurmrun.stacks.capture`'s JSON (`source` "python"), faulthandler's text
    ("faulthandler"), or empty ("none": `note` says why).
    """

    KIND: ClassVar[str] = STACKS
    request: int
    source: str = "python"  # a `slurmrun.stacks.StackSource` value
    note: str = ""  # why there are none ("exited with code 0"), clipped
    local_rank: int = -1
    run: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "note", clip(self.note, 1000))


class DebugState(str, enum.Enum):
    """Where a worker's debugger session is (`Debugger.state`)."""

    PROMPT = "prompt"  # it wrote the body (its output, ending with the prompt) and waits
    ENDED = "ended"  # the session is over (the body: its last output); the rank goes on


@dataclass(frozen=True)
class Debugger(Message):
    """A worker's debugger (pdb) speaks: its output is the body (`slurmrun.node.debugger`)."""

    KIND: ClassVar[str] = DEBUGGER
    state: str  # a `DebugState` value
    where: str = ""  # "node2 rank 5": who speaks, for the launcher's messages
    local_rank: int = -1
    run: int = 0


@dataclass(frozen=True)
class DebugInput(Message):
    """A line the user typed for the debugger of worker `local_rank` (the body, UTF-8).

    `eof`: the launcher has no line to give (no terminal, or the user pressed Ctrl-D): the
    debugger lets the rank go on.
    """

    KIND: ClassVar[str] = DEBUG_INPUT
    run: int
    local_rank: int
    eof: bool = False


KINDS: dict[str, type[Message]] = {
    cls.KIND: cls
    for cls in (
        Start, End, Close, Credit, Heartbeat, Hello, Started, Idle, Done, Died, Terminating,
        Log, Result, Error, StreamRequest, Func, Stop, AskStacks, Stacks, Debugger, DebugInput,
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


# ------------------------------------------------------------ completion in a debugger
# launcher -> agent -> worker
DEBUG_COMPLETE = "debug_complete"  # `DebugComplete`: Tab was pressed at a worker's pdb prompt
# worker -> agent -> launcher
DEBUG_COMPLETIONS = "debug_completions"  # `DebugCompletions`: that pdb's answer

# What one answer may hold: a Tab after ``p `` in a module with thousands of names lists
# only this many, each clipped (the header stays far below the transport's limit).
COMPLETIONS_LIMIT = 1000
COMPLETION_TEXT_LIMIT = 256


@dataclass(frozen=True)
class DebugComplete(Message):
    """Tab at the prompt of worker `local_rank`'s pdb: complete `text`, in `line`.

    `begidx` and `endidx` are where `text` lies in `line` (what readline's completer is
    given); the answer carries `request` back.
    """

    KIND: ClassVar[str] = DEBUG_COMPLETE
    run: int
    local_rank: int
    request: int
    text: str
    line: str
    begidx: int
    endidx: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "line", clip(self.line, COMPLETION_TEXT_LIMIT * 16))
        object.__setattr__(self, "text", clip(self.text, COMPLETION_TEXT_LIMIT))


@dataclass(frozen=True)
class DebugCompletions(Message):
    """A worker's pdb answers `DebugComplete` `request`: the completions of its text."""

    KIND: ClassVar[str] = DEBUG_COMPLETIONS
    request: int
    matches: list[str] = dataclasses.field(default_factory=list)  # at most COMPLETIONS_LIMIT
    local_rank: int = -1
    run: int = 0

    def __post_init__(self) -> None:
        kept = [m for m in self.matches[:COMPLETIONS_LIMIT] if len(m) <= COMPLETION_TEXT_LIMIT]
        object.__setattr__(self, "matches", kept)


KINDS.update({cls.KIND: cls for cls in (DebugComplete, DebugCompletions)})


# ------------------------------------------------------------ a reservation's keeper
# A launcher outside a reserved job reaches the keeper that holds its agents
# (`slurmrun.batch.keeper`): first an ATTACH connection (the session), then one JOIN
# connection per agent, whose frames the keeper then carries to and from that agent.
ATTACH = "attach"  # `Attach`, launcher -> keeper: take the reservation's agents
ATTACHED = "attached"  # `Attached`, keeper -> launcher: they are yours (the session's id)
REFUSED = "refused"  # `Refused`, keeper -> launcher: not now (another launcher holds them)
JOIN = "join"  # `Join`, launcher -> keeper: this connection is agent `node_rank`'s
BRIDGE = "bridge"  # `Bridge`, keeper -> launcher: a stream (a large result) waits for a JOIN


@dataclass(frozen=True)
class Attach(Message):
    """A launcher asks the keeper for the reservation's agents (its first frame)."""

    KIND: ClassVar[str] = ATTACH
    pid: int
    host: str
    # Seconds of its silence after which it counts as gone: its heartbeats come five times in
    # that (0: the keeper's own heartbeat timeout).
    silence: float = 0.0


@dataclass(frozen=True)
class Attached(Message):
    """The keeper gives the agents to the launcher that asked, for session `session`."""

    KIND: ClassVar[str] = ATTACHED
    session: int
    hostnames: list[str]


@dataclass(frozen=True)
class Refused(Message):
    """The keeper cannot give the agents now (`why`: another launcher holds them)."""

    KIND: ClassVar[str] = REFUSED
    why: str
    busy: bool = False  # another launcher holds them: worth another try later


@dataclass(frozen=True)
class Join(Message):
    """This connection carries agent `node_rank`'s frames for session `session`."""

    KIND: ClassVar[str] = JOIN
    session: int
    node_rank: int
    stream: int = 0  # the channel of a `Bridge` this connection takes; 0: the agent's frames


@dataclass(frozen=True)
class Bridge(Message):
    """A worker's stream (a large result) reached the keeper: JOIN it as `channel`."""

    KIND: ClassVar[str] = BRIDGE
    channel: int


KINDS.update({cls.KIND: cls for cls in (Attach, Attached, Refused, Join, Bridge)})
