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

What workers import, a fork of the spawner imports too, while the spawner goes on serving
(`slurmrun.node.preloads`: learned preloads). That fork then succeeds the spawner: at a
request that finds no worker of the old spawner running, it takes the agent's socket and
answers from then on, with its own pid in each answer; the old spawner exits. The agent is
a child subreaper (`Spawner.start`), so the successor becomes its child, dies with it, and
is the one `Spawner.close` ends. The spawner's side is `slurmrun.node.spawner_process`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from slurmrun.node.parent_death import be_subreaper
from slurmrun.node.preloads import Preloads
from slurmrun.node.spawner_process import CODE, END_STRAYS, REPLY, serve
from slurmrun.versions import missing_dependency
from slurmrun.waiting import wait_readable

__all__ = ["Spawner", "WorkerProcess", "forget_variable", "wait_any"]

_SLICE = 0.01  # seconds a poll waits holding a worker's lock, at most
SPAWN_TIMEOUT = 120.0  # the spawner answers once its imports are done; this bounds a wedged one


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
                    data = os.read(self.sentinel, CODE.size)
                    # No code: the spawner itself died, and took the worker with it (PDEATHSIG).
                    code = CODE.unpack(data)[0] if len(data) == CODE.size else -signal.SIGKILL
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
                serve(theirs, preload, agent_pid, Preloads(list(later), learn), handover)
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
            self.sock.send(END_STRAYS)
        except OSError as e:
            raise SpawnError(f"the worker spawner (pid {self.pid}) did not answer: {e}") from e
        return self._answer()

    def _answer(self) -> int:
        try:
            reply = self.sock.recv(REPLY.size)
        except OSError as e:
            raise SpawnError(f"the worker spawner (pid {self.pid}) did not answer: {e}") from e
        if len(reply) != REPLY.size:
            raise SpawnError(f"the worker spawner (pid {self.pid}) died; see the agent's log")
        value, pid = REPLY.unpack(reply)
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
