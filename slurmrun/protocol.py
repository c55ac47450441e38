"""The contract between launcher, agents and workers: the messages.

Both sides import this module and nothing of each other (the agent imports only the standard
library, this and `slurmrun.variables`, the environment's names, before it forks its
spawner). A message is one frame of `slurmrun.transport`:
a JSON header whose ``"t"`` names its kind, and for some kinds a body (a pickle, or a `Log`'s
text). Every kind is a frozen dataclass here, built with ``Kind(...).header()`` and read with
`parse`, and declared by its class alone (``kind: ClassVar[str] = "end"`` enters it in
`KINDS`); a side tells messages apart by their classes (``isinstance``, ``match``), and only
frames it deliberately leaves unparsed (the agent's relay, heartbeats) by ``frame.kind ==
Kind.kind``; every message of a run carries the run's id (``run``: START gives it, the agent
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
                                                           (a report, never a sample)
    DEBUGGER (PROMPT) ------->                             a worker's pdb wants a line
           <------------------  DEBUG_INPUT                the user's line, for that worker
    DEBUGGER (ENDED) -------->                             its session is over

While a prompt waits, Tab asks that worker's pdb for completions (`DebugComplete`, launcher ->
agent -> worker; `DebugCompletions` back): the launcher waits for the answer a moment only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar

from slurmrun import map_messages as map_messages  # a map's kinds (`Launcher.map`) in KINDS
from slurmrun.keeper_messages import Attach as Attach  # a reservation's keeper's, likewise
from slurmrun.keeper_messages import Attached as Attached
from slurmrun.keeper_messages import Bridge as Bridge
from slurmrun.keeper_messages import Join as Join
from slurmrun.keeper_messages import Refused as Refused
from slurmrun.messages import KINDS as KINDS  # the machinery, re-exported
from slurmrun.messages import TEXT_LIMIT as TEXT_LIMIT
from slurmrun.messages import Message as Message
from slurmrun.messages import ProtocolError as ProtocolError
from slurmrun.messages import clip as clip
from slurmrun.start_parts import AgentShare as AgentShare
from slurmrun.start_parts import RunStart as RunStart
from slurmrun.start_parts import Surroundings as Surroundings

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


# ------------------------------------------------------------ launcher -> agent


@dataclass(frozen=True, kw_only=True)
class Start(AgentShare, RunStart, Message):
    """One agent's START of a run: the run's shared part and the agent's share.

    The agent reads them as one (`slurmrun.start_parts`); `start_header` joins them to send.
    """

    kind: ClassVar[str] = "start"


def start_header(run: RunStart, share: AgentShare) -> dict[str, Any]:
    """One agent's START header: the run's part (its fields taken once per run) and its share.

    A run sends one to every agent; a `Start` built for each would cost ~25x as much.
    """
    return {"t": Start.kind, **run.shared_fields, **share.own_fields()}


@dataclass(frozen=True)
class End(Message):
    """The run is over: stop its workers if any are left, then say `Idle`."""

    kind: ClassVar[str] = "end"
    run: int
    keep: bool = False  # the run succeeded and its workers serve the next one (Start.keep)
    # The launcher got SIGTERM: SLURM may be signalling this step's workers too (scancel, the
    # time limit), so the agent waits up to `SIGTERM_LAG` for that before it signals them itself
    # (a second SIGTERM would run a checkpointing handler twice).
    after_sigterm: bool = False


@dataclass(frozen=True)
class Close(Message):
    """Exit, stopping the workers first."""

    kind: ClassVar[str] = "close"


@dataclass(frozen=True)
class Credit(Message):
    """The launcher showed (or dropped) LOG frames of run `run` that cost `cost` in all."""

    kind: ClassVar[str] = "credit"
    cost: int
    run: int = 0


@dataclass(frozen=True)
class Heartbeat(Message):
    """I am alive (both ways, every heartbeat interval)."""

    kind: ClassVar[str] = "hb"


# ------------------------------------------------------------ agent -> launcher


@dataclass(frozen=True)
class Hello(Message):
    """An agent introduces itself (once per connection, before anything else)."""

    kind: ClassVar[str] = "hello"
    hostname: str
    node_rank: int  # -1: an srun agent, known by its hostname
    addr: str  # its address on the way to the launcher (MASTER_ADDR if it hosts rank 0)
    auto_workers: int  # its workers if workers_per_host is "auto"
    master_port: int  # a free port for the first run's rank 0
    pid: int
    slurm_job: str = ""
    slurm_step: str = ""
    error: str | None = None  # why it cannot start workers (a broken env file)
    # The launcher's mark in the log directory that this agent cannot see ("": seen, or none):
    # its log files would land where the launcher never reads them.
    unseen_mark: str = ""
    # Which slurmrun it runs (`slurmrun.versions`): the launcher refuses another one.
    version: str = ""
    protocol: str = ""
    python: str = ""  # its interpreter (sys.executable)
    where: str = ""  # where its slurmrun is imported from


@dataclass(frozen=True)
class Started(Message):
    """The run's workers were forked."""

    kind: ClassVar[str] = "started"
    run: int
    pids: list[int]  # by local rank
    reused: bool = False  # the last run's workers took this run (Start.keep)
    # Why this run has new workers although the last run's were to be kept ("" otherwise):
    # what those kept in `slurmrun.worker_state()` is gone.
    fresh_why: str = ""


