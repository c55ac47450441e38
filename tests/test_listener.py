"""The launcher's one reader thread (slurmrun/launcher/listener.py), with real sockets: handshakes
that never finish neither block the others nor stay, a connection closed by its owner leaves no
trace, and large frames from many connections arrive together."""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time

import pytest

from slurmrun.authentication import client_handshake, new_secret
from slurmrun.launcher import listener as listener_module
from slurmrun.launcher.listener import Listener
from slurmrun.launcher.pump import Received
from slurmrun.pickling import dumps, loads
from slurmrun.transport import Connection


@pytest.fixture
def running():
    """A started Listener on a loopback port: (listener, port, secret)."""
    secret = new_secret()
    server = socket.create_server(("127.0.0.1", 0), backlog=64)
    lis = Listener(server, secret, silence=30.0)
    lis.start()
    yield lis, server.getsockname()[1], secret
    lis.close()
    lis.join()


def _client(port: int, secret: bytes) -> Connection:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    client_handshake(sock, secret, 30)
    return Connection(sock)


def _next(lis: Listener, timeout: float = 30.0) -> tuple[str, Connection, object]:
    """The next event as (kind, connection, frame or why)."""
    event = lis.events.get(timeout=timeout)
    if isinstance(event, Received):
        return "frame", event.conn, event.frame
    return "eof", event.conn, event.why


def test_silent_peers_beyond_the_handshake_limit_time_out_and_agents_still_get_in(
    monkeypatch, caplog
) -> None:
    monkeypatch.setattr(listener_module, "MAX_PENDING_HANDSHAKES", 4)
    monkeypatch.setattr(listener_module, "HANDSHAKE_TIMEOUT", 1.0)
    secret = new_secret()
    server = socket.create_server(("127.0.0.1", 0), backlog=64)
    lis = Listener(server, secret, silence=30.0)
    lis.start()
    port = server.getsockname()[1]
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(10)]
    try:
        with caplog.at_level(logging.WARNING, logger="slurmrun"):
            start = time.monotonic()
            client = _client(port, secret)  # waits in the backlog behind the silent ones
            client.send({"t": "hello"})
            kind, _conn, frame = _next(lis)
            took = time.monotonic() - start
        assert kind == "frame" and getattr(frame, "kind", None) == "hello"
        # 10 silent peers, 4 handshakes at a time, 1 s each: the agent gets in after 3 rounds
        assert took < 8.0, took
        # Reported in a bounded number of lines (the 1st, 10th, 100th...), with the count
        said = [r.getMessage() for r in caplog.records]
        assert any("1 connection(s)" in m for m in said), said
        assert len(said) <= 6, said
        client.close()
        assert _next(lis)[0] == "eof"
    finally:
        for s in silent:
            s.close()
        lis.close()
        lis.join()


def test_a_connection_closed_by_its_owner_while_registered_does_not_confuse_the_next(
    running,
) -> None:
    lis, port, secret = running
    first = _client(port, secret)
    first.send({"t": "hello", "n": 1})
    kind, conn1, _ = _next(lis)
    assert kind == "frame"
    conn1.sock.close()  # the owner closes it without shutdown: the selector still has it
    # The next connections may get the same descriptor number: each must be read normally.
    for n in range(2, 6):
        client = _client(port, secret)
        client.send({"t": "hello", "n": n})
        while True:
            kind, conn, data = _next(lis)
            if kind == "frame":
                break
            assert conn is conn1 or conn.sock.fileno() == -1, (kind, data)  # old ones end
        assert data.header["n"] == n  # type: ignore[attr-defined]
        client.close()
        conn.sock.close()
    first.close()


def test_large_frames_from_many_connections_arrive_whole(running) -> None:
    lis, port, secret = running
    blobs = {i: os.urandom(3 << 20) for i in range(6)}

    def send(i: int) -> None:
        client = _client(port, secret)
        body, buffers = dumps(blobs[i])
        client.send({"t": "result", "i": i}, body, buffers)
        client.close()

    senders = [threading.Thread(target=send, args=(i,)) for i in blobs]
    for t in senders:
        t.start()
    got: dict[int, bytes] = {}
    eofs = 0
    while len(got) < len(blobs) or eofs < len(blobs):
        try:
            kind, conn, data = _next(lis)
        except queue.Empty:
            pytest.fail(f"got {sorted(got)} and {eofs} ends")
        if kind == "frame":
            got[data.header["i"]] = loads(data.body, data.buffers)  # type: ignore[attr-defined]
        else:
            eofs += 1
            conn.close()
    for t in senders:
        t.join()
    assert got == blobs
