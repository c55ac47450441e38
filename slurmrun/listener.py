"""The launcher's network threads: they move bytes and take no decision.

An accept thread authenticates connections; one reader thread per connection turns frames
into events on one queue (``("frame", conn, frame)``, then ``("eof", conn, why)``) and notes
when each connection last delivered a frame; a heartbeat thread tells agents that the launcher
is alive. `slurmrun.pool.AgentPool` and the run on it (`slurmrun.session.Session`) make every
decision from the queue.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from typing import Any

from slurmrun import protocol
from slurmrun.protocol import HEARTBEATS_PER_TIMEOUT
from slurmrun.transport import (
    AuthenticationError,
    Connection,
    FrameError,
    bound_unacknowledged_sends,
    server_handshake,
)

__all__ = ["LISTEN_BACKLOG", "Listener"]

log = logging.getLogger("slurmrun")

HANDSHAKE_TIMEOUT = 10.0
# Connections the kernel queues before accept (capped by net.core.somaxconn): a big job's
# agents all connect within a second or two, and agents retry what still meets a full queue.
LISTEN_BACKLOG = 8192
# Handshakes in progress at once; more connections wait in the listen backlog (never dropped,
# so that a thousand agents connecting at once all get in).
MAX_PENDING_HANDSHAKES = 256


class Listener:
    """Accepts and reads the connections of a pool of agents, and sends heartbeats to agents.

    Args:
        server: the listening socket (closed by `close`).
        secret: the launch secret that every connection must prove.
        silence: the agents' heartbeat timeout: a connection whose sent data stays
            unacknowledged that long is dropped, and agents get `HEARTBEATS_PER_TIMEOUT`
            heartbeats per period.
    """

    def __init__(self, server: socket.socket, secret: bytes, silence: float) -> None:
        self.server = server
        self.secret = secret
        self.silence = silence
        self.events: queue.Queue[tuple[str, Any, Any]] = queue.Queue()
        self.closing = threading.Event()
        self._handshakes = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        # When each connection's reader last got a frame: liveness is judged by what arrived,
        # not by what the (possibly backlogged) event queue got round to.
        self._heard: dict[int, float] = {}
        self._agents: list[Connection] = []
        self._threads = [
            threading.Thread(target=self._accept_loop, daemon=True),
            threading.Thread(target=self._heartbeat, daemon=True),
        ]

    def start(self) -> None:
        """Starts accepting connections and sending heartbeats."""
        for thread in self._threads:
            thread.start()

    def heard_at(self, conn: Connection) -> float:
        """When `conn` last delivered a whole frame (monotonic clock)."""
        return self._heard[id(conn)]

    def add_agent(self, conn: Connection) -> None:
        """Sends heartbeats to `conn` from now on."""
        self._agents.append(conn)

    def close(self) -> None:
        """Stops accepting (at once) and sending heartbeats."""
        self.closing.set()
        with contextlib.suppress(OSError):
            self.server.shutdown(socket.SHUT_RDWR)  # wakes the accept thread at once

    def join(self) -> None:
        """Waits (briefly) for the accept and heartbeat threads, and closes the server."""
        for thread in self._threads:
            thread.join(timeout=2.0)
        with contextlib.suppress(OSError):
            self.server.close()

    def _accept_loop(self) -> None:
        self.server.settimeout(0.2)
        while not self.closing.is_set():
            try:
                sock, peer = self.server.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            while not self._handshakes.acquire(timeout=0.2):
                if self.closing.is_set():
                    sock.close()
                    return
            threading.Thread(target=self._serve, args=(sock, peer), daemon=True).start()

    def _serve(self, sock: socket.socket, peer: Any) -> None:
        try:
            server_handshake(sock, self.secret, HANDSHAKE_TIMEOUT)
        except AuthenticationError as e:
            log.warning("slurmrun: rejected a connection from %s: %s", peer, e)
            sock.close()
            return
        finally:
            self._handshakes.release()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        bound_unacknowledged_sends(sock, self.silence)
        conn = Connection(sock)
        try:
            while True:
                frame = conn.recv()
                if frame is None:
                    break
                self._heard[id(conn)] = time.monotonic()
                self.events.put(("frame", conn, frame))
        except (OSError, EOFError, FrameError) as e:
            self.events.put(("eof", conn, str(e)))
            return
        self.events.put(("eof", conn, ""))

    def _heartbeat(self) -> None:
        """Tells every agent that the launcher is alive (agents stop their workers otherwise).

        A heartbeat never waits: a connection busy sending (the function, to a slow agent)
        already shows the agent that the launcher is alive.
        """
        while not self.closing.wait(self.silence / HEARTBEATS_PER_TIMEOUT):
            for conn in list(self._agents):
                with contextlib.suppress(OSError):
                    conn.send_nowait({"t": protocol.HEARTBEAT})