@dataclass(frozen=True)
class Idle(Message):
    """An agent is ready for the next run: the workers of `run` are gone."""

    kind: ClassVar[str] = "idle"
    run: int
    master_port: int  # a free port for the next run's rank 0


@dataclass(frozen=True)
class Done(Message):
    """Every worker of the run exited, and its result and output were forwarded."""

    kind: ClassVar[str] = "done"
    run: int


@dataclass(frozen=True)
class Died(Message):
    """A worker exited (or was killed) without a result."""

    kind: ClassVar[str] = "died"
    run: int
    local_rank: int
    exitcode: int | None
    signal: str | None
    what: str  # "exited with code 3", "was killed by SIGKILL"
    stderr_tail: str  # clipped to TEXT_LIMIT

    def __post_init__(self) -> None:
        object.__setattr__(self, "stderr_tail", clip(self.stderr_tail))


@dataclass(frozen=True)
class Unhealthy(Message):
    """The node failed its health check (`slurmrun.node.health_check`): no worker was started."""

    kind: ClassVar[str] = "unhealthy"
    run: int
    why: str  # clipped to TEXT_LIMIT
    local_rank: int = -1  # none: the node's (judged with the workers' failures)

    def __post_init__(self) -> None:
        object.__setattr__(self, "why", clip(self.why))


@dataclass(frozen=True)
class Terminating(Message):
    """SLURM is ending the agent's step (SIGTERM): see `SLURM_TERM_WAIT`."""

    kind: ClassVar[str] = "terminating"


# ------------------------------------------------------------ worker -> agent -> launcher


@dataclass(frozen=True)
class Log(Message):
    """A piece of a worker's output, or a `logging` record; its text is the body.

    The body is the text's UTF-8 bytes (invalid bytes carried by ``surrogateescape``), never
    a pickle: `slurmrun.output` builds, cuts and joins them.
    """

    kind: ClassVar[str] = "log"
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

    kind: ClassVar[str] = "result"
    streamed: bool = False  # it came (or comes) on a connection of its own
    node_rank: int = -1  # set on a streamed result's own connection
    local_rank: int = -1
    run: int = 0
    stays: bool = False  # the worker waits for the next run's FUNC (`slurmrun.node.kept`)


@dataclass(frozen=True)
class Error(Message):
    """A worker's exception (pickled in the body, if it could be)."""

    kind: ClassVar[str] = "error"
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

    kind: ClassVar[str] = "stream"


@dataclass(frozen=True)
class Func(Message):
    """The call to run (the body), agent -> worker."""

    kind: ClassVar[str] = "func"
    run: int = 0  # the run it belongs to (a kept worker serves several)


