"""What a worker sends, carried to the launcher by its agent.

Each worker of a run has a control socket (results, errors, logging records: frames that the
agent forwards as opaque bytes, and requests for a connection of its own for a large result)
and its stdout and stderr (bytes, turned into line records here). One thread per socket
carries them; records go to the worker's log file when the agent writes it, and to the
launcher when it shows them.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import logging
import os
import socket
import termios
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from slurmrun import protocol
from slurmrun.logs import WorkerLog
from slurmrun.map_messages import ItemRaised, ItemValue
from slurmrun.node.link import LauncherConnection
from slurmrun.node.output_window import OutputWindow
from slurmrun.node.spawner import WorkerProcess
from slurmrun.node.worker import STREAM_GRANTED, STREAM_REFUSED
from slurmrun.output import (
    LINE,
    PROGRESS,
    LineAssembler,
    LineJoiner,
    log_frame,
    log_text,
    note_cut,
    printable,
)
from slurmrun.transport import Connection, Frame, FrameHead
from slurmrun.waiting import wait_readable

__all__ = ["Relay", "WorkerLink", "begin_item", "end_item"]

# A worker's frames are forwarded unparsed (the agent never unpickles, and reads only what it
# must of a header), so they are told apart by kind: these end a worker's run.
_FINAL = (protocol.Result.kind, protocol.Error.kind)
_ITEM_ANSWERS = (ItemValue.kind, ItemRaised.kind)  # a map's item ended: its file is complete

# A drain gives up after this long without progress (unless the launcher's window holds the
# output back: then the launcher is alive and the wait is its terminal's).
OUTPUT_DRAIN_LIMIT = 1.0
TAIL_LINES = 30
READ_SIZE = 1 << 16
READ_LINGER = 0.001  # seconds (see `_read`)
_FULL = 4096
# Each line kept for a failure's message is cut to this: the message travels in a header.
TAIL_LINE_CHARS = 2000


@dataclass
class WorkerLink:
    """The agent's handle on one worker of a run: its process, its sockets, their threads."""

    local_rank: int
    process: WorkerProcess
    conn: Connection
    streams: socket.socket  # where it gets connections of its own for large results
    readers: list[threading.Thread] = field(default_factory=list)
    outputs: list[socket.socket] = field(default_factory=list)  # its stdout and stderr
    output_lock: threading.Lock = field(default_factory=threading.Lock)
    output_read: int = 0  # bytes read from its stdout and stderr (under output_lock)
    last_lines: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    relay: threading.Thread | None = None
    delivered: bool = False
    judged: bool = False
    log: WorkerLog | None = None  # its log file, when this agent writes it
    forward: bool = True  # whether its output and logging records go to the launcher
    run: int = 0  # the run it belongs to: every frame it sends is marked with it
    stacks_answered: int = 0  # the last ASK_STACKS request it answered itself
    # The kind of its last final frame of this run (`protocol.Result` or `protocol.Error`)
    outcome: type[protocol.Message] | None = None
    stays: bool = False  # its result said it waits for the next run (a kept worker)
    wake: Callable[[], None] | None = None  # called once its final frame was forwarded
    item_file: BinaryIO | None = None  # a map's item's own file: its output, as written


