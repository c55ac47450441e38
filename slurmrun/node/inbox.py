"""What the agent asks of a running worker: stop, show its stacks, take a debugger's line.

A worker's inbox thread (``slurmrun-inbox``) reads its control connection while the function
runs: STOP (or the connection closing: the agent is gone) ends the worker at once, ASK_STACKS
is answered with every thread's stack (`slurmrun.stacks.report.capture`), DEBUG_INPUT goes to the
debugger (`slurmrun.node.debugger`), a map's ITEM goes to its slot's loop
(`slurmrun.node.slot`), and FUNC (the next run, for a kept worker) waits in a
queue for the main thread (`next_call`).

A worker whose threads cannot run (C code holding the GIL) cannot answer ASK_STACKS itself:
faulthandler then dumps its stacks from a signal handler (`arm_stacks_signal`), into the
worker's side socket, which the agent reads (`slurmrun.node.supervisor`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import queue
import signal
import socket
import sys
import threading
from typing import TYPE_CHECKING

from slurmrun import protocol
from slurmrun.map_messages import Item
from slurmrun.node import debugger, slot
from slurmrun.stacks import stacks_signal

if TYPE_CHECKING:
    from slurmrun.transport import Connection, Frame

__all__ = ["INBOX_THREAD", "arm_stacks_signal", "next_call", "watch_agent"]

INBOX_THREAD = "slurmrun-inbox"  # `slurmrun.stacks.report.capture` leaves "slurmrun-" threads out


def arm_stacks_signal(side: socket.socket) -> None:
    """Makes `stacks_signal` dump every thread's stack into `side` (the agent reads it).

    faulthandler writes from the signal handler itself, without the GIL: it answers where no
    Python thread can run. The spawner ignores the signal, so it cannot kill a worker that
    has not armed it yet.
    """
    faulthandler.register(stacks_signal(), file=side, all_threads=True, chain=False)


# The agent sends a kept worker the next run's FUNC only once this run's result is in: at
# most one waits here.
_calls: queue.Queue[Frame] = queue.Queue(maxsize=1)


def next_call() -> Frame:
    """The next run's FUNC frame, for a kept worker.

    No timeout: the agent's connection ending (or its STOP) ends this process from the inbox
    thread. The run that ended takes its debugging with it (`debugger.end_run`).
    """
    debugger.end_run()
    frame = _calls.get()
    debugger.begin_run(protocol.Func.from_header(frame.header).run)
    return frame


def watch_agent(conn: Connection) -> None:
    """Starts the inbox thread of this worker (see the module's docstring)."""
    slot.agent = conn  # a map's slot sends its items' values on it
    threading.Thread(target=_read, args=(conn,), name=INBOX_THREAD, daemon=True).start()


def _read(conn: Connection) -> None:
    try:
        while True:
            frame = conn.recv()
            if frame is None:
                break
            match protocol.parse(frame.header):
                case protocol.Stop():
                    break
                case protocol.Func():
                    _calls.put_nowait(frame)  # a second one would be the agent's bug: Full ends us
                case protocol.AskStacks() as ask:
                    _answer(conn, ask)
                case protocol.DebugInput() as given:
                    line = None if given.eof else bytes(frame.body).decode(errors="replace")
                    debugger.give_input(line, given.run)
                case protocol.DebugComplete() as asked:
                    debugger.give_completion(asked)
                case Item():
                    slot.items.put(frame)  # a map's item, for its slot's loop
    except (OSError, EOFError, protocol.ProtocolError, queue.Full):
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _progress() -> int:
    """The collectives this worker's process groups began (torch's sequence numbers); -1: unknown.

    A hang is told from a run whose ranks are each time seen in the same collective by it
    (`slurmrun.launcher.hangs`). Read from this thread while the main thread may be in one: a
    counter's read, which torch's call does without waiting.
    """
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    try:
        if c10d is None or not c10d.is_initialized():
            return -1
        groups = list(c10d._world.pg_map)  # every group: torch has no public list of them
        return sum(int(g._get_sequence_number_for_group()) for g in groups)
    except Exception:  # another torch, a group being made: unknown, not an error
        return -1


def _answer(conn: Connection, ask: protocol.AskStacks) -> None:
    from slurmrun.stacks import report  # noqa: PLC0415 - when first asked: a run that never is pays nothing
    from slurmrun.stacks.sched import main_thread_sched  # noqa: PLC0415 - as report

    try:
        body = report.capture(skip={threading.get_ident()})
    except Exception as e:  # a dump must never end the worker: say why there is none
        answer = protocol.Stacks(request=ask.request, source="none", note=f"capture failed: {e}")
        body = b""
    else:
        recorder, last = "", ""
        sched = main_thread_sched()
        if ask.purpose == protocol.StacksPurpose.HANG.value:
            from slurmrun.node.recorder import dump_flight_recorder  # noqa: PLC0415 - a hang's

            recorder, last = dump_flight_recorder()
        answer = protocol.Stacks(
            request=ask.request,
            source=report.StackSource.PYTHON.value,
            progress=_progress(),
            recorder=recorder,
            recorder_last=last,
            cpu_ns=sched.cpu_ns if sched else -1,
            queued_ns=sched.queued_ns if sched else -1,
        )
    with contextlib.suppress(OSError):  # the agent is gone: STOP or the close ends us
        conn.send(answer.header(), body)
