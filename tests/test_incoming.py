"""The launcher's non-blocking reader of one connection (slurmrun/launcher/incoming.py), over real
TCP: the handshake first, then frames of every size, cut from a read-ahead buffer, received
straight into their buffers, or handed to a thread when large."""

from __future__ import annotations

import hashlib
import os
import pickle
import selectors
import socket
import struct
import threading
import time

import pytest

from slurmrun.authentication import (
    AuthenticationError,
    ClientChallenge,
    ServerChallenge,
    client_handshake,
    new_secret,
)
from slurmrun.launcher.incoming import HANDOFF_BYTES, Incoming
from slurmrun.pickling import dumps, loads
from slurmrun.transport import Connection, Frame, FrameError


@pytest.fixture
def pair():
    """(server side, client side) of one loopback TCP connection."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
    yield accepted, client
    accepted.close()
    client.close()


def _read_all(incoming: Incoming, until_closed: bool = True, limit: float = 30.0) -> list[Frame]:
    """Feeds `incoming` whatever arrives, as the listener does, until the peer closed."""
    frames: list[Frame] = []
    with selectors.DefaultSelector() as sel:
        sel.register(incoming.sock, selectors.EVENT_READ)
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            sel.select(0.5)
            got, still_open = incoming.read()
            frames += got
            if incoming.handoff:
                frames.append(incoming.receive_rest())
            if not still_open or (not until_closed and frames):
                return frames
    raise AssertionError("the peer did not close in time")


def _accepted(pair, secret: bytes) -> tuple[Incoming, Connection]:
    server_side, client_side = pair
    incoming = Incoming(server_side, "peer", secret, 30.0, time.monotonic() + 10)
    incoming.greet()
    shake = threading.Thread(target=client_handshake, args=(client_side, secret, 10))
    shake.start()
    with selectors.DefaultSelector() as sel:
        sel.register(server_side, selectors.EVENT_READ)
        while incoming.conn is None:
            assert sel.select(10), "no handshake reply"
            assert incoming.read() == ([], True)
    shake.join()
    return incoming, Connection(client_side)


def test_frames_of_every_size_arrive_whole_and_in_order(pair) -> None:
    incoming, client = _accepted(pair, secret := new_secret())
    assert secret
    sizes = [0, 1, 17, 4096, 70_000, 300_000, HANDOFF_BYTES - 1, HANDOFF_BYTES, 3 * HANDOFF_BYTES]
    sent = [(i, os.urandom(sizes[i % len(sizes)])) for i in range(60)]

    def send() -> None:
        for i, blob in sent:
            body, buffers = dumps({"i": i, "blob": blob})
            client.send({"t": "x", "i": i}, body, buffers)
        client.sock.shutdown(socket.SHUT_WR)

    sender = threading.Thread(target=send)
    sender.start()
    frames = _read_all(incoming)
    sender.join()
    assert [f.header["i"] for f in frames] == [i for i, _ in sent]
    assert [loads(f.body, f.buffers) for f in frames] == [{"i": i, "blob": b} for i, b in sent]
    assert incoming.conn is not None and not incoming.conn.receiving


def _frame_bytes(obj: object) -> bytes:
    """The bytes of one frame ``{"t": "x"}`` carrying `obj`, as `Connection.send` writes them."""
    body, buffers = dumps(obj)
    raw = socket.socketpair()
    try:
        Connection(raw[0]).send({"t": "x"}, body, buffers)
        raw[0].close()
        return b"".join(iter(lambda: raw[1].recv(65536), b""))
    finally:
        raw[1].close()


def test_a_frame_trickling_in_byte_by_byte(pair) -> None:
    incoming, client = _accepted(pair, new_secret())
    data = _frame_bytes(["x" * 100, b"y" * 5000])
    for k in range(len(data)):
        client.sock.sendall(data[k : k + 1])
        if k % 997 == 0:
            time.sleep(0.001)  # several reads see a partial prefix, header or payload
    client.sock.shutdown(socket.SHUT_WR)
    (frame,) = _read_all(incoming)
    assert loads(frame.body, frame.buffers) == ["x" * 100, b"y" * 5000]


def test_nothing_but_the_handshake_reply_is_read_before_the_secret_is_proven(pair) -> None:
    server_side, client_side = pair
    incoming = Incoming(server_side, "peer", new_secret(), 30.0, time.monotonic() + 10)
    incoming.greet()
    body, _ = dumps("a frame instead of a proof")
    Connection(client_side).send({"t": "hello"}, body)
    with pytest.raises(AuthenticationError, match="HMAC"):
        _read_all(incoming)
    assert incoming.conn is None


def test_a_wrong_secret_fails_the_handshake(pair) -> None:
    server_side, client_side = pair
    incoming = Incoming(server_side, "peer", new_secret(), 30.0, time.monotonic() + 10)
    incoming.greet()
    outcome: list[BaseException] = []

    def impostor() -> None:
        try:
            client_handshake(client_side, b"not the secret", 5)
        except (AuthenticationError, OSError) as e:
            outcome.append(e)

    shake = threading.Thread(target=impostor)
    shake.start()
    with pytest.raises(AuthenticationError, match="HMAC"):
        _read_all(incoming)
    server_side.close()  # as the listener does: the impostor's wait for our proof ends
    shake.join(10)
    assert outcome, "the impostor must not pass its own handshake either"


def test_bad_magic_is_a_frame_error(pair) -> None:
    incoming, client = _accepted(pair, new_secret())
    client.sock.sendall(b"EVIL" + bytes(40))
    with pytest.raises(FrameError, match="magic"):
        _read_all(incoming)


def test_a_close_in_the_middle_of_a_frame_is_an_eof_error(pair) -> None:
    incoming, client = _accepted(pair, new_secret())
    data = _frame_bytes(b"z" * 200_000)
    client.sock.sendall(data[: len(data) // 2])
    client.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(EOFError, match="middle of a frame"):
        _read_all(incoming)
    assert incoming.conn is not None and incoming.conn.receiving


def test_a_close_between_frames_ends_the_connection_cleanly(pair) -> None:
    incoming, client = _accepted(pair, new_secret())
    client.send({"t": "hb"})
    client.sock.shutdown(socket.SHUT_WR)
    (frame,) = _read_all(incoming)
    assert frame.kind == "hb"


def test_a_burst_of_small_frames_with_buffers_is_cut_from_one_read(pair) -> None:
    """Small frames that arrive whole are sliced off the read-ahead buffer, buffers included."""
    incoming, client = _accepted(pair, new_secret())
    raw = socket.socketpair()
    values = [
        (i, pickle.PickleBuffer(bytearray([i % 256]) * (i % 50)), b"z" * i) for i in range(500)
    ]
    chunks: list[bytes] = []
    collector = threading.Thread(
        target=lambda: chunks.extend(iter(lambda: raw[1].recv(1 << 20), b""))
    )
    collector.start()
    try:
        for i, value in enumerate(values):
            body, buffers = dumps(value)
            assert buffers, "out-of-band buffers are what this test is about"
            Connection(raw[0]).send({"t": "x", "i": i}, body, buffers)
    finally:
        raw[0].close()
        collector.join()
        raw[1].close()
    data = b"".join(chunks)

    def send() -> None:
        client.sock.sendall(data)  # one write: most frames are whole in one read
        client.sock.shutdown(socket.SHUT_WR)

    sender = threading.Thread(target=send)
    sender.start()
    frames = _read_all(incoming)
    sender.join()
    assert [f.header["i"] for f in frames] == list(range(500))
    got = [loads(f.body, f.buffers) for f in frames]
    assert [(i, bytes(buf), z) for i, buf, z in got] == [
        (i, bytes(buf.raw()), z) for i, buf, z in values
    ]
    # Each frame owns its bytes (the read-ahead buffer is reused): writable, and unchanged
    # by what came after it.
    assert all(isinstance(f.body, bytearray) for f in frames)
    assert all(isinstance(b, bytearray) for f in frames for b in f.buffers)


def test_a_header_with_data_after_its_json_object_is_a_frame_error(pair) -> None:
    incoming, client = _accepted(pair, new_secret())
    header = b'{"t":"x"} {"t":"y"}'
    client.sock.sendall(struct.pack("!4sIQI", b"SRF1", len(header), 0, 0) + header)
    with pytest.raises(FrameError, match="extra data"):
        _read_all(incoming)


def test_the_client_side_refuses_a_server_that_does_not_know_the_secret() -> None:
    secret = new_secret()
    server = ServerChallenge(b"another secret")
    client = ClientChallenge(secret)
    reply = client.reply(server.greeting)
    with pytest.raises(AuthenticationError):
        server.answer(reply)  # the server sees the client's proof is not for its secret...
    impostor_proof = hashlib.sha256(reply).digest()
    with pytest.raises(AuthenticationError, match="HMAC"):
        client.check(impostor_proof)  # ...and the client refuses a proof without the secret
    with pytest.raises(AuthenticationError, match="handshake"):
        ClientChallenge(secret).reply(b"HTTP/1.1 200 OK\r\n" + bytes(19))
    with pytest.raises(AuthenticationError, match="HMAC"):
        ClientChallenge(secret).check(bytes(32))  # no greeting was answered yet
    good = ServerChallenge(secret)
    ok = ClientChallenge(secret)
    ok.check(good.answer(ok.reply(good.greeting)))  # the same secret on both sides passes
