"""The mutual HMAC challenge that every connection between launcher, agents and workers starts with.

Each side proves that it knows the per-launch secret (`new_secret`) without sending it: the
server sends a nonce, the client answers with its own nonce and a MAC over both, and the server
answers with its MAC. Nothing a peer sends is parsed beyond these fixed-size fields until it has
proven the secret; only then do frames (`slurmrun.transport`) flow.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import socket
from collections.abc import Iterator

from slurmrun.transport import recv_exact

__all__ = [
    "HANDSHAKE_MAGIC",
    "MAC_BYTES",
    "NONCE_BYTES",
    "AuthenticationError",
    "ClientChallenge",
    "HandshakeBrokeOff",
    "HandshakeTimeout",
    "ServerChallenge",
    "client_handshake",
    "new_secret",
    "server_handshake",
]

HANDSHAKE_MAGIC = b"SRH1"
NONCE_BYTES = 32
MAC_BYTES = 32  # sha256


class AuthenticationError(ConnectionError):
    """The peer did not prove knowledge of the launch secret.

    Raised as such for a wrong proof (final: a wrong secret stays wrong); as
    `HandshakeBrokeOff` when the handshake ended before any proof (worth another try).
    """


class HandshakeBrokeOff(AuthenticationError):
    """The handshake ended before a proof was checked: closed, reset, dropped or timed out.

    Nothing says the secrets differ: a client tries again (a launcher crowded by strangers
    drops their oldest pending handshakes, and ends those past its deadline).
    """


class HandshakeTimeout(HandshakeBrokeOff):
    """The peer did not answer within the handshake's deadline."""


def new_secret() -> bytes:
    """Returns a fresh random per-launch secret."""
    return secrets.token_bytes(32)


def _mac(secret: bytes, role: bytes, nonce_server: bytes, nonce_client: bytes) -> bytes:
    return hmac.new(secret, role + nonce_server + nonce_client, hashlib.sha256).digest()


@contextlib.contextmanager
def _handshake_io(sock: socket.socket, timeout: float) -> Iterator[None]:
    """Bounds a handshake by `timeout`; any way it breaks becomes `HandshakeBrokeOff`."""
    sock.settimeout(timeout)
    try:
        yield
    except AuthenticationError:
        raise
    except TimeoutError as e:
        raise HandshakeTimeout(f"handshake timed out after {timeout:g} s") from e
    except (OSError, EOFError) as e:
        raise HandshakeBrokeOff(f"handshake broke off: {e}") from e
    finally:
        sock.settimeout(None)


class ServerChallenge:
    """The server's side of the handshake as two steps, for readers that cannot block.

    Send `greeting`; read exactly `REPLY_BYTES`; `answer` checks them and returns what to
    send back (or raises AuthenticationError). Nothing else from the peer is read before.
    """

    REPLY_BYTES = NONCE_BYTES + MAC_BYTES

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._nonce = secrets.token_bytes(NONCE_BYTES)
        self.greeting = HANDSHAKE_MAGIC + self._nonce

    def answer(self, reply: bytes | bytearray) -> bytes:
        """The server's proof, once the peer's `reply` proved the secret."""
        nonce_c, mac_c = bytes(reply[:NONCE_BYTES]), bytes(reply[NONCE_BYTES:])
        if not hmac.compare_digest(mac_c, _mac(self._secret, b"client", self._nonce, nonce_c)):
            raise AuthenticationError("peer failed the HMAC challenge")
        return _mac(self._secret, b"server", self._nonce, nonce_c)


def server_handshake(sock: socket.socket, secret: bytes, timeout: float) -> None:
    """Challenges a freshly accepted peer; raises AuthenticationError if it fails.

    The fields read are all fixed-size, and the whole exchange is bounded by `timeout`.
    """
    with _handshake_io(sock, timeout):
        challenge = ServerChallenge(secret)
        sock.sendall(challenge.greeting)
        sock.sendall(challenge.answer(recv_exact(sock, ServerChallenge.REPLY_BYTES)))


class ClientChallenge:
    """The client's side of the handshake as two steps, for callers that cannot block.

    Read exactly `GREETING_BYTES`; send what `reply` returns; read exactly `PROOF_BYTES`;
    `check` them (each raises AuthenticationError when the server fails).
    """

    GREETING_BYTES = len(HANDSHAKE_MAGIC) + NONCE_BYTES
    PROOF_BYTES = MAC_BYTES

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._nonces = (b"", b"")

    def reply(self, greeting: bytes | bytearray) -> bytes:
        """What to send the server, proving the secret, for its `greeting`."""
        if bytes(greeting[: len(HANDSHAKE_MAGIC)]) != HANDSHAKE_MAGIC:
            raise AuthenticationError("server did not speak the slurmrun handshake")
        nonce_s = bytes(greeting[len(HANDSHAKE_MAGIC) :])
        nonce_c = secrets.token_bytes(NONCE_BYTES)
        self._nonces = (nonce_s, nonce_c)
        return nonce_c + _mac(self._secret, b"client", nonce_s, nonce_c)

    def check(self, proof: bytes | bytearray) -> None:
        """Checks that the server, whose `proof` this is, knows the secret too."""
        expected = _mac(self._secret, b"server", *self._nonces)
        if not self._nonces[0] or not hmac.compare_digest(bytes(proof), expected):
            raise AuthenticationError("server failed the HMAC challenge")


def client_handshake(sock: socket.socket, secret: bytes, timeout: float) -> None:
    """Answers the server's challenge and checks that the server knows the secret too.

    A server closes, without a word, on a wrong proof of ours: a client with a wrong secret
    sees `HandshakeBrokeOff` (strangers learn nothing but the challenge).

    Raises:
        AuthenticationError: the server failed its proof (final).
        HandshakeTimeout: the server did not answer within `timeout` (e.g. it was crowded).
        HandshakeBrokeOff: the connection ended or broke before a proof (try again).
    """
    with _handshake_io(sock, timeout):
        challenge = ClientChallenge(secret)
        sock.sendall(challenge.reply(recv_exact(sock, ClientChallenge.GREETING_BYTES)))
        challenge.check(recv_exact(sock, ClientChallenge.PROOF_BYTES))
