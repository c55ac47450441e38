"""Preloads the spawner learns from the last run: what its workers imported, imported once.

A warm launcher forks fresh workers for every run, so a function that imports a package
pays for that import at every run. At its end, each worker writes the top-level installed
packages it imported (and the spawner had not) into a pipe that the spawner made for it
(`report`); the spawner reads the pipe once the worker is reaped. Between runs (once the
agent has asked for the run's strays to be ended, and only while no worker runs) it imports
them, so that the next run's workers start with them loaded.

Which modules are learned:

- top-level names only (``transformers``, not ``transformers.models.bert``), whose file lies
  in a ``site-packages`` or ``dist-packages`` directory: installed packages. The standard
  library is left out (what a package needs of it comes with the package; a stdlib module
  imported on its own costs milliseconds), and so is the user's own code (the working
  directory, ``PYTHONPATH``, editable installs): fresh workers must see an edited file.
- at most `MAX_NAMES` names of at most `MAX_NAME` characters, `MAX_BYTES` bytes in all per
  worker; what is over is dropped, never an error.

What stays out: a forked child has only the thread that forked, so a package that starts a
thread when it is imported (a BLAS thread pool, a monitor thread) or that initialises CUDA
must never be imported in the spawner (fork safety). Nor may a preload leave a worker in
another state than a fresh interpreter that imports the package in the worker: a package
that changes logging (``logging.basicConfig()``), a signal handler, a hook, ``faulthandler``,
the working directory, the environment, the standard streams or ``sys.path`` when it is
imported is left to the workers (`slurmrun.node.import_effects` says why, and what is
restored). Every candidate is therefore first imported in a probe: a throwaway fork of the
spawner, in the spawner's very state, that imports the candidates one by one and reports,
for each, whether the process's threads (its native tasks, `/proc/self/task`) grew, whether
torch's CUDA became initialised, whether the import changed any of that state
(`ProcessState`), or whether the name now resolves to another file than the worker's. The
probe runs while the spawner goes on serving; it has `PROBE_TIMEOUT` seconds, and a
candidate whose import had not ended by then is skipped for good, as is every candidate
that failed or was unsafe. The spawner then imports what the probe found safe, and checks
again: a package that started a thread in the spawner after all cannot be unloaded, so the
spawner says so in the agent's log and learns nothing more; one that changed the process's
state after all has that state restored and its modules dropped (the workers import them
again), and learning stops too.

The spawner imports in its own single thread: a run that asks for workers while the probe
works is served at once; an import the probe approved is made only while no worker runs,
and costs the next run at most what each worker of the last run paid for it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from slurmrun.node.import_effects import ProcessState
from slurmrun.node.parent_death import die_with_parent
from slurmrun.torch_import import import_module

__all__ = [
    "MAX_BYTES",
    "MAX_NAME",
    "MAX_NAMES",
    "PROBE_TIMEOUT",
    "Preloads",
    "installed_top_level",
    "report",
]

MAX_NAMES = 200
MAX_NAME = 100
MAX_BYTES = 16 << 10  # under a pipe's smallest capacity (one page is the floor; 64 KiB usual)
PROBE_TIMEOUT = 60.0
_INSTALLED_DIRS = ("site-packages", "dist-packages")
_SAFE = "ok"


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


def _origin(module: object) -> str | None:
    """The file a module was loaded from (a namespace package's first directory), or None."""
    path = getattr(module, "__file__", None)
    if path is None:
        paths = list(getattr(module, "__path__", []) or [])
        path = paths[0] if paths else None
    return path if isinstance(path, str) else None


def _is_installed(path: str) -> bool:
    parts = path.split(os.sep)
    return any(d in parts for d in _INSTALLED_DIRS)


def installed_top_level(modules: Mapping[str, object], known: Iterable[str] = ()) -> dict[str, str]:
    """The top-level installed packages among `modules` (``sys.modules``), less `known`.

    Returns:
        Name to the file it was loaded from, in import order.
    """
    skip = set(known)
    found: dict[str, str] = {}
    for name, module in list(modules.items()):
        if "." in name or name in skip or name.startswith("_"):
            continue
        origin = _origin(module)
        if origin is not None and _is_installed(origin):
            found[name] = origin
    return found


def encode(found: Mapping[str, str]) -> bytes:
    """One ``name<TAB>origin`` line per module, cut to the bounds (see the module's docstring)."""
    out = bytearray()
    for count, (name, origin) in enumerate(found.items()):
        line = f"{name}\t{origin}\n".encode(errors="replace")
        if count >= MAX_NAMES or len(out) + len(line) > MAX_BYTES:
            break
        if len(name) <= MAX_NAME and name.isidentifier():
            out += line
    return bytes(out)


def decode(data: bytes) -> dict[str, str]:
    """The names and origins `encode` wrote (a cut last line is dropped)."""
    found: dict[str, str] = {}
    for line in data.decode(errors="replace").split("\n")[:-1]:
        name, _, origin = line.partition("\t")
        if name.isidentifier() and len(name) <= MAX_NAME and len(found) < MAX_NAMES:
            found[name] = origin
    return found


def report(fd: int | None, known: Iterable[str]) -> None:
    """Writes what this worker imported beyond `known` into the spawner's pipe; never blocks.

    Args:
        fd: the pipe's write end (None: learning is off); closed here.
        known: the modules the worker started with (the spawner's).
    """
    if fd is None:
        return
    with contextlib.suppress(OSError):
        os.set_blocking(fd, False)  # a full pipe cuts the list, and never holds the exit up
        os.write(fd, encode(installed_top_level(sys.modules, known)))
    with contextlib.suppress(OSError):
        os.close(fd)


# ------------------------------------------------------------------ the spawner's side


def _probe(names: Mapping[str, str], out: int) -> None:  # pragma: no cover - in the probe
    """Imports `names` one by one; writes ``verdict name`` per name into `out`."""
    for name, origin in names.items():
        verdict = _SAFE
        spec = None
        with contextlib.suppress(Exception):
            spec = importlib.util.find_spec(name)
        if spec is None:
            verdict = "missing"
        elif origin and _origin_of_spec(spec) != origin:
            verdict = "another-file"
        else:
            threads, before = thread_count(), ProcessState.now()
            try:
                import_module(name)
            except BaseException:
                verdict = "failed"
            else:
                changes = ProcessState.now().changes(before)
                if thread_count() > threads:
                    verdict = "threads"
                elif cuda_initialised():
                    verdict = "cuda"
                elif changes:
                    verdict = "changes-" + ",".join(changes)
        os.write(out, f"{verdict} {name}\n".encode())
        if verdict != _SAFE:
            return  # what it left behind would taint the next verdicts


def _origin_of_spec(spec: importlib.machinery.ModuleSpec) -> str | None:
    if spec.origin not in (None, "namespace"):
        return spec.origin
    locations = list(spec.submodule_search_locations or [])
    return locations[0] if locations else None


@dataclass
class _Probe:
    pid: int
    fd: int  # the read end of its verdicts
    names: dict[str, str]
    deadline: float
    data: bytes = b""
    exited: bool = False  # reaped by the spawner: its pid may be another process's now


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
    probe: _Probe | None = None
    _pipes: dict[int, int] = field(default_factory=dict)  # worker pid -> read end

    def worker_pipe(self) -> tuple[int, int] | None:
        """A (read, write) pipe for the next worker's report, or None when learning is off."""
        return os.pipe() if self.learn else None

    def started(self, pid: int, read_end: int) -> None:
        """Worker `pid` got the write end of the pipe whose read end is `read_end`."""
        self._pipes[pid] = read_end

    def reaped(self, pid: int) -> None:
        """Worker `pid` exited: takes its report (written before it exited) from its pipe."""
        if self.probe is not None and self.probe.pid == pid:
            self.probe.exited = True
        fd = self._pipes.pop(pid, None)
        if fd is None:
            return
        data = b""
        with contextlib.suppress(OSError):
            os.set_blocking(fd, False)  # a process it started may hold the write end open
            while len(data) <= MAX_BYTES and (chunk := os.read(fd, MAX_BYTES)):
                data += chunk
        os.close(fd)
        for name, origin in decode(data[:MAX_BYTES]).items():
            if name not in sys.modules and name not in self.skipped:
                self.pending.setdefault(name, origin)

    def fds(self) -> list[int]:
        """What the spawner's loop waits on for us: the probe's verdicts."""
        return [] if self.probe is None else [self.probe.fd]

    def timeout(self) -> float | None:
        """How long the spawner's loop may wait before `between_runs` must look at the probe."""
        if self.probe is None:
            return None
        return max(0.0, self.probe.deadline - time.monotonic())

    def own(self, pid: int) -> bool:
        """Whether `pid` is the probe (no stray of a run's)."""
        return self.probe is not None and self.probe.pid == pid

    def between_runs(self, idle: bool) -> None:
        """Moves learning on: reads the probe, imports what is safe, starts the next probe.

        Args:
            idle: no worker runs (imports are made only then).
        """
        if self.probe is not None:
            self._read_probe()
        if not idle:
            return
        while self.later:  # trusted: torch starts a thread of its own, and never CUDA
            with contextlib.suppress(Exception):  # not installed here: workers do without
                import_module(self.later.pop(0))
        while self.safe and self.learn:
            self._import(self.safe.pop(0))
        if self.probe is None and self.pending and self.learn:
            self._start_probe()

    def _import(self, name: str) -> None:
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
            self.learn = False
            return
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
            self.learn = False

    def _start_probe(self) -> None:
        names = {n: o for n, o in self.pending.items() if n not in sys.modules}
        self.pending.clear()
        if not names:
            return
        read_end, write_end = os.pipe()
        parent = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the probe
            code = 0
            try:
                signal.set_wakeup_fd(-1)
                die_with_parent(parent)
                os.close(read_end)
                _probe(names, write_end)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(write_end)
        os.set_blocking(read_end, False)
        self.probe = _Probe(pid, read_end, names, time.monotonic() + PROBE_TIMEOUT)

    def _read_probe(self) -> None:
        probe = self.probe
        assert probe is not None  # noqa: S101 - called only with one
        ended = False
        try:
            while chunk := os.read(probe.fd, 4096):
                probe.data += chunk
            ended = True
        except BlockingIOError:
            ended = time.monotonic() >= probe.deadline
        except OSError:
            ended = True
        if not ended:
            return
        if not probe.exited:
            with contextlib.suppress(OSError):
                os.kill(probe.pid, signal.SIGKILL)  # still importing: the deadline passed
        os.close(probe.fd)
        self.probe = None
        judged: set[str] = set()
        stopped = False  # the probe stopped after an unsafe import (see `_probe`)
        for line in probe.data.decode(errors="replace").splitlines():
            verdict, _, name = line.partition(" ")
            judged.add(name)
            stopped = verdict != _SAFE
            (self.safe.append if verdict == _SAFE else self.skipped.add)(name)
        unjudged = [n for n in probe.names if n not in judged]
        if unjudged and not stopped:
            # The first never ended its import (it hung, or the probe died in it): skipped.
            self.skipped.add(unjudged.pop(0))
        for name in unjudged:  # never tried: they wait for the next probe
            self.pending.setdefault(name, probe.names[name])