@dataclass
class Relay:
    """Carries every worker's output and frames to the launcher.

    Output and logging records (LOG) go within the launcher's window (`OutputWindow`): while
    it is full, their threads wait, and with them the workers that print.

    Args:
        launcher: the agent's connection to the launcher.
        connect: a new authenticated connection to the launcher (for a large result).
        before_error: called before a worker's error is forwarded: says first that SLURM is
            ending the step, if it is, so that the launcher blames the step's end, not the
            rank (a worker whose child SLURM's SIGTERM killed raises, not dies).
    """

    launcher: LauncherConnection
    connect: Callable[[], socket.socket]
    before_error: Callable[[], None] = lambda: None
    window: OutputWindow = field(default_factory=OutputWindow)

    def start(self, worker: WorkerLink) -> None:
        """Starts the threads that carry `worker`'s output and frames to the launcher."""
        for sock, stream in zip(worker.outputs, ("stdout", "stderr"), strict=True):
            reader = threading.Thread(
                target=self._forward_output, args=(worker, sock, stream), daemon=True
            )
            reader.start()
            worker.readers.append(reader)
        worker.relay = threading.Thread(target=self._relay, args=(worker,), daemon=True)
        worker.relay.start()

    def _relay(self, worker: WorkerLink) -> None:
        """Forwards the worker's frames (results, errors, logging records) as they come."""
        try:
            while True:
                head = worker.conn.recv_head()
                if head is None:
                    break
                if head.kind == protocol.StreamRequest.kind:
                    self._grant_stream(worker)
                    continue
                protocol.stamp(head.header, run=worker.run, local_rank=worker.local_rank)
                if head.kind == protocol.Log.kind:
                    self._logged(worker, worker.conn.recv_payload(head))
                    continue
                final = head.kind in _FINAL
                item_ends = head.kind in _ITEM_ANSWERS and worker.item_file is not None
                if final or item_ends:
                    self.drain_output(worker)  # what it printed first reaches the launcher first
                if item_ends:
                    end_item(worker)  # before the launcher hears of it and sends the next
                if head.kind == protocol.Error.kind:
                    self._relay_error(worker, head)
                else:
                    # (the agent dumps the stacks of those that do not answer)
                    if head.kind == protocol.Stacks.kind:
                        worker.stacks_answered = int(head.header.get("request", 0))
                    self.launcher.take(head, worker.conn)
                if final:
                    worker.outcome = protocol.KINDS[head.kind]
                    worker.stays = bool(head.header.get("stays"))
                    worker.delivered = True
                    if worker.wake is not None:
                        worker.wake()
        except (OSError, EOFError, ValueError):
            pass

    def _relay_error(self, worker: WorkerLink, head: FrameHead) -> None:
        """Writes a worker's whole traceback into its log file, and forwards its error.

        The error's header holds the traceback clipped (`protocol.clip`); its last buffer
        holds it whole (see `slurmrun.node.worker`). The file then shows why the rank failed,
        even for a rank that printed nothing; the launcher's note names that file.
        """
        frame = worker.conn.recv_payload(head)
        if worker.log is not None and frame.header.get("full_traceback") and frame.buffers:
            text = bytes(frame.buffers[-1]).decode(errors="replace").rstrip("\n")
            worker.log.write("stderr", logging.ERROR, "", text)
        buffers = [memoryview(b) for b in frame.buffers]
        self.before_error()
        self.launcher.send(frame.header, memoryview(frame.body), buffers)

    def _logged(self, worker: WorkerLink, frame: Frame) -> None:
        """Writes a worker's logging record to its file; sends it on if the launcher shows it."""
        header = frame.header
        if worker.log is not None:
            level = header.get("level", logging.INFO)
            worker.log.write(
                "logging",
                level if isinstance(level, int) else logging.INFO,
                str(header.get("name", "")),
                log_text(frame.body),
            )
        if worker.forward:
            self._send_log(header, memoryview(frame.body))

    def _send_log(self, header: dict[str, Any], body: bytes | bytearray | memoryview) -> None:
        # A failed send cut the connection (`LauncherConnection`), saying why in the agent's
        # log: the launcher sees it end and fails the run; nothing waits on this message.
        # A closed window (`WindowClosed`) is that connection's end too.
        with contextlib.suppress(OSError):
            self.window.acquire(protocol.log_cost(len(body)), int(header.get("run", 0)))
            self.launcher.send(header, body)

    def _grant_stream(self, worker: WorkerLink) -> None:
        """Hands the worker a connection of its own to the launcher, for one large result.

        Workers' results then travel in parallel and straight from their memory to the
        launcher's, with no copy through this process. The connection is opened and
        authenticated here, so the secret never reaches a worker; the worker announces the
        result through us afterwards, behind the output it printed before.
        """
        try:
            sock = self.connect()
        except OSError:
            worker.streams.sendall(STREAM_REFUSED)  # it sends the result through us instead
            return
        with sock:
            socket.send_fds(worker.streams, [STREAM_GRANTED], [sock.fileno()])

    def join_relay(self, worker: WorkerLink, limit: float) -> None:
        """Waits for the thread forwarding the worker's frames to end (the worker exited).

        It gives up after `limit` seconds, counted again while that thread waits for the
        launcher's window (the launcher is alive and takes the output as its terminal does).
        """
        thread = worker.relay
        deadline = time.monotonic() + limit
        while thread is not None and thread.is_alive():
            thread.join(timeout=0.05)
            now = time.monotonic()
            if self.window.waiting:
                deadline = now + limit
            elif now >= deadline:
                return

    def drain_output(
        self, worker: WorkerLink, limit: float = OUTPUT_DRAIN_LIMIT, *, hold: bool = True
    ) -> None:
        """Waits until everything the worker wrote before now has been forwarded.

        The worker flushes stdout and stderr before it sends a result or an error, so once
        what its output sockets held now is read (and, read, sent), nothing it printed before
        is left behind; what a process it started writes later is not waited for. The wait
        gives up after `limit` seconds without progress, except (with `hold`) while the
        launcher's window holds the output back: the launcher then shows it as fast as its
        terminal takes it, and a result or an error comes after the lines printed before it.
        """
        with worker.output_lock:
            target = worker.output_read + _unread(worker.outputs)
        last, deadline = worker.output_read, time.monotonic() + limit
        while True:
            with worker.output_lock:
                if all(s.fileno() < 0 for s in worker.outputs):
                    return
                if worker.output_read >= target and not _at_end(worker.outputs):
                    return  # (a stream at its end is closed by its reader: its last line ends)
                read = worker.output_read
            now = time.monotonic()
            if read != last or (hold and self.window.waiting):
                last, deadline = read, now + limit
            elif now >= deadline:
                return
            time.sleep(0.001)

    def _forward_output(self, worker: WorkerLink, sock: socket.socket, stream: str) -> None:
        """Turns a worker's fd-level output into its file's lines and pieces for the launcher.

        Only what is new of a line travels (see `slurmrun.output`); the agent keeps the
        current line whole for the file and for a failure's last lines.
        """
        line = LineJoiner(progress=False)
        # The finished lines of one read travel as one LOG message (joined by "\n", which no
        # piece holds): a message per line would cost both sides more than the line itself.
        batch: list[str] = []

        def send(piece: str, end: str) -> None:
            header, body = log_frame(
                stream, piece, end=end, local_rank=worker.local_rank, run=worker.run
            )
            self._send_log(header, body)

        def flush() -> None:
            if batch:
                send("\n".join(batch), LINE)
                batch.clear()

        def emit(piece: str, end: str) -> None:
            finished = line.add(piece, end)
            if finished is not None:
                text, ended = finished
                if ended != PROGRESS:  # a failure's message quotes lines, not a bar's states
                    worker.last_lines.append(_tail_line(text))
                if worker.log is not None:
                    worker.log.write(stream, logging.INFO, "", text, ended)
            if not worker.forward:
                return
            if end == LINE:
                batch.append(piece)
            else:
                flush()
                send(piece, end)

        def emit_lines(texts: list[str]) -> None:  # whole lines of one read, none begun before
            worker.last_lines.extend(_tail_line(text) for text in texts[-TAIL_LINES:])
            if worker.log is not None:
                worker.log.write_lines(texts)
            if worker.forward:
                batch.extend(texts)

        def on_cut() -> None:
            note_cut(f"local rank {worker.local_rank}'s {stream}")

        lines = LineAssembler(emit, on_cut=on_cut, emit_lines=emit_lines)
        try:
            while True:
                if not wait_readable([sock.fileno()], 3600.0):
                    continue
                with worker.output_lock:  # a read and its forwarding are one step
                    data = _read(sock)
                    if not data:
                        break
                    _took(worker, data)
                    lines.feed(data)
                    flush()
        except (OSError, ValueError):
            pass
        with worker.output_lock:  # the last partial line, then "nothing left" for the drain
            lines.close()
            flush()
            sock.close()


