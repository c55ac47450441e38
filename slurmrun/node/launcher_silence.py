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
import time

from slurmrun.node.link import say
from slurmrun.peer_acks import STOPPED_WAIT, host_answers
from slurmrun.waiting import wait_readable

__all__ = ["STOPPED_WAIT", "wait_for_launcher"]


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
