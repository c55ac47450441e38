"""Preloads the spawner learns from its runs: what workers imported, imported once, ahead.

A warm launcher forks fresh workers for every run, so a function that imports a package
pays for that import at every run. Each worker tells its spawner what it imports through a
pipe the spawner made for it (`slurmrun.node.import_notes`): each installed package's import
as it starts, and at the end of the run's function every installed top-level package it
imported (and the spawner had not).

Which modules are learned:

- top-level names only (``transformers``, not ``transformers.models.bert``), whose file lies
  in a ``site-packages`` or ``dist-packages`` directory: installed packages. The standard
  library is left out (what a package needs of it comes with the package; a stdlib module
  imported on its own costs milliseconds), and so is the user's own code (the working
  directory, ``PYTHONPATH``, editable installs): fresh workers must see an edited file.
- at most `MAX_NAMES` names of at most `MAX_NAME` characters, `MAX_BYTES` bytes of each kind
  of line per worker; what is over is dropped, never an error.

What stays out: a forked child has only the thread that forked, so a package that starts a
thread when it is imported (a BLAS thread pool, a monitor thread) or that initialises CUDA
must never be imported in the spawner (fork safety). Nor may a preload leave a worker in
another state than a fresh interpreter that imports the package in the worker: a package
that changes logging (``logging.basicConfig()``), a signal handler, a hook, ``faulthandler``,
the working directory, the environment, the standard streams or ``sys.path`` when it is
imported is left to the workers (`slurmrun.node.import_effects` says why, and what is
restored). Every candidate is therefore imported in a probe (`slurmrun.node.successor`): a
fork of the spawner, in the spawner's very state, that imports the candidates one by one and
reports, for each, whether the process's threads (its native tasks, `/proc/self/task`) grew,
whether torch's CUDA became initialised, whether the import changed any of that state
(`ProcessState`), or whether the name now resolves to another file than the worker's. A
probe has `PROBE_TIMEOUT` seconds for its imports; a candidate whose import had not ended by
then is skipped for good, as is every candidate that failed or was unsafe.

Where the agent is a child subreaper (Linux), the probe is the spawner's **successor**: it
starts as soon as a worker's import starts (the spawner reads the workers' pipes as they
write), takes the names that come while it works, and once it judged them all safe, waits.
At the next request for a worker, if no worker of the old spawner runs and every worker
that ran imported each of its names from the same file (its report at the end said so: a
package whose import failed in the worker is never preloaded), the old spawner hands it the
agent's socket and the request, and exits; the successor serves from then on. Nothing is
imported twice, and no request ever waits for an import: one that comes while the
successor works is served by the old spawner at once (its workers import the package
themselves). `later` modules (torch, when the launch asked for no process group) are the
successor's first imports, trusted and unprobed, after the first run.

Elsewhere the probe is thrown away and the spawner imports what it approved, between runs
and only while no worker runs, checking again: a package that started a thread in the
spawner after all cannot be unloaded, so the spawner says so in the agent's log and learns
nothing more; one that changed the process's state after all has that state restored and
its modules dropped (the workers import them again), and learning stops too. Such an
import costs the next run at most what each worker of the last run paid for it.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slurmrun.node import successor
from slurmrun.node.import_effects import ProcessState
from slurmrun.node.import_notes import (
    MAX_BYTES,
    MAX_NAME,
    MAX_NAMES,
    STARTED,
    decode,
    encode,
    installed_top_level,
    report,
)
from slurmrun.node.import_reports import Reports
from slurmrun.torch_import import import_module
from slurmrun.waiting import wait_readable

__all__ = [  # the worker's side is `slurmrun.node.import_notes`'s (named here too)
    "MAX_BYTES",
    "MAX_NAME",
    "MAX_NAMES",
    "PROBE_TIMEOUT",
    "STARTED",
    "Preloads",
    "decode",
    "encode",
    "import_checked",
    "installed_top_level",
    "report",
]

PROBE_TIMEOUT = 60.0
HANDOVER_WAIT = 5.0  # a successor answers a takeover at once; this bounds a wedged one


def thread_count() -> int:
    """This process's threads: native ones too (a C library's pool is no Python thread)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux
        return threading.active_count()


