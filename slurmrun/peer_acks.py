"""Whether a silent peer's host is still there: the kernel's acknowledgements on a TCP socket.

A peer that sends nothing may be gone (its host too, or its process ended) or only stopped
(Ctrl-Z, SIGSTOP, a background SIGTTIN): its host's kernel still acknowledges what is sent to
it. An agent waits for its launcher so (`slurmrun.node.launcher_silence`), and a reservation's
keeper for the launcher attached to it (`slurmrun.batch.keeper_links`).
"""

from __future__ import annotations

import socket
import struct

__all__ = ["STOPPED_WAIT", "host_answers"]

# How long a stopped peer (its host answers, it sends nothing) is waited for.
STOPPED_WAIT = 3600.0
# struct tcp_info (linux/tcp.h): tcpi_last_ack_recv, ms since the peer last acknowledged.
_TCP_INFO_SIZE = 104
_LAST_ACK_RECV = 56


def host_answers(sock: socket.socket, within: float) -> bool:
    """Whether the peer's host acknowledged what was sent on `sock` in the last `within` s.

    False where the kernel does not say (no TCP_INFO: not Linux).
    """
    option = getattr(socket, "TCP_INFO", None)
    if option is None:
        return False
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, option, _TCP_INFO_SIZE)
    except OSError:
        return False
    if len(info) < _LAST_ACK_RECV + 4:
        return False
    (last_ack_ms,) = struct.unpack_from("I", info, _LAST_ACK_RECV)
    return bool(last_ack_ms < within * 1000)
