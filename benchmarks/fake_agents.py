"""Fake agents for `scale.py`: thousands per process, each a state machine in one event loop.

A fake agent speaks the real protocol with the product's own pieces: it connects with the
real agent's retry schedule (`slurmrun.node.agent_connect.Backoff`), answers the HMAC challenge
(`slurmrun.authentication.ClientChallenge`), and sends frames that `slurmrun.transport` encodes.
After ``hello`` it waits for ``start``, then sends one ``result`` per worker (a pickled int), a
heartbeat and ``done``; on ``end`` it answers ``idle``; on ``close`` it hangs up. With logs it
treats its workers' lines as a real agent does (`slurmrun.logs.WorkerLog` files, and only the
ranks that START forwards go to the launcher).

On a cluster every agent has a machine of its own; here thousands share the launcher's cores.
A thread per fake agent (as before) spent most of the machine's CPU switching threads, so the
benchmark measured its fake agents more than the launcher: one loop per process costs a few
hundred microseconds of CPU per agent, which leaves the cores to the launcher.
"""

from __future__ import annotations

import dataclasses
import errno
import heapq
import itertools
import logging
import multiprocessing.connection
import selectors
import socket
import time
from collections.abc import Callable
from typing import Any

from slurmrun import protocol
from slurmrun.authentication import AuthenticationError, ClientChallenge, HandshakeBrokeOff
from slurmrun.logs import WorkerLog
from slurmrun.node.agent_connect import Backoff
from slurmrun.output import log_frame
from slurmrun.pickling import dumps
from slurmrun.transport import PREFIX_BYTES, encode_frame, parse_header, parse_lengths, parse_prefix
from slurmrun.versions import protocol_fingerprint, slurmrun_version

CONNECT_TIMEOUT = 120.0  # the fake agents' connect budget (a real agent's default is 60 s)
LOOP_LIMIT = 900.0  # a process of fake agents never runs longer than this


@dataclasses.dataclass(frozen=True)
class FakeSpec:
    """What every fake agent needs to know."""

    port: int
    secret: bytes
    workers: int
    logs: bool
    retry: bool
    chatter: float = 0.0
    agent_files: bool = True  # False: lines the agents would write are counted, not written


@dataclasses.dataclass
class Tally:
    """What one process's fake agents report when they are all done."""

    ended: int = 0
    retried_agents: int = 0
    retries: int = 0
    counted_lines: int = 0
    failures: list[tuple[int, str]] = dataclasses.field(default_factory=list)


class Loop:
    """A selector and a timer heap: just what the fake agents need."""

    def __init__(self) -> None:
        self.selector = selectors.DefaultSelector()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def call_at(self, when: float, fn: Callable[[], None]) -> None:
        """Calls `fn` once the monotonic clock reaches `when`."""
        heapq.heappush(self._timers, (when, next(self._seq), fn))

    def run_once(self, longest: float) -> None:
        """Waits at most `longest` seconds for sockets or timers, and serves what is due."""
        now = time.monotonic()
        wait = longest if not self._timers else max(0.0, min(longest, self._timers[0][0] - now))
        for key, mask in self.selector.select(wait):
            key.data(mask)
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            heapq.heappop(self._timers)[2]()


