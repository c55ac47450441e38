"""A reservation keeper's connections: how it takes them, and the workers' own streams.

A worker sends a large result on a connection of its own (a stream) rather than through its
agent. In a reservation, that connection reaches the keeper (the agents' launcher), which
tells the attached launcher (BRIDGE, with a channel) and carries the stream's one frame to the
launcher's JOIN connection for that channel (`slurmrun.batch.keeper`).
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from slurmrun import protocol
from slurmrun.authentication import AuthenticationError, server_handshake
from slurmrun.batch.keeper_links import Session
from slurmrun.transport import Connection, FrameHead

__all__ = ["HANDSHAKE_TIMEOUT", "TICK", "Stream", "Streams", "accept_each", "set_timeouts"]

HANDSHAKE_TIMEOUT = 5.0  # a launcher's handshake and first frame
TICK = 0.5  # how often the keeper looks at the clock (idle time, silent agents)


def set_timeouts(sock: socket.socket, seconds: float) -> None:
    """Receives on `sock` fail after `seconds` without data (a peer gone without a word)."""
    sock.settimeout(None)
    whole, fraction = divmod(seconds, 1.0)
    value = int(whole).to_bytes(8, sys.byteorder) + int(fraction * 1e6).to_bytes(8, sys.byteorder)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)


def accept_each(
    server: socket.socket, take: Callable[[socket.socket], None], done: threading.Event
) -> None:
    """Hands each connection on `server` to `take` on a thread, until `done` is set."""
    server.settimeout(TICK)
    while not done.is_set():
        try:
            sock, _ = server.accept()
        except TimeoutError:
            continue
        threading.Thread(target=take, args=(sock,), daemon=True).start()


@dataclass
class Stream:
    """A worker's stream (a large result) that waits for the launcher's JOIN."""

    conn: Connection
    head: FrameHead  # its one frame's header, the run id the launcher's
    session: Session
    joined: threading.Event = field(default_factory=threading.Event)


@dataclass
class Streams:
    """The workers' streams, each carried to the JOIN of the launcher attached when it came.

    Attributes:
        secret: what the workers prove (the agents' secret).
        silence: a stream silent this long is gone.
        attached: the session of the launcher attached now (None: none).
        done: set when the reservation ends.
    """

    secret: bytes
    silence: float
    attached: Callable[[], Session | None]
    done: threading.Event
    waiting: dict[int, Stream] = field(default_factory=dict)  # by channel, until joined
    channels: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, sock: socket.socket) -> None:
        """One stream: proven, its frame's header read, then handed to the launcher's JOIN."""
        try:
            server_handshake(sock, self.secret, HANDSHAKE_TIMEOUT)
            set_timeouts(sock, self.silence)
            conn = Connection(sock)
            head = conn.recv_head()
        except (AuthenticationError, OSError, EOFError):
            sock.close()
            return
        if head is None:
            conn.close()
            return
        run = head.header.get("run", 0)
        session = self.attached()
        stream = None
        if session is not None and run > session.offset:
            head.header["run"] = run - session.offset
            with self.lock:
                self.channels += 1
                channel = self.channels
                stream = self.waiting[channel] = Stream(conn, head, session)
        if stream is None:
            conn.close()  # no launcher's: the worker's send fails, its run is no one's
            return
        with contextlib.suppress(OSError):
            stream.session.control.send(protocol.Bridge(channel=channel).header())
        if not stream.joined.wait(HANDSHAKE_TIMEOUT):
            with self.lock:
                self.waiting.pop(channel, None)
            conn.close()

    def join(self, conn: Connection, join: protocol.Join) -> None:
        """The launcher's JOIN for a stream's channel: the stream's frame goes on `conn`."""
        with self.lock:
            stream = self.waiting.pop(join.stream, None)
        if stream is None or stream.session.id != join.session:
            conn.close()
            return
        stream.joined.set()
        with contextlib.suppress(OSError, EOFError):
            stream.conn.forward(stream.head, conn)
        stream.conn.close()
        conn.close()
