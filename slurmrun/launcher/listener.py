"""The launcher's network threads: they move bytes and take no decision.

One reader thread accepts, authenticates and reads every connection through one selector
(epoll on Linux): a connection is a `slurmrun.launcher.incoming.Incoming`, fed what arrives without
ever blocking the others. It turns frames into typed events on one queue
(`slurmrun.launcher.pump.Received`, then `slurmrun.launcher.pump.Closed`) and notes when each
connection last delivered a frame.
A large payload is received by a short-lived thread of its own, so big results still arrive
in parallel. A heartbeat thread tells agents that the launcher is alive.
`slurmrun.launcher.pool.AgentPool` and the run on it (`slurmrun.launcher.run.Run`) make
every decision from the queue.

Bounds, against peers that are not ours and against a launcher idle for hours: a handshake
has `HANDSHAKE_TIMEOUT` (one round trip; agents retry one that broke off), and a handshake
still pending after a moment is pushed out by a newer connection from its address (beyond
`MAX_PENDING_PER_SOURCE`) or from anywhere (all slots taken): `slurmrun.launcher.handshakes`.
A flood of silent connections never holds the door for our agents. Heartbeats only
note liveness and are never queued. The queue drops nothing: what agents may queue of their
workers' output is bounded by their windows (`slurmrun.launcher.output_stage`), and every
other message of theirs by the run it belongs to.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import selectors
import socket
import threading
import time

from slurmrun import protocol
from slurmrun.authentication import AuthenticationError, HandshakeBrokeOff
from slurmrun.launcher.handshakes import Handshakes
from slurmrun.launcher.incoming import Incoming
from slurmrun.launcher.pump import Closed, Events, Received
from slurmrun.protocol import HEARTBEATS_PER_TIMEOUT
from slurmrun.transport import Connection, Frame, FrameError

__all__ = ["LISTEN_BACKLOG", "Listener"]

log = logging.getLogger("slurmrun")

# The handshake is one round trip for a peer that is there: agents answer within
# milliseconds, and retry one that was cut short.
HANDSHAKE_TIMEOUT = 2.0
# Connections the kernel queues before accept (capped by net.core.somaxconn): a big job's
# agents all connect within a second or two, and agents retry what still meets a full queue.
LISTEN_BACKLOG = 8192
# Handshakes in progress at once; more connections wait in the listen backlog (never dropped,
# so that thousands of agents connecting at once all get in).
MAX_PENDING_HANDSHAKES = 1024
# Handshakes pending from one address: beyond it, a new connection drops the oldest. Local
# agents all come from 127.0.0.1 (and each worker's large result on a connection of its
# own), but a real one answers at once: only a silent one stays pending long.
MAX_PENDING_PER_SOURCE = 32
_SWEEP = 0.2  # how often handshakes are checked against their deadline
_SERVER = "server"
_WAKE = "wake"


class Listener:
    """Accepts and reads the connections of a pool of agents, and sends heartbeats to agents.

    Args:
        server: the listening socket (closed by `join`).
        secret: the launch secret that every connection must prove.
        silence: the agents' heartbeat timeout: a connection whose sent data stays
            unacknowledged that long is dropped, and agents get `HEARTBEATS_PER_TIMEOUT`
            heartbeats per period.
    """

    def __init__(self, server: socket.socket, secret: bytes, silence: float) -> None:
        self.server = server
        self.secret = secret
        self.silence = silence
        # SimpleQueue: 4096 agents put ~50,000 frames through it in a launch.
        self.events: Events = queue.SimpleQueue()
        self.closing = threading.Event()
        # When each connection last delivered a frame: liveness is judged by what arrived,
        # not by what the (possibly backlogged) event queue got round to.
        self._heard: dict[int, float] = {}
        self._agents: list[Connection] = []
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        # Work for the reader thread from others: connections back from a handoff, "close".
        self._todo: queue.SimpleQueue[Incoming | str] = queue.SimpleQueue()
        self._pending = Handshakes(MAX_PENDING_HANDSHAKES, MAX_PENDING_PER_SOURCE)
        self._accepting = False
        self._stop = False
        self._threads = [
            threading.Thread(target=self._read_loop, name="slurmrun-listener", daemon=True),
            threading.Thread(
                target=_send_heartbeats,
                args=(self._agents, silence / HEARTBEATS_PER_TIMEOUT, self.closing),
                name="slurmrun-heartbeat",
                daemon=True,
            ),
        ]

    def start(self) -> None:
        """Starts accepting and reading connections, and sending heartbeats."""
        self.server.setblocking(False)
        self._selector.register(self.server, selectors.EVENT_READ, _SERVER)
        self._selector.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._accepting = True
        for thread in self._threads:
            thread.start()

    def heard_at(self, conn: Connection) -> float:
        """When `conn` last delivered a whole frame (monotonic clock)."""
        return self._heard[id(conn)]

    def add_agent(self, conn: Connection) -> None:
        """Sends heartbeats to `conn` from now on."""
        self._agents.append(conn)

    def close(self) -> None:
        """Stops accepting (at once) and sending heartbeats; connections are still read."""
        self.closing.set()
        self._post("close")

    def join(self) -> None:
        """Stops reading, closes what is left and the server, and waits (briefly) for threads."""
        self.closing.set()
        self._stop = True
        self._post("stop")
        for thread in self._threads:
            if thread.ident is not None:
                thread.join(timeout=2.0)
        if self._threads[0].ident is None:  # never started: nothing else closes these
            self._shut_down()
        with contextlib.suppress(OSError):
            self.server.close()

    def _post(self, item: Incoming | str) -> None:
        self._todo.put(item)
        with contextlib.suppress(OSError):  # full: the reader is awake already
            self._wake_w.send(b"x")

    # ------------------------------------------------------------------ the reader thread
    def _read_loop(self) -> None:
        next_sweep = time.monotonic() + _SWEEP
        try:
            while not self._stop:
                for key, _ in self._selector.select(timeout=_SWEEP):
                    if key.data is _SERVER:
                        self._accept()
                    elif key.data is _WAKE:
                        self._take_todo()
                    else:
                        self._on_readable(key.data)
                now = time.monotonic()
                if now >= next_sweep:
                    self._sweep(now)
                    next_sweep = now + _SWEEP
                if not self._accepting and not self.closing.is_set():
                    self._resume_accepting()
        finally:
            self._shut_down()

    def _accept(self) -> None:
        while self._accepting and not self._pending.full(time.monotonic()):
            try:
                sock, peer = self.server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._stop_accepting()
                return
            incoming = Incoming(
                sock, peer, self.secret, self.silence, time.monotonic() + HANDSHAKE_TIMEOUT
            )
            try:
                incoming.greet()
            except OSError as e:  # HandshakeBrokeOff included
                self._reject(incoming, str(e))
                continue
            pushed_out = self._pending.add(incoming, time.monotonic())
            if pushed_out is not None:
                self._forget(pushed_out)
                pushed_out.sock.close()
                self._pending.pushed_out.add(f"from {incoming.source}")
            self._register(incoming)
        if self._accepting:  # a full house: the kernel's backlog holds the rest meanwhile
            self._selector.unregister(self.server)
            self._accepting = False

    def _stop_accepting(self) -> None:
        if self._accepting:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.unregister(self.server)
            self._accepting = False

    def _reject(self, incoming: Incoming, why: str) -> None:
        self._pending.rejected.add(f"{incoming.peer}: {why}")
        self._pending.remove(incoming)
        self._forget(incoming)
        incoming.sock.close()

    def _register(self, incoming: Incoming) -> None:
        """Reads `incoming` from now on.

        Its descriptor may be the number of a connection that was closed by its owner while
        registered (the kernel forgot that one; the selector did not): that one has ended.
        """
        stale = self._selector.get_map().get(incoming.sock.fileno())
        if stale is not None and isinstance(stale.data, Incoming):
            self._ended(stale.data, "closed")
        self._selector.register(incoming.sock, selectors.EVENT_READ, incoming)

    def _forget(self, incoming: Incoming) -> None:
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(incoming.sock)

    def _on_readable(self, incoming: Incoming) -> None:
        was_pending = incoming.conn is None
        try:
            frames, still_open = incoming.read()
        except HandshakeBrokeOff as e:
            self._reject(incoming, f"handshake broke off: {e}")
            return
        except AuthenticationError as e:
            self._reject(incoming, str(e))
            return
        except (OSError, EOFError, FrameError) as e:
            self._ended(incoming, str(e) or type(e).__name__)
            return
        conn = incoming.conn
        if conn is None:
            return  # still in its handshake
        if was_pending:
            self._pending.remove(incoming)
            self._heard[id(conn)] = time.monotonic()
        if frames:
            self._heard[id(conn)] = time.monotonic()
            for frame in frames:
                self._queue(conn, frame)
        if not still_open:
            self._ended(incoming, "")
        elif incoming.handoff:
            self._forget(incoming)
            threading.Thread(
                target=self._receive_rest, args=(incoming,), name="slurmrun-receive", daemon=True
            ).start()

    def _queue(self, conn: Connection, frame: Frame) -> None:
        """Queues a frame for the pool or the run; a heartbeat only counted as heard (above)."""
        if frame.kind == protocol.Heartbeat.kind:  # never parsed: they only say "alive"
            return
        self.events.put(Received(conn, frame))

    def _resume_accepting(self) -> None:
        if not self._pending.full(time.monotonic()) and self.server.fileno() >= 0:
            self._selector.register(self.server, selectors.EVENT_READ, _SERVER)
            self._accepting = True

    def _ended(self, incoming: Incoming, why: str) -> None:
        self._forget(incoming)
        if incoming.conn is None:
            self._reject(incoming, f"handshake broke off: {why}")
            return
        self.events.put(Closed(incoming.conn, why))

    def _receive_rest(self, incoming: Incoming) -> None:
        """A large payload's rest, on a thread of its own; then the reader takes it back."""
        assert incoming.conn is not None  # noqa: S101 - only authenticated ones hand off
        try:
            frame = incoming.receive_rest()
        except (OSError, EOFError) as e:
            self.events.put(Closed(incoming.conn, str(e) or type(e).__name__))
            return
        self._heard[id(incoming.conn)] = time.monotonic()
        self._queue(incoming.conn, frame)
        self._post(incoming)

    def _take_todo(self) -> None:
        with contextlib.suppress(OSError):
            while self._wake_r.recv(4096, socket.MSG_DONTWAIT):
                pass
        while True:
            try:
                item = self._todo.get_nowait()
            except queue.Empty:
                return
            if item == "close":
                self._stop_accepting()
            elif isinstance(item, Incoming) and not self._stop:
                try:
                    self._register(item)
                except (KeyError, ValueError, OSError):
                    # Closed meanwhile (by the pool): nothing more will come from it.
                    assert item.conn is not None  # noqa: S101 - handed back after a frame
                    self.events.put(Closed(item.conn, "closed"))

    def _sweep(self, now: float) -> None:
        """Ends handshakes past their deadline."""
        for incoming in self._pending.expired(now):
            self._reject(incoming, f"handshake timed out ({HANDSHAKE_TIMEOUT:g} s)")

    def _shut_down(self) -> None:
        """Closes what is left: connections nobody took (their owners closed their own)."""
        self._stop_accepting()
        for key in list(self._selector.get_map().values()):
            if isinstance(key.data, Incoming):
                self._forget(key.data)
                key.data.sock.close()
        self._pending.clear()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    # ------------------------------------------------------------------ heartbeats


def _send_heartbeats(agents: list[Connection], interval: float, closing: threading.Event) -> None:
    """Tells every agent that the launcher is alive (agents stop their workers otherwise).

    A heartbeat never waits: a connection busy sending (the function, to a slow agent)
    already shows the agent that the launcher is alive.
    """
    beat = protocol.Heartbeat().header()
    while not closing.wait(interval):
        for conn in list(agents):
            with contextlib.suppress(OSError, ValueError):  # ValueError: closed meanwhile
                conn.send_nowait(beat)