class FakeAgent:
    """One agent: connect, handshake, hello; START -> output and results; END -> idle."""

    def __init__(self, loop: Loop, node_rank: int, spec: FakeSpec, tally: Tally) -> None:
        self.loop = loop
        self.node_rank = node_rank
        self.spec = spec
        self.tally = tally
        self.hostname = f"node{node_rank}"
        self._backoff = Backoff(CONNECT_TIMEOUT if spec.retry else 0.0)
        self._sock: socket.socket | None = None
        self._state = "connecting"  # -> greeting -> proof -> frames -> ended
        self._challenge = ClientChallenge(spec.secret)
        self._in = bytearray()
        self._out = bytearray()
        self._mask = 0
        self._files: dict[int, WorkerLog] = {}
        self._count = False
        self._forward: list[int] | None = None
        self._offset = 0
        self._run = 0

    # ------------------------------------------------------------------ connecting
    def connect(self) -> None:
        """Starts one connect; a refused or failed one is retried on the real schedule."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        self._sock = sock
        err = sock.connect_ex(("127.0.0.1", self.spec.port))
        if err not in (0, errno.EINPROGRESS):
            self._retry(OSError(err, errno.errorcode.get(err, str(err))))
            return
        self._watch(selectors.EVENT_WRITE)

    def _retry(self, error: OSError) -> None:
        # A new connection starts a new handshake: nothing of the broken one may carry over
        # (a stale state would take the next server's greeting for its proof).
        self._drop_socket()
        self._state = "connecting"
        self._in.clear()
        self._out.clear()
        try:
            wait = self._backoff.failed(error)
        except ConnectionError as e:
            self._fail(f"{type(e).__name__}: {e}")
            return
        self.loop.call_at(time.monotonic() + wait, self.connect)

    def _on_event(self, mask: int) -> None:
        try:
            if self._state == "connecting":
                self._on_connected()
                return
            if mask & selectors.EVENT_WRITE:
                self._flush()
            if mask & selectors.EVENT_READ:
                self._on_readable()
        except (OSError, AuthenticationError, EOFError) as e:
            final = isinstance(e, AuthenticationError) and not isinstance(e, HandshakeBrokeOff)
            if self._state in ("greeting", "proof") and not final:
                self._retry(OSError(f"handshake broke off: {type(e).__name__}: {e}"))
            elif self._state in ("greeting", "proof"):
                self._fail(f"handshake failed: {type(e).__name__}: {e}")
            else:
                self._end()

    def _on_connected(self) -> None:
        assert self._sock is not None
        err = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            self._retry(OSError(err, errno.errorcode.get(err, str(err))))
            return
        if self._backoff.tries:
            self.tally.retried_agents += 1
            self.tally.retries += self._backoff.tries
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._state = "greeting"
        self._watch(selectors.EVENT_READ)

    # ------------------------------------------------------------------ reading
    def _on_readable(self) -> None:
        assert self._sock is not None
        try:
            data = self._sock.recv(1 << 16)
        except BlockingIOError:
            return
        if not data:
            raise EOFError("the launcher closed the connection")
        self._in += data
        if self._state == "greeting" and len(self._in) >= ClientChallenge.GREETING_BYTES:
            greeting = self._take(ClientChallenge.GREETING_BYTES)
            self._send_raw(self._challenge.reply(greeting))
            self._state = "proof"
        if self._state == "proof" and len(self._in) >= ClientChallenge.PROOF_BYTES:
            self._challenge.check(self._take(ClientChallenge.PROOF_BYTES))
            self._state = "frames"
            hello = protocol.Hello(
                hostname=self.hostname,
                node_rank=self.node_rank,
                addr="127.0.0.1",
                auto_workers=self.spec.workers,
                master_port=1234,
                pid=0,
                version=slurmrun_version(),  # the launcher refuses another slurmrun's agents
                protocol=protocol_fingerprint(),
            )
            self._send(hello.header())
        while self._state == "frames":
            header = self._next_frame()
            if header is None:
                break
            self._on_frame(header)

    def _take(self, n: int) -> bytes:
        data = bytes(self._in[:n])
        del self._in[:n]
        return data

    def _next_frame(self) -> dict[str, Any] | None:
        """Cuts one whole frame off the input (its header; the payload is not needed)."""
        if len(self._in) < PREFIX_BYTES:
            return None
        header_len, body_len, nbuf = parse_prefix(self._in[:PREFIX_BYTES])
        lens_end = PREFIX_BYTES + 8 * nbuf
        if len(self._in) < lens_end + header_len:
            return None
        lens = parse_lengths(self._in[PREFIX_BYTES:lens_end], body_len)
        end = lens_end + header_len + body_len + sum(lens)
        if len(self._in) < end:
            return None
        header = parse_header(self._in[lens_end : lens_end + header_len])
        del self._in[:end]
        return header

    def _on_frame(self, header: dict[str, Any]) -> None:
        kind = header.get("t")  # read raw, as fast as an agent could
        if kind == protocol.Start.kind:
            self._on_start(header)
        elif kind == protocol.End.kind:
            self._send(protocol.Idle(run=int(header["run"]), master_port=1234).header())
        elif kind == protocol.Close.kind:
            self._end()

    # ------------------------------------------------------------------ the run
    def _on_start(self, start: dict[str, Any]) -> None:
        self._offset = int(start["rank_offset"])
        self._run = int(start.get("run", 0))
        log_dir = start.get("log_dir")
        if log_dir and self.spec.agent_files:
            self._files = {
                r: WorkerLog(log_dir, self.hostname, r, logging.INFO)
                for r in range(self.spec.workers)
            }
        self._count = bool(log_dir) and not self.spec.agent_files
        self._forward = start.get("forward_ranks")
        if self.spec.chatter:
            self._chatter_tick(0, time.monotonic())
        else:
            self._finish_run()

    def _line(self, local_rank: int, msg: str, end: str = "\n") -> None:
        """One line of a worker's output, where the real agent's rule sends it."""
        if local_rank in self._files:
            self._files[local_rank].write("stdout", logging.INFO, "", msg, end)
        elif self._count and end == "\n":
            self.tally.counted_lines += 1
        if self._forward is None or local_rank in self._forward:
            self._send(*log_frame("stdout", msg, end=end, local_rank=local_rank, run=self._run))

    def _chatter_tick(self, tick: int, start: float) -> None:
        """Rank 0: a progress bar state every 10 ms; every other worker: a line a second."""
        if self._state == "ended":
            return
        ticks = int(self.spec.chatter * 100)
        if tick >= ticks:
            if self._offset == 0:
                self._line(0, f"{ticks}/{ticks} [bar] done")
            self._finish_run()
            return
        if self._offset == 0:
            self._line(0, f"{tick + 1}/{ticks} [bar]", "\r")
        if tick % 100 == 0:
            for local_rank in range(1 if self._offset == 0 else 0, self.spec.workers):
                self._line(local_rank, f"worker {self._offset + local_rank} second {tick // 100}")
            self._send(protocol.Heartbeat().header())
        step = 1 if self._offset == 0 else 100  # only rank 0's agent wakes 100 times a second
        nxt = tick + step
        self.loop.call_at(start + nxt / 100, lambda: self._chatter_tick(nxt, start))

    def _finish_run(self) -> None:
        for local_rank in range(self.spec.workers):
            if self.spec.logs:
                self._line(local_rank, f"worker {self._offset + local_rank} ready")
            body, buffers = dumps(self._offset + local_rank)
            assert not buffers
            self._send(protocol.Result(local_rank=local_rank, run=self._run).header(), body)
        for f in self._files.values():
            f.close()
        self._send(protocol.Heartbeat().header())
        self._send(protocol.Done(run=self._run).header())

    # ------------------------------------------------------------------ sending
    def _send(self, header: dict[str, Any], body: bytes = b"") -> None:
        self._send_raw(encode_frame(header, body))

    def _send_raw(self, data: bytes) -> None:
        if self._sock is None:
            return  # ended meanwhile
        self._out += data
        self._flush()

    def _flush(self) -> None:
        assert self._sock is not None
        while self._out:
            try:
                sent = self._sock.send(self._out)
            except BlockingIOError:
                break
            del self._out[:sent]
        self._watch(selectors.EVENT_READ | (selectors.EVENT_WRITE if self._out else 0))

    # ------------------------------------------------------------------ the end
    def _watch(self, mask: int) -> None:
        assert self._sock is not None
        if mask == self._mask:
            return
        if self._mask:
            self.loop.selector.modify(self._sock, mask, self._on_event)
        else:
            self.loop.selector.register(self._sock, mask, self._on_event)
        self._mask = mask

    def _drop_socket(self) -> None:
        if self._sock is not None:
            if self._mask:
                self.loop.selector.unregister(self._sock)
            self._sock.close()
        self._sock, self._mask = None, 0

    def _fail(self, why: str) -> None:
        self.tally.failures.append((self.node_rank, why))
        self._end()

    def _end(self) -> None:
        if self._state == "ended":
            return
        self._state = "ended"
        for f in self._files.values():
            f.close()
        self._drop_socket()
        self.tally.ended += 1


def fake_agents_main(
    pipe: multiprocessing.connection.Connection, ranks: list[int], spec: FakeSpec
) -> None:
    """Runs the fake agents `ranks` from "go" until each has ended; reports over `pipe`.

    Messages: ``("ready",)``; ``("fail", rank, why)`` as failures happen; at the end
    ``("finished", agents that retried, retries, lines counted)``. It also ends when the
    launcher side closes `pipe`, and after `LOOP_LIMIT` seconds whatever happens.
    """
    loop = Loop()
    tally = Tally()
    agents = [FakeAgent(loop, rank, spec, tally) for rank in ranks]
    pipe.send(("ready",))
    pipe.recv()  # "go"
    gone = False

    def parent_gone(mask: int) -> None:
        nonlocal gone
        gone = True

    loop.selector.register(pipe.fileno(), selectors.EVENT_READ, parent_gone)
    for agent in agents:
        agent.connect()
    reported = 0
    deadline = time.monotonic() + LOOP_LIMIT
    while tally.ended < len(agents) and not gone and time.monotonic() < deadline:
        loop.run_once(0.05)
        for rank, why in tally.failures[reported:]:
            pipe.send(("fail", rank, why))
        reported = len(tally.failures)
    if not gone:
        pipe.send(("finished", tally.retried_agents, tally.retries, tally.counted_lines))