def begin_item(worker: WorkerLink, path: str) -> None:
    """From now on `worker`'s output also goes, byte for byte, to the new file `path`.

    A map's item (`slurmrun.node.slot_workers`): its file ends with `end_item` once its
    value or exception passed (what it printed before is read by then). A file that cannot
    be made is left out: the worker's own log file has the output all the same.
    """
    file = None
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        file = open(path, "wb", buffering=0)  # noqa: SIM115 - closed by end_item
    with worker.output_lock:
        old, worker.item_file = worker.item_file, file
    if old is not None:
        old.close()


def end_item(worker: WorkerLink) -> None:
    """Closes `worker`'s item file, if one is open (`begin_item`)."""
    with worker.output_lock:
        file, worker.item_file = worker.item_file, None
    if file is not None:
        file.close()


def _took(worker: WorkerLink, data: bytes) -> None:
    """Counts `data`, read of the worker's output, and writes it to its item's file if any.

    Under ``output_lock``; a failed write ends the item's file.
    """
    worker.output_read += len(data)
    file = worker.item_file
    if file is None:
        return
    try:
        file.write(data)
    except OSError:
        with contextlib.suppress(OSError):
            file.close()
        worker.item_file = None


def _read(sock: socket.socket) -> bytes:
    """What the worker wrote, up to `READ_SIZE` bytes; empty at the end of its stream.

    A fast printer writes a buffer at a time (8 KiB: Python's for a pipe); what comes within
    `READ_LINGER` of a full one is read with it, so that a message carries many of them (each
    costs both sides a message's work, whatever it holds). A line that ends a pause goes at once.
    """
    data = sock.recv(READ_SIZE)
    while len(data) >= _FULL and wait_readable([sock.fileno()], READ_LINGER):
        more = sock.recv(READ_SIZE - len(data))
        if not more:
            break  # the end of the stream: the next read says so
        data += more
        if len(data) >= READ_SIZE:
            break
    return data


def _at_end(socks: list[socket.socket]) -> bool:
    """Whether one of `socks` is at the end of its stream (readable, with nothing to read)."""
    return any(s.fileno() >= 0 and _readable(s) and _unread([s]) == 0 for s in socks)


def _readable(sock: socket.socket) -> bool:
    try:
        return wait_readable([sock.fileno()], 0)
    except (OSError, ValueError):
        return False


def _unread(socks: list[socket.socket]) -> int:
    """The bytes waiting in `socks` (closed ones hold none)."""
    total = 0
    count = array.array("i", [0])
    for sock in socks:
        if sock.fileno() >= 0:
            with contextlib.suppress(OSError):
                fcntl.ioctl(sock.fileno(), termios.FIONREAD, count, True)
                total += count[0]
    return total


def _tail_line(text: str) -> str:
    """A line as a failure's message quotes it: printable, and cut to `TAIL_LINE_CHARS`."""
    if len(text) > TAIL_LINE_CHARS:
        text = f"{text[:TAIL_LINE_CHARS]}... ({len(text) - TAIL_LINE_CHARS} more characters)"
    return printable(text)
