"""The spawner: a fork of the agent that imports torch once and forks every worker from there.

The agent forks it first thing, before any thread exists, so it costs no interpreter start of
its own (a multiprocessing forkserver would be a fresh interpreter: site, imports and all);
it then imports torch (never initialising CUDA) while the agent connects to the launcher.
A worker is a fork of the spawner, so it starts in milliseconds with torch already loaded.

The agent sends a request over a private socketpair: the pickled `WorkerSpec` plus the
worker's sockets and the write end of a status pipe as file descriptors. The spawner forks,
answers with the worker's pid, reaps it when it exits and writes its exit code (negative:
killed by that signal) into the status pipe, whose read end the agent waits on.

A run owns every process its workers start. Each worker leads a session of its own (its
process group holds what it starts, unless they move), and the spawner is the child
subreaper of everything below it: a process that a worker started and left behind (a helper
server, a DataLoader worker, a daemon that called setsid) becomes the spawner's child when its
parent exits. Once a run's workers are gone, the agent asks the spawner to end those strays
(`Spawner.end_strays`): SIGTERM, a short grace, then SIGKILL, until none is left.

Between runs, the spawner imports what the last run's workers imported
(`slurmrun.node.preloads`: learned preloads, each tried in a throwaway probe first).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import pickle
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from slurmrun.node.parent_death import be_subreaper, die_with_parent
from slurmrun.node.preloads import Preloads
from slurmrun.node.proctitle import SPAWNER_COMM, node_name, set_title
from slurmrun.stacks import stacks_signal
from slurmrun.torch_import import import_module
from slurmrun.versions import missing_dependency
from slurmrun.waiting import wait_readable

__all__ = ["Spawner", "WorkerProcess", "forget_variable", "wait_any"]

_REPLY = struct.Struct("!qq")  # a pid or a count, and the answering spawner's pid
_CODE = struct.Struct("!i")
_SLICE = 0.01  # seconds a poll waits holding a worker's lock, at most
MAX_REQUEST_BYTES = 1 << 20
WORKER_FDS = 4  # control, stdout, stderr, streams (see agent.Agent.spawn)
# ... and rank 0's may come with a fifth: the listening socket of the run's store.
SPAWN_TIMEOUT = 120.0  # the spawner answers once its imports are done; this bounds a wedged one
_END_STRAYS = b"end-strays"  # the agent's request (not a pickle: one never starts this way)
# How long strays may take to exit after SIGTERM, and to vanish after SIGKILL.
STRAY_GRACE = 1.0
STRAY_KILL_WAIT = 5.0
_STRAY_POLL = 0.01
# A successor that took over waits this long at most for the old spawner to exit.
REPARENT_WAIT = 5.0
# Workers get the dispositions a Python program starts with (Ctrl-C: KeyboardInterrupt).
_RESTORE = {
    signal.SIGINT: signal.default_int_handler,
    signal.SIGCHLD: signal.SIG_DFL,
    signal.SIGTERM: signal.SIG_DFL,
}


class SpawnError(RuntimeError):
    """The spawner could not start a worker (it died, or never answered)."""


def _scrub_exec_environment(name: str) -> None:
    """Blanks out `name` in the environment block this process was exec'd with.

    unsetenv() leaves the original block untouched, and that block is what /proc/<pid>/environ
    shows, here and in every process forked from here. The block is walked in place: a copy
    of it (``ctypes.string_at``) would be a bytes object whose freed memory keeps the value.
    Best effort: Linux only.
    """
    prefix = os.fsencode(name) + b"="
    with contextlib.suppress(OSError, ValueError, IndexError, AttributeError):
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        at, end = int(fields[47]), int(fields[48])  # env_start, env_end (man 5 proc)
        strnlen = ctypes.CDLL(None).strnlen
        strnlen.restype = ctypes.c_size_t
        strnlen.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        while at < end:
            length = strnlen(at, end - at)
            if length >= len(prefix) and ctypes.string_at(at, len(prefix)) == prefix:
                ctypes.memset(at, 0, length)  # name=value, all of it
            at += length + 1


def forget_variable(name: str) -> None:
    """Removes `name` from this process's environment and wipes every copy of its value.

    Its value lives in three places: the bytes object that `os.environ` and `os.environb`
    share (made once at interpreter start; reading the variable through `os.environ` would
    decode it into a str, which cannot be wiped), the C environment (unsetenv() drops the
    pointer) and the block the process was exec'd with. The bytes object is zeroed in place
    before it is dropped, or its freed memory would still hold the value.
    """
    key = os.fsencode(name)
    value = os.environb.get(key)
    if value:
        # CPython: a bytes object's data starts at its last field (ob_sval).
        ctypes.memset(id(value) + bytes.__basicsize__ - 1, 0, len(value))
        del value
        del os.environb[key]
    _scrub_exec_environment(name)


@dataclass
class WorkerProcess:
    """The agent's handle on one worker (a grandchild: the spawner is its parent)."""

    pid: int
    sentinel: int  # read end of the status pipe: readable once the worker was reaped
    exitcode: int | None = None
    # Several threads poll (the supervisor, a stacks request's): one reads the code and closes
    # the pipe; another reading at once would find it empty and take the worker for SIGKILLed.
    _reading: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def poll(self, timeout: float = 0.0) -> int | None:
        """The exit code once the worker exited (waiting up to `timeout`), else None."""
        deadline = time.monotonic() + timeout
        while self.exitcode is None:
            with self._reading:  # a slice at a time: the others wait for it, not for `timeout`
                left = deadline - time.monotonic()
                wait = max(0.0, min(_SLICE, left))
                if self.exitcode is None and wait_readable([self.sentinel], wait):
                    data = os.read(self.sentinel, _CODE.size)
                    # No code: the spawner itself died, and took the worker with it (PDEATHSIG).
                    code = _CODE.unpack(data)[0] if len(data) == _CODE.size else -signal.SIGKILL
                    os.close(self.sentinel)
                    self.exitcode = code
            if left <= 0:
                break
        return self.exitcode

    def is_alive(self) -> bool:
        """Whether the worker has not exited yet."""
        return self.poll() is None

    def join(self, timeout: float) -> None:
        """Waits up to `timeout` seconds for the worker to exit."""
        self.poll(max(0.0, timeout))

    def send_signal(self, signum: int) -> None:
        """Sends `signum` to the worker, if it is alive."""
        if self.is_alive():  # never signal a pid that the spawner may have reaped already
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        """Sends SIGTERM."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """Sends SIGKILL."""
        self.send_signal(signal.SIGKILL)


def wait_any(processes: Sequence[WorkerProcess], timeout: float) -> list[WorkerProcess]:
    """Those of `processes` that have exited, waiting up to `timeout` seconds for one to."""
    if processes and all(p.exitcode is None for p in processes):
        wait_readable([p.sentinel for p in processes], timeout)
    return [p for p in processes if p.poll() is not None]


@dataclass
class Spawner:
    """The agent's end of the spawner process.

    Where the agent is a child subreaper, a spawner may hand over to a successor
    (`slurmrun.node.successor`): answers then come from it, and name its pid.
    """

    pid: int
    sock: socket.socket
    retired: list[int] = field(default_factory=list)  # spawners that handed over, to reap

    @classmethod
    def start(
        cls,
        preload: Sequence[str],
        forget: Sequence[str] = (),
        *,
        later: Sequence[str] = (),
        learn: bool = False,
    ) -> Spawner:
        """Forks the spawner, which then imports `preload`; call before starting any thread.

        Args:
            preload: modules the spawner imports, so that workers start with them loaded.
            forget: environment variables the spawner removes and wipes first thing (see
                `forget_variable`), so that no worker can find their values anywhere.
            later: modules the spawner imports after the first run (not before it).
            learn: whether it imports, between runs, what the last run's workers imported
                (`slurmrun.node.preloads`).
        """
        # A successor outlives the spawner it succeeds: the agent must become its parent.
        handover = bool(learn or later) and be_subreaper()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sys.stdout.flush()
        sys.stderr.flush()
        agent_pid = os.getpid()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the spawner process; tests see it through workers
            code = 0
            try:
                for name in forget:
                    forget_variable(name)
                mine.close()
                _serve(theirs, preload, agent_pid, Preloads(list(later), learn), handover)
            except ModuleNotFoundError as e:  # this Python lacks a package slurmrun needs
                print(f"slurmrun.node.spawner: {missing_dependency(e.name or str(e))}")
                code = 1
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        theirs.close()
        mine.settimeout(SPAWN_TIMEOUT)
        return cls(pid, mine)

    def spawn(self, spec: Any, fds: Sequence[int]) -> WorkerProcess:
        """Forks one worker running `worker.run_worker(spec, *sockets)` with the given fds.

        `fds`: its control, stdout, stderr and streams sockets, and for rank 0 maybe the
        listening socket of the run's store (`slurmrun.node.store_port`).
        """
        status_r, status_w = os.pipe()
        try:
            socket.send_fds(self.sock, [pickle.dumps(spec)], [*fds, status_w])
        except OSError as e:
            os.close(status_r)
            raise SpawnError(f"the worker spawner (pid {self.pid}) is gone: {e}") from e
        finally:
            os.close(status_w)
        try:
            pid = self._answer()
        except SpawnError:
            os.close(status_r)
            raise
        return WorkerProcess(pid, status_r)

    def end_strays(self) -> int:
        """Ends every process that workers started and left behind; call once they are gone.

        Returns:
            How many were found (0 in the common case, which costs one look at /proc).

        Raises:
            SpawnError: the spawner is gone or did not answer.
        """
        try:
            self.sock.send(_END_STRAYS)
        except OSError as e:
            raise SpawnError(f"the worker spawner (pid {self.pid}) did not answer: {e}") from e
        return self._answer()

    def _answer(self) -> int:
        try:
            reply = self.sock.recv(_REPLY.size)
        except OSError as e:
            raise SpawnError(f"the worker spawner (pid {self.pid}) did not answer: {e}") from e
        if len(reply) != _REPLY.size:
            raise SpawnError(f"the worker spawner (pid {self.pid}) died; see the agent's log")
        value, pid = _REPLY.unpack(reply)
        if pid != self.pid:  # a successor took over; the old spawner exits
            self.retired.append(self.pid)
            self.pid = pid
        for old in list(self.retired):
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(old, os.WNOHANG) == (0, 0):
                    continue
            self.retired.remove(old)
        return int(value)

    def close(self, timeout: float = 5.0) -> None:
        """Ends the spawner and reaps it; call once every worker was stopped.

        It may still be importing torch (when the launch failed early), so it is killed
        rather than asked: a worker somehow still alive would die with it (PDEATHSIG).
        """
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        for pid in [self.pid, *self.retired]:
            with contextlib.suppress(ChildProcessError):
                while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
                    time.sleep(0.001)


# ------------------------------------------------------------------ the spawner process


def _serve(
    sock: socket.socket, preload: Sequence[str], agent_pid: int, preloads: Preloads, handover: bool
) -> None:
    # SLURM ends a step with SIGTERM to every process in it: had the spawner died of it, its
    # workers would have died with it (PDEATHSIG) with no time to checkpoint. Its life is the
    # agent's: PDEATHSIG, or the agent's socket closing, ends it.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent decides when workers stop
    # Until a worker arms it (`inbox.arm_stacks_signal`), a dump request must not kill it.
    signal.signal(stacks_signal(), signal.SIG_IGN)
    die_with_parent(agent_pid, reaper=True)
    # Before torch's import starts threads: they inherit the comm (top's name) of their creator.
    set_title(f"slurmrun spawner ({node_name(os.environ)})", SPAWNER_COMM)
    for module in preload:
        with contextlib.suppress(ImportError):  # e.g. no torch on this node: backend=None works
            import_module(module)
    from slurmrun.node.worker import run_worker  # noqa: PLC0415 - after torch, like the workers

    _Loop(sock, agent_pid, run_worker, preloads, handover).serve()


class _Loop:
    """The spawner's loop: forks workers on the agent's requests, reaps them, learns preloads."""

    def __init__(
        self,
        sock: socket.socket,
        agent_pid: int,
        run_worker: Any,
        preloads: Preloads,
        handover: bool,
    ) -> None:
        self.sock, self.agent_pid, self.run_worker, self.preloads = (
            sock,
            agent_pid,
            run_worker,
            preloads,
        )
        self.status: dict[int, int] = {}  # worker pid -> write end of its status pipe
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_w.setblocking(False)
        signal.set_wakeup_fd(self.wake_w.fileno())
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD wakes select
        preloads.become = self._become if handover else None
        preloads.inherited = lambda: [self.sock.fileno(), *self._own(), *self.status.values()]

    def _own(self) -> list[int]:
        return [self.wake_r.fileno(), self.wake_w.fileno()]

    def _become(self, sock: socket.socket, request: bytes, fds: list[int]) -> None:
        """In a successor that took over (`slurmrun.node.successor`): serves from now on."""
        old = os.getppid()
        _Loop(sock, self.agent_pid, self.run_worker, self.preloads, handover=True).serve(
            (request, fds), old
        )

    def serve(self, first: tuple[bytes, list[int]] | None = None, old: int | None = None) -> None:
        """Serves the agent until it is gone and every worker was reaped.

        Args:
            first: a request to serve first (the one a successor took over with).
            old: the spawner this one took over from (our parent until it exited).
        """
        sock, preloads = self.sock, self.preloads
        agent_gone = first is not None and not self._spawn(*first)
        # Once the old spawner exited, the agent (a child subreaper) is our parent.
        reparented = time.monotonic() + REPARENT_WAIT
        while not agent_gone or self.status:
            if old is not None and (os.getppid() != old or time.monotonic() > reparented):
                die_with_parent(self.agent_pid, reaper=True)  # exits if it is not the agent
                old = None
            waits: list[socket.socket | int] = [self.wake_r]
            if not agent_gone:
                waits += [sock, *preloads.fds()]
            timeout = preloads.timeout()
            if old is not None:
                timeout = min(timeout or _SLICE, _SLICE)
            ready, _, _ = select.select(waits, [], [], timeout)
            if self.wake_r in ready:
                self.wake_r.recv(4096)
                _reap(self.status, preloads)
            if not agent_gone and (not ready or set(ready) & set(preloads.fds())):
                preloads.between_runs(idle=not self.status)  # the probe answered, or is late
            if sock in ready:
                try:
                    msg, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST_BYTES, WORKER_FDS + 2)
                except OSError:
                    msg, fds = b"", []
                if not msg:
                    agent_gone = True  # finish reaping; PDEATHSIG ends the workers with us anyway
                    for fd in fds:
                        os.close(fd)
                    continue
                if msg == _END_STRAYS:
                    agent_gone = not _answer(sock, _end_strays(self.status, preloads))
                    preloads.between_runs(idle=not self.status)  # the run is over: learn
                    continue
                if preloads.ready() and self._idle() and preloads.hand_over(sock, msg, fds):
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(0)  # the successor serves this request and every later one
                agent_gone = not self._spawn(msg, fds)
                preloads.between_runs(idle=False)  # a successor may start: after the answer

    def _idle(self) -> bool:
        """No worker of ours runs, and nothing a worker left behind (the successor aside)."""
        _reap(self.status, self.preloads)
        return not self.status and not {p for p in _children() if not self.preloads.own(p)}

    def _spawn(self, msg: bytes, fds: list[int]) -> bool:
        """Forks the worker that `msg` asks for; False if the agent is gone."""
        spec = pickle.loads(msg)  # noqa: S301 - from the agent, our parent, over a socketpair
        pid = _fork_worker(
            functools.partial(
                _worker_child,
                self.run_worker,
                spec,
                fds,
                own=[self.sock, self.wake_r, self.wake_w],
                status=self.status,
                private=self.preloads.private_fds(),
                early=self.preloads.handover,
            ),
            self.preloads,
        )
        for fd in fds[:-1]:
            os.close(fd)
        self.status[pid] = fds[-1]  # the status pipe's write end comes last
        return _answer(self.sock, pid)


def _answer(sock: socket.socket, value: int) -> bool:
    """Sends the agent a pid or a count, and our pid (a successor's is new); False if it is gone."""
    try:
        sock.send(_REPLY.pack(value, os.getpid()))
    except OSError:
        return False
    return True


def _fork_worker(child: Callable[..., None], preloads: Preloads) -> int:
    """Forks a worker that runs `child(imports=...)` (its report's pipe); returns its pid."""
    imports = preloads.worker_pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the worker
        die_with_parent(parent)
        child(imports=imports)
    if imports is not None:
        os.close(imports[1])
        preloads.started(pid, imports[0])
    return pid


def _worker_child(
    run_worker: Any,
    spec: Any,
    fds: list[int],
    *,
    own: list[socket.socket],
    status: dict[int, int],
    private: list[int],
    early: bool,
    imports: tuple[int, int] | None,
) -> None:  # pragma: no cover - runs in the forked worker
    code = 1
    try:
        os.setsid()  # its own session and process group: what it starts is the run's
        signal.set_wakeup_fd(-1)
        for signum, handler in _RESTORE.items():
            signal.signal(signum, handler)
        for s in own:
            s.close()
        for fd in [*status.values(), fds[-1], *private]:
            os.close(fd)
        report = None
        if imports is not None:
            os.close(imports[0])
            report = imports[1]
        sockets = (socket.socket(fileno=fd) for fd in fds[:-1])
        run_worker(spec, *sockets, imports=report, early=early)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _children() -> set[int]:
    """This process's children (strays that were reparented here included)."""
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/children") as f:
                found.update(int(pid) for pid in f.read().split())
    return found


def _signal_stray(pid: int, signum: int) -> None:
    """Signals a stray and the process group it leads, if it leads one (not ours): once."""
    with contextlib.suppress(OSError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, signum)
            return
        os.kill(pid, signum)


def _end_strays(status: dict[int, int], preloads: Preloads) -> int:
    """Ends every child that is not a live worker (see the module's docstring); returns how many.

    Killing a stray makes its own children ours in turn: they are found on the next look.
    The preloads' probe is no stray.
    """
    _reap(status, preloads)
    strays = {pid for pid in _children() - set(status) if not preloads.own(pid)}
    if not strays:
        return 0
    seen = set(strays)
    for pid in strays:
        _signal_stray(pid, signal.SIGTERM)
    deadline = time.monotonic() + STRAY_GRACE
    kill_deadline = deadline + STRAY_KILL_WAIT
    while strays and time.monotonic() < kill_deadline:
        time.sleep(_STRAY_POLL)
        _reap(status, preloads)
        strays = {pid for pid in _children() - set(status) if not preloads.own(pid)}
        seen |= strays
        if time.monotonic() >= deadline:
            for pid in strays:
                _signal_stray(pid, signal.SIGKILL)
    return len(seen)


def _reap(status: dict[int, int], preloads: Preloads) -> None:
    """Reaps every child that exited: workers (their code goes to their status pipe) and strays."""
    while True:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        preloads.reaped(pid)  # before the agent hears of it: the next run may come at once
        fd = status.pop(pid, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.write(fd, _CODE.pack(os.waitstatus_to_exitcode(wait_status)))
            os.close(fd)