def cuda_initialised() -> bool:
    """Whether torch is imported and has initialised CUDA in this process."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    return bool(cuda is not None and cuda.is_initialized())


# ------------------------------------------------------------------ the spawner's side


@dataclass
class _Probe:
    pid: int
    ctl: socket.socket  # its verdicts come in here (and a successor's takeover goes out)
    names: dict[str, str]
    deadline: float
    later: list[str] = field(default_factory=list)  # a successor's trusted imports
    data: bytes = b""
    exited: bool = False  # reaped by the spawner: its pid may be another process's now
    ready: bool = False  # a successor that judged every name safe, waiting to take over

    @property
    def fd(self) -> int:
        return self.ctl.fileno()


@dataclass
class Preloads:
    """The spawner's learned preloads (see the module's docstring); lives in the spawner.

    Args:
        later: modules to import between runs without a probe (torch, when the launch asked
            for no process group: a one-shot launch then never waits for it).
        learn: whether workers report what they imported.
    """

    later: list[str]
    learn: bool
    pending: dict[str, str] = field(default_factory=dict)  # reported, not yet probed
    safe: list[str] = field(default_factory=list)  # probed, not yet imported here
    skipped: set[str] = field(default_factory=set)
    confirmed: dict[str, str] = field(default_factory=dict)  # imported by a worker, from there
    unfinished: set[str] = field(default_factory=set)  # a worker's import started, never ended
    probe: _Probe | None = None
    # Set by the spawner where it can hand over to a successor (`slurmrun.node.successor`):
    # what the successor runs once it takes over, and the spawner's descriptors it closes.
    become: Callable[[socket.socket, bytes, list[int]], None] | None = None
    inherited: Callable[[], list[int]] = list
    _reports: Reports = field(default_factory=Reports)
    _gone: set[int] = field(default_factory=set)  # probes killed, not yet reaped

    @property
    def handover(self) -> bool:
        """Whether a probe may succeed the spawner (else the spawner imports what it approved)."""
        return self.become is not None

    def worker_pipe(self) -> tuple[int, int] | None:
        """A (read, write) pipe for the next worker's report, or None when learning is off."""
        return os.pipe() if self.learn else None

    def started(self, pid: int, read_end: int) -> None:
        """Worker `pid` got the write end of the pipe whose read end is `read_end`."""
        self._reports.add(pid, read_end)

    def reaped(self, pid: int) -> None:
        """Worker `pid` exited: takes its report (written before it exited) from its pipe."""
        if self.probe is not None and self.probe.pid == pid:
            self.probe.exited = True
        self._gone.discard(pid)
        self._reports.take_last(pid, self._noted)

    def fds(self) -> list[int]:
        """What the spawner's loop waits on for us: the probe's verdicts, workers' notes."""
        fds = [] if self.probe is None else [self.probe.fd]
        if self.handover:
            fds += self._reports.fds()
        return fds

    def private_fds(self) -> list[int]:
        """Ours, which a worker must not hold."""
        return [*([] if self.probe is None else [self.probe.fd]), *self._reports.fds()]

    def timeout(self) -> float | None:
        """How long the spawner's loop may wait before `between_runs` must look at the probe."""
        if self.probe is None or self.probe.ready:
            return None
        return max(0.0, self.probe.deadline - time.monotonic())

    def own(self, pid: int) -> bool:
        """Whether `pid` is the probe (no stray of a run's)."""
        return (self.probe is not None and self.probe.pid == pid) or pid in self._gone

    def ready(self) -> bool:
        """Whether a successor waits, and every worker imported what it holds from its files."""
        probe = self.probe
        return bool(
            probe is not None
            and probe.ready
            and not probe.exited
            and all(self.confirmed.get(n) == o for n, o in probe.names.items())
        )

    def between_runs(self, idle: bool) -> None:
        """Moves learning on: reads reports and the probe, starts the next probe.

        Args:
            idle: no worker runs (where there is no successor, imports are made only then).
        """
        if self.handover:
            self._reports.take_notes(self._noted)
        if self.probe is not None:
            self._read_probe()
        if self.handover:
            if idle and self.probe is not None and self.probe.ready and not self.ready():
                # Every worker reported: one whose import failed, or came from another file.
                self.unfinished.update(n for n in self.probe.names if n not in self.confirmed)
                self._discard(keep=[n for n in self.probe.names if n in self.confirmed])
            if self.probe is not None and self.pending:
                self._send_more(self.probe)
            wanted = self.pending or (idle and self.later)
            if self.probe is None and wanted and (self.learn or self.later):
                self._start_probe()
            return
        if not idle:
            return
        while self.later:  # trusted: torch starts a thread of its own, and never CUDA
            with contextlib.suppress(Exception):  # not installed here: workers do without
                import_module(self.later.pop(0))
        while self.safe and self.learn:
            self.learn = import_checked(self.safe.pop(0))
        if self.probe is None and self.pending and self.learn:
            self._start_probe()

    def hand_over(self, sock: socket.socket, request: bytes, fds: list[int]) -> bool:
        """Hands the agent's socket and `request` to the successor; True: it serves now.

        Call only while `ready()` and no worker of this spawner lives; on True the spawner
        exits at once. False: the successor refused (it was discarded) or is gone; the
        spawner serves `request` itself.
        """
        probe = self.probe
        assert probe is not None  # noqa: S101 - called only when ready()
        state = {
            "request": request,
            "pending": {n: o for n, o in self.pending.items() if n not in probe.names},
            "confirmed": self.confirmed,
            "skipped": self.skipped,
            "unfinished": self.unfinished,
            "learn": self.learn,
        }
        answer = b""
        with contextlib.suppress(OSError):
            socket.send_fds(probe.ctl, [pickle.dumps(state)], [sock.fileno(), *fds])
            if wait_readable([probe.fd], HANDOVER_WAIT):
                answer = os.read(probe.fd, 4096)
        if answer == successor.OK:
            return True
        if answer:  # refused: its state changed since its verdicts
            print(
                f"slurmrun spawner: the process that imported {', '.join(probe.names)} changed "
                f"{answer.decode(errors='replace').split()[-1]} after a probe's verdicts; "
                "learning preloads stops for this launcher",
                file=sys.stderr,
                flush=True,
            )
            self.learn = False
        self._discard(keep=[])
        return False

    def _take_over(
        self, sock: socket.socket, request: bytes, fds: list[int], state: dict[str, Any]
    ) -> None:
        """In the successor: the learning state it serves with, then the spawner's loop."""
        assert self.become is not None  # noqa: S101 - a successor exists only then
        self.probe, self._reports, self._gone, self.later = None, Reports(), set(), []
        self.confirmed, self.skipped, self.learn = (
            state["confirmed"],
            state["skipped"],
            state["learn"],
        )
        self.unfinished = state["unfinished"]
        self.pending = {n: o for n, o in state["pending"].items() if n not in sys.modules}
        self.become(sock, request, fds)

    def _noted(self, line: str) -> None:
        started = line.startswith(STARTED)
        name, _, origin = line.removeprefix(STARTED).partition("\t")
        if not name.isidentifier() or len(name) > MAX_NAME or name in self.skipped:
            return
        if started and (not self.handover or name in self.unfinished):
            return  # (no early probe: the spawner imports what the probe approves, when idle)
        if not started:
            self.confirmed[name] = origin
        if name in sys.modules or (self.probe is not None and name in self.probe.names):
            return
        if len(self.pending) < MAX_NAMES:
            self.pending.setdefault(name, origin)

    def _start_probe(self) -> None:
        names = {n: o for n, o in self.pending.items() if n not in sys.modules}
        self.pending.clear()
        later = [n for n in self.later if n not in sys.modules] if self.handover else []
        self.later = [] if self.handover else self.later
        if not names and not later:
            return
        ctl, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the probe
            inherited = [ctl.fileno(), *self._reports.fds(), *self.inherited()]
            take_over = self._take_over if self.handover else None
            successor.run(
                names, later, theirs, parent=parent, inherited=inherited, take_over=take_over
            )
        theirs.close()
        ctl.setblocking(False)
        self.probe = _Probe(pid, ctl, names, time.monotonic() + PROBE_TIMEOUT, later)

    def _read_probe(self) -> None:
        probe = self.probe
        assert probe is not None  # noqa: S101 - called only with one
        ended = False
        try:
            while chunk := os.read(probe.fd, 4096):
                probe.data += chunk
            ended = True
        except BlockingIOError:
            probe.ready = probe.data.endswith(successor.READY + f" {len(probe.names)}\n".encode())
            ended = not probe.ready and time.monotonic() >= probe.deadline
        except OSError:
            ended = True
        if ended:
            self._end_probe()

    def _end_probe(self) -> None:
        """Takes the verdicts of a probe that ended (or is killed now: its deadline passed)."""
        probe = self.probe
        assert probe is not None  # noqa: S101 - called only with one
        self._kill(probe)
        judged: set[str] = set()
        stopped = False  # the probe stopped after an unsafe import (see `successor`)
        for line in probe.data.decode(errors="replace").splitlines():
            verdict, _, name = line.partition(" ")
            if name not in probe.names:
                continue  # (its ready line)
            judged.add(name)
            stopped = verdict != successor.SAFE
            if stopped:
                self.skipped.add(name)
            elif self.handover:  # a successor that failed later: the next one imports it
                self.pending.setdefault(name, probe.names[name])
            else:
                self.safe.append(name)
        unjudged = [n for n in probe.names if n not in judged]
        if unjudged and not stopped:
            # The first never ended its import (it hung, or the probe died in it): skipped.
            self.skipped.add(unjudged.pop(0))
        for name in unjudged:  # never tried: they wait for the next probe
            self.pending.setdefault(name, probe.names[name])

    def _send_more(self, probe: _Probe) -> None:
        """Gives a successor the names reported since it started, to import before it serves."""
        more = {n: o for n, o in self.pending.items() if n not in probe.names}
        if probe.exited or not more:
            return
        with contextlib.suppress(OSError):  # full, or it is gone: they wait
            probe.ctl.send(successor.MORE + pickle.dumps(more))
            probe.names.update(more)
            probe.ready = False
            probe.deadline = time.monotonic() + PROBE_TIMEOUT
            self.pending.clear()

    def _discard(self, keep: list[str]) -> None:
        """Ends a successor that will not serve; `keep`: its names the next one imports."""
        probe = self.probe
        assert probe is not None  # noqa: S101 - called only with one
        self._kill(probe)
        for name in keep:  # from the file the workers imported it from (the next probe checks)
            self.pending.setdefault(name, self.confirmed.get(name, probe.names[name]))

    def _kill(self, probe: _Probe) -> None:
        if not probe.exited:
            with contextlib.suppress(OSError):
                os.kill(probe.pid, signal.SIGKILL)  # still importing, or waiting to take over
            self._gone.add(probe.pid)  # no stray: reaped by the spawner's loop
        probe.ctl.close()
        self.probe = None
        if probe.data:  # (one that died in its trusted imports is not started again for them)
            self.later += [n for n in probe.later if n not in sys.modules]


def import_checked(name: str) -> bool:
    """Imports `name` in the spawner, as a probe approved; False: learning must stop.

    An import that started a thread or initialised CUDA here after all cannot be undone; one
    that changed the process's state is undone (its modules dropped: the workers import it).
    """
    threads, before, loaded = thread_count(), ProcessState.now(), set(sys.modules)
    with contextlib.suppress(Exception):  # not installed here, or broken: workers import it
        import_module(name)
    if thread_count() > threads or cuda_initialised():
        # Cannot be undone; say so, and risk no more.
        print(
            f"slurmrun spawner: importing {name!r} started a thread or initialised CUDA "
            "here although a probe did not; learning preloads stops for this launcher",
            file=sys.stderr,
            flush=True,
        )
        return False
    changes = ProcessState.now().changes(before)
    if changes:  # undone, and left to the workers (see `slurmrun.node.import_effects`)
        before.restore()
        for module in set(sys.modules) - loaded:
            del sys.modules[module]
        print(
            f"slurmrun spawner: importing {name!r} changed {', '.join(changes)} here "
            "although a probe did not; undone, not preloaded, and learning preloads stops "
            "for this launcher",
            file=sys.stderr,
            flush=True,
        )
        return False
    return True
