"""The spawner process: forks workers on the agent's requests, reaps them, ends their strays.

`slurmrun.node.spawner` forks it and holds the agent's end (`Spawner`). Each request is a
pickled `WorkerSpec` with the worker's sockets and its status pipe's write end; the answer
is the worker's pid (`REPLY`, with the answering spawner's own pid: a successor's differs).
Once a run's workers are gone, the agent asks for their strays to be ended (`END_STRAYS`):
every child that is no live worker (the spawner is the child subreaper of all below it).

Between requests it learns preloads (`slurmrun.node.preloads`); where the agent is a child
subreaper, a successor that imported them takes over at a request once no worker of this
spawner runs (`slurmrun.node.successor`), and this process exits.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import select
import signal
import socket
import struct
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from slurmrun.node.parent_death import die_with_parent
from slurmrun.node.preloads import Preloads
from slurmrun.node.proctitle import SPAWNER_COMM, node_name, set_title
from slurmrun.stacks import stacks_signal
from slurmrun.torch_import import import_module

__all__ = [
    "CODE",
    "END_STRAYS",
    "MAX_REQUEST_BYTES",
    "REPLY",
    "STRAY_GRACE",
    "STRAY_KILL_WAIT",
    "WORKER_FDS",
    "serve",
    "signal_stray",
]

CODE = struct.Struct("!i")  # a worker's exit code, in its status pipe
REPLY = struct.Struct("!qq")  # a pid or a count, and the answering spawner's pid
END_STRAYS = b"end-strays"  # the agent's request (not a pickle: one never starts this way)
MAX_REQUEST_BYTES = 1 << 20
WORKER_FDS = 4  # control, stdout, stderr, streams (see agent.Agent.spawn)
# ... and rank 0's may come with a fifth: the listening socket of the run's store.
# How long strays may take to exit after SIGTERM, and to vanish after SIGKILL.
STRAY_GRACE = 1.0
STRAY_KILL_WAIT = 5.0
_STRAY_POLL = 0.01
# A successor that took over waits this long at most for the old spawner to exit.
REPARENT_WAIT = 5.0
_SLICE = 0.01  # how often a successor looks whether it was adopted by the agent yet
# Workers get the dispositions a Python program starts with (Ctrl-C: KeyboardInterrupt).
_RESTORE: dict[signal.Signals, Any] = {
    signal.SIGINT: signal.default_int_handler,
    signal.SIGCHLD: signal.SIG_DFL,
    signal.SIGTERM: signal.SIG_DFL,
}


def serve(
    sock: socket.socket, preload: Sequence[str], agent_pid: int, preloads: Preloads, handover: bool
) -> None:
    """The spawner process's life: imports `preload`, then serves the agent over `sock`.

    Args:
        sock: the spawner's end of the socketpair to the agent.
        preload: modules to import first (torch).
        agent_pid: the agent's pid (the spawner dies with it).
        preloads: what it learns (`slurmrun.node.preloads`).
        handover: whether a successor may take over (the agent is a child subreaper).
    """
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
                if msg == END_STRAYS:
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
        sock.send(REPLY.pack(value, os.getpid()))
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


def signal_stray(pid: int, signum: int) -> None:
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
        signal_stray(pid, signal.SIGTERM)
    deadline = time.monotonic() + STRAY_GRACE
    kill_deadline = deadline + STRAY_KILL_WAIT
    while strays and time.monotonic() < kill_deadline:
        time.sleep(_STRAY_POLL)
        _reap(status, preloads)
        strays = {pid for pid in _children() - set(status) if not preloads.own(pid)}
        seen |= strays
        if time.monotonic() >= deadline:
            for pid in strays:
                signal_stray(pid, signal.SIGKILL)
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
                os.write(fd, CODE.pack(os.waitstatus_to_exitcode(wait_status)))
            os.close(fd)