@dataclass(frozen=True)
class Stop(Message):
    """Stop now, agent -> worker."""

    kind: ClassVar[str] = "stop"


class StacksPurpose(str, enum.Enum):
    """What a request for stacks is for, and so whether a worker that is silent is dumped.

    faulthandler's dump reads every thread's frames from a signal handler, without the GIL:
    it is kept for the reports a person reads, never spent on the launcher's sampling, which
    asks several times a second.
    """

    REPORT = "report"  # `stacks()`, a stall, a failure: a silent worker is dumped
    SAMPLE = "sample"  # the launcher's sampling: only the worker's own thread answers
    HANG = "hang"  # a hang's report: as REPORT, and each worker dumps its flight recorder


@dataclass(frozen=True)
class AskStacks(Message):
    """Every worker's stacks, please: launcher -> agent, and agent -> each worker."""

    kind: ClassVar[str] = "ask_stacks"
    run: int
    request: int  # the answers carry it back
    # Seconds a worker has to answer itself before the agent dumps it (a report) or says it
    # is silent (a sample).
    answer_wait: float = 1.0
    purpose: str = StacksPurpose.REPORT.value  # a `StacksPurpose` value

    def dumps(self) -> bool:
        """Whether a worker that does not answer itself within `answer_wait` is dumped."""
        return self.purpose != StacksPurpose.SAMPLE.value


@dataclass(frozen=True)
class Stacks(Message):
    """One worker's stacks (the body) for request `request`: worker or agent -> launcher.

    The body is `slurmrun.stacks.report.capture`'s JSON (`source` "python"), faulthandler's text
    ("faulthandler"), or empty ("silent": alive, but it did not answer a sample in time;
    "none": `note` says why).
    """

    kind: ClassVar[str] = "stacks"
    request: int
    source: str = "python"  # a `slurmrun.stacks.report.StackSource` value
    note: str = ""  # why there are none ("exited with code 0"), clipped
    local_rank: int = -1
    run: int = 0
    # The collectives the worker's process groups began (torch's sequence numbers, summed);
    # -1: unknown. A rank seen twice in one collective has not progressed if it is unchanged.
    progress: int = -1
    # A hang's report (`StacksPurpose.HANG`): where the worker wrote its flight recorder, and
    # the last collective it recorded ("gloo:all_reduce #12"); "": none.
    recorder: str = ""
    recorder_last: str = ""
    # The worker's main thread, since it began (`slurmrun.stacks.sched`): nanoseconds on a CPU,
    # and runnable but waiting for one; -1: unknown. The straggler judge tells a rank that
    # works longer from one that got less of a busy CPU by them.
    cpu_ns: int = -1
    queued_ns: int = -1

    def __post_init__(self) -> None:
        object.__setattr__(self, "note", clip(self.note, 1000))


class DebugState(str, enum.Enum):
    """Where a worker's debugger session is (`Debugger.state`)."""

    PROMPT = "prompt"  # it wrote the body (its output, ending with the prompt) and waits
    ENDED = "ended"  # the session is over (the body: its last output); the rank goes on


@dataclass(frozen=True)
class Debugger(Message):
    """A worker's debugger (pdb) speaks: its output is the body (`slurmrun.node.debugger`)."""

    kind: ClassVar[str] = "debugger"
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

    kind: ClassVar[str] = "debug_input"
    run: int
    local_rank: int
    eof: bool = False


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
# `DebugComplete` (launcher -> agent -> worker): Tab was pressed at a worker's pdb prompt;
# `DebugCompletions` (worker -> agent -> launcher): that pdb's answer.

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

    kind: ClassVar[str] = "debug_complete"
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

    kind: ClassVar[str] = "debug_completions"
    request: int
    matches: list[str] = field(default_factory=list)  # at most COMPLETIONS_LIMIT
    local_rank: int = -1
    run: int = 0

    def __post_init__(self) -> None:
        kept = [m for m in self.matches[:COMPLETIONS_LIMIT] if len(m) <= COMPLETION_TEXT_LIMIT]
        object.__setattr__(self, "matches", kept)
