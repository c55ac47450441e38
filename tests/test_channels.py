"""slurmrun.channels: connections carried over one pair of pipes, as a relay through srun does.

Two `Mux`es face each other over real pipes (the relay's side writing base64 lines, as
through slurmstepd); the relay's side connects each channel to a real TCP server.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator

import pytest

from slurmrun.channels import Mux


@pytest.fixture
def server() -> Iterator[socket.socket]:
    """A TCP server that greets each connection first, then echoes what it gets, upper-cased."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve(conn: socket.socket) -> None:
        with conn:
            conn.sendall(b"hello\n")
            while data := conn.recv(1 << 16):
                conn.sendall(data.upper())

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield listener
    listener.close()


@pytest.fixture
def muxes(server: socket.socket) -> Iterator[tuple[Mux, Mux]]:
    """The launcher's side and the relay's, over two pipes."""
    to_relay, from_launcher = os.pipe()[::-1]  # (write end, read end)
    from_relay, to_launcher = os.pipe()
    read_relay, write_launcher = from_launcher, to_relay
    port = server.getsockname()[1]
    relay = Mux(
        read_relay,
        to_launcher,
        lambda channel: socket.create_connection(("127.0.0.1", port)),
        lines_out=True,
    )
    launcher = Mux(from_relay, write_launcher, lines_in=True)
    threads = [threading.Thread(target=m.pump, daemon=True) for m in (relay, launcher)]
    for thread in threads:
        thread.start()
    yield launcher, relay
    os.close(write_launcher)  # the relay's stdin ends: it ends every channel, then its pump
    threads[0].join(5)
    os.close(to_launcher)
    threads[1].join(5)
    assert not any(thread.is_alive() for thread in threads)
    for fd in (read_relay, from_relay):
        os.close(fd)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        assert part, f"closed after {len(data)} of {n} bytes"
        data += part
    return data


def test_channels_carry_each_connection_whoever_speaks_first(muxes):
    launcher, _ = muxes
    first, second = launcher.open(), launcher.open()
    for sock in (first, second):
        sock.settimeout(5)
        assert _recv_exactly(sock, 6) == b"hello\n"  # the server spoke first
    big = os.urandom(300_000).hex().encode()  # many chunks, each a line of its own
    # The first's echo is read as it comes, as the launcher reads every connection: one pipe
    # carries every channel, so an echo nobody read would hold up the second's behind it.
    echoed: list[bytes] = []
    reader = threading.Thread(target=lambda: echoed.append(_recv_exactly(first, len(big))))
    reader.start()
    second.sendall(b"second")
    first.sendall(big)
    assert _recv_exactly(second, 6) == b"SECOND"
    reader.join(10)
    assert echoed == [big.upper()]


def test_a_closed_channel_ends_at_the_other_side_and_the_rest_go_on(muxes, server):
    launcher, relay = muxes
    first, second = launcher.open(), launcher.open()
    for sock in (first, second):
        sock.settimeout(5)
        _recv_exactly(sock, 6)
    first.close()
    second.sendall(b"still here")
    assert _recv_exactly(second, 10) == b"STILL HERE"
    for _ in range(50):
        if len(relay.channels) == 1:
            break
        threading.Event().wait(0.05)
    assert list(relay.channels) == [2]  # the relay closed the first's connection
