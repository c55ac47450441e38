"""A launcher that sends nothing: gone, or only stopped (Ctrl-Z, SIGSTOP, a background SIGTTIN).

The agent reads the launcher's heartbeats; after `silence` s without any, it used to stop
its workers. But a launcher that a person stopped with Ctrl-Z (or that read its terminal
from the background of a shell, SIGTTIN) is alive: its host's kernel still acknowledges
what the agent sends (the agent's own heartbeats), it just runs no code until ``fg``. So the
silence counts as the launcher's end only once its host stops acknowledging too, or after
`STOPPED_WAIT` s: a launcher that vanished with its host, or whose process ended, is still
found (the kernel's acknowledgements stop, or it resets the connection), and one that is
stopped gets its run back when it goes on.
"""

from __future__ import annotations

import socket
import struct
import time

from slurmrun.node.link import say
from slurmrun.waiting import wait_readable

__all__ = ["STOPPED_WAIT", "wait_for_launcher"]

# How long a stopped launcher (its host answers, it sends nothing) keeps its agents.
STOPPED_WAIT = 3600.0
# struct tcp_info (linux/tcp.h): tcpi_last_ack_recv, ms since the peer last acknowledged.
_TCP_INFO_SIZE = 104
_LAST_ACK_RECV = 56


def wait_for_launcher(sock: socket.socket, silence: float, hostname: str) -> None:
    """Returns once `sock` has something to read (or its end); waits for a stopped launcher.

    Raises:
        BlockingIOError: nothing for `silence` s, and the launcher's host does not
            acknowledge what this agent sends either (or it stayed stopped `STOPPED_WAIT` s).
    """
    if wait_readable([sock.fileno()], silence):
        return
    since = time.monotonic() - silence
    said = False
    # The agent's heartbeats go out every silence / HEARTBEATS_PER_TIMEOUT s: a live host
    # acknowledged one within half of `silence`, a host gone for `silence` did not.
    while host_answers(sock, silence / 2) and time.monotonic() - since < STOPPED_WAIT:
        if not said:
            say(
                hostname,
                f"the launcher has sent nothing for {silence:g} s, but its host acknowledges "
                "what this agent sends: it is stopped (Ctrl-Z?) or not scheduled; waiting "
                f"for it to go on (at most {STOPPED_WAIT:g} s)",
            )
            said = True
        if wait_readable([sock.fileno()], silence):
            say(hostname, f"the launcher goes on after {time.monotonic() - since:.0f} s")
            return
    raise BlockingIOError(f"the launcher sent nothing for {silence:g} s")


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
