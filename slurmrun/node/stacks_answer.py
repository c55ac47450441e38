"""The agent's answer to ASK_STACKS: every worker's stacks, from the worker or from faulthandler.

Each live worker is asked (its inbox thread answers with `slurmrun.stacks.report.capture`, and the
relay forwards the answer); one that has not answered within the request's ``answer_wait``
(C code holding the GIL, a thread that cannot be scheduled) is silent. For a report (a user's
``stacks()``, a stall, a hang) it then gets the stacks signal, and its faulthandler writes every
thread's stack into its side socket, read here. A sample (`slurmrun.protocol.StacksPurpose`)
is only passed on (`ask_workers`): never dumped, never waited for. faulthandler reads every
thread's frames without the GIL, from a signal handler: a risk worth taking when a person asks,
not several times a second. A worker that exited, or that neither answers nor dumps, gets an
answer without stacks saying why, so that the launcher never waits for a rank in vain.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from slurmrun import protocol
from slurmrun.node.relay import WorkerLink
from slurmrun.stacks import stacks_signal
from slurmrun.stacks.report import MAX_CAPTURE_BYTES, StackSource
from slurmrun.transport import Connection
from slurmrun.waiting import wait_readable

__all__ = ["answer_stacks", "ask_workers"]

_POLL = 0.005
# faulthandler's dump: how long it may take to start, and the pause that ends it.
DUMP_WAIT = 2.0
DUMP_QUIET = 0.2
# One dump at a time: two requests at once (the launcher's sampling and a user's) would read
# each other's text from the worker's one side socket.
_dumping = threading.Lock()


def answer_stacks(
    workers: Sequence[WorkerLink], launcher: Connection, ask: protocol.AskStacks
) -> None:
    """Answers `ask` for every one of `workers` (on a thread of its own: this waits)."""
    asked = ask_workers(workers, launcher, ask)
    deadline = time.monotonic() + max(0.0, ask.answer_wait)
    while time.monotonic() < deadline and any(w.stacks_answered < ask.request for w in asked):
        time.sleep(_POLL)
    for worker in asked:
        if worker.stacks_answered >= ask.request:
            continue
        text = _dump(worker)
        if worker.stacks_answered >= ask.request:
            continue  # it answered after all (the dump, if any, is dropped)
        if text:
            _send(launcher, ask, worker, StackSource.FAULTHANDLER, "", text.encode())
        else:
            why = _gone(worker) or f"no answer within {ask.answer_wait + DUMP_WAIT:g} s"
            _send(launcher, ask, worker, StackSource.NONE, why)


def ask_workers(
    workers: Sequence[WorkerLink], launcher: Connection, ask: protocol.AskStacks
) -> list[WorkerLink]:
    """Passes `ask` on to every live worker; answers at once for the others; returns those asked.

    The workers' answers go to the launcher through the relay. All a sample needs
    (`slurmrun.protocol.StacksPurpose`): the launcher counts a worker that has not answered by
    the sample's deadline as silent, and the agent neither waits nor starts a thread for it.
    Nor does it wait to send: a sample runs on the agent's thread that reads the launcher, and
    a worker whose C code holds its GIL reads nothing, so requests would fill its socket and
    then hold that thread. Such a worker is silent in the sample at once.
    """
    header = ask.header()
    sample = not ask.dumps()
    asked: list[WorkerLink] = []
    for worker in workers:
        why = _gone(worker)
        source = StackSource.NONE
        if why is None:
            try:
                sent = _pass_on(worker.conn, header, wait=not sample)
            except OSError:
                why = "its connection to the agent is closed"
            else:
                if sent:
                    asked.append(worker)
                    continue
                why, source = "it reads no message of its agent's now", StackSource.SILENT
        _send(launcher, ask, worker, source, why)
    return asked


def _pass_on(conn: Connection, header: dict[str, Any], *, wait: bool) -> bool:
    """Sends `header` to a worker; without `wait`, only if that needs no wait (True: sent)."""
    if not wait:
        return conn.send_nowait(header)
    conn.send(header)
    return True


def _gone(worker: WorkerLink) -> str | None:
    """Why `worker` cannot show its stacks, or None if it can."""
    if worker.delivered:
        return "it returned (or raised) already"
    code = worker.process.poll()
    if code is not None:
        return "it exited" if code >= 0 else f"it was killed by signal {-code}"
    return None


def _send(  # noqa: PLR0917 - one answer's parts
    launcher: Connection,
    ask: protocol.AskStacks,
    worker: WorkerLink,
    source: StackSource,
    note: str,
    body: bytes = b"",
) -> None:
    answer = protocol.Stacks(
        request=ask.request,
        source=source.value,
        note=note,
        local_rank=worker.local_rank,
        run=ask.run,
    )
    with contextlib.suppress(OSError):  # cut: the launcher sees the connection end
        launcher.send(answer.header(), body)


def _dump(worker: WorkerLink) -> str:
    """Makes `worker`'s faulthandler dump its stacks into its side socket; returns the text."""
    with _dumping:
        return _dump_now(worker)


def _dump_now(worker: WorkerLink) -> str:
    side = worker.streams
    with contextlib.suppress(OSError):
        while wait_readable([side.fileno()], 0):  # anything stale of an earlier dump
            if not side.recv(1 << 16, socket.MSG_DONTWAIT):
                break
    try:
        os.kill(worker.process.pid, stacks_signal())
    except OSError:
        return ""
    chunks: list[bytes] = []
    size = 0
    deadline = time.monotonic() + DUMP_WAIT
    while size < MAX_CAPTURE_BYTES:
        left = deadline - time.monotonic()
        wait = DUMP_QUIET if chunks else left  # a pause once it began: the dump is whole
        if left <= 0:
            break
        try:
            if not wait_readable([side.fileno()], min(wait, left)):
                break
            data = side.recv(MAX_CAPTURE_BYTES - size)
        except (OSError, ValueError):
            break
        if not data:
            break
        chunks.append(data)
        size += len(data)
    return b"".join(chunks).decode(errors="replace")
