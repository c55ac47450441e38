"""Where a launch's agents reach the launcher: its address, its socket.

Each kind of agents (`slurmrun.launcher.agents`) picks its address: loopback when every agent
runs on this machine (`loopback`); else ``SLURMRUN_LAUNCHER_ADDR`` if set, or this machine's
address on the route toward the first node (`routed`). The port is any free one, or
``SLURMRUN_LAUNCHER_PORT``'s.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from slurmrun.errors import OptionsValueError
from slurmrun.launcher.listener import LISTEN_BACKLOG
from slurmrun.variables import LAUNCHER_ADDR_VAR, PORT_VAR

__all__ = ["Address", "address_toward", "listen", "loopback", "routed", "wanted_port"]


@dataclass(frozen=True)
class Address:
    """Where the launcher listens, and the address its agents are given."""

    bind: str
    advertise: str  # what agents connect to
    reason: str  # why, for people (dry runs, `slurmrun info`)


def loopback() -> Address:
    """The address of agents that all run on this machine."""
    return Address("127.0.0.1", "127.0.0.1", "loopback: the agents run on this machine")


def routed(first: str, target: str | None = None) -> Address:
    """``SLURMRUN_LAUNCHER_ADDR`` if set, else this machine's address on the route toward `first`.

    The launcher listens on that address alone when it is one of this machine's (always, but
    for an override that is not: a forwarded or NAT address), so that no other interface
    offers its port.

    Args:
        first: the first host, which the agents' address is chosen for.
        target: the name the route is looked up for, when `first` stands for another (an ssh
            alias); read only when no override is set.
    """
    override = os.environ.get(LAUNCHER_ADDR_VAR)
    if override:
        return Address(_bind_for(override), override, f"{LAUNCHER_ADDR_VAR} is set")
    advertise = address_toward(first if target is None else target)
    return Address(
        _bind_for(advertise),
        advertise,
        f"this machine's address on the route toward {first}, the first node",
    )


def address_toward(host: str) -> str:
    """The local address the kernel would use to reach `host`.

    ``SLURMRUN_LAUNCHER_ADDR`` overrides it (`routed` reads that, not this function).

    Connecting a UDP socket sends nothing; it only picks a route. This is right where
    ``getfqdn()`` is not (nodes often cannot resolve the login node's name).
    """
    try:
        infos = socket.getaddrinfo(host, 9, socket.AF_INET, socket.SOCK_DGRAM)
    except socket.gaierror as e:
        raise RuntimeError(
            f"cannot resolve node {host!r} to find an address it can reach us at ({e}); set "
            "SLURMRUN_LAUNCHER_ADDR to this machine's address on the cluster network"
        ) from e
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(infos[0][4])
        return str(s.getsockname()[0])


def _bind_for(advertise: str) -> str:
    """`advertise` if this machine can listen on it, else every interface (``0.0.0.0``)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((advertise, 0))
    except (OSError, OverflowError):  # not ours (EADDRNOTAVAIL), a name, or not IPv4
        return "0.0.0.0"  # noqa: S104 - agents connect to an address forwarded to us
    return advertise


def wanted_port() -> int | None:
    """The port asked for in ``SLURMRUN_LAUNCHER_PORT``; None: any free one.

    Raises:
        OptionsValueError: the variable is set to something else than a port number.
    """
    wanted = os.environ.get(PORT_VAR, "")
    if not wanted:
        return None
    if not wanted.isdigit() or not 0 < int(wanted) < 65536:
        raise OptionsValueError(
            f"{PORT_VAR}={wanted!r} is not a TCP port number (1-65535): set a port, or unset it "
            "for a free one"
        )
    return int(wanted)


def listen(bind: str) -> socket.socket:
    """The launcher's listening socket (on ``SLURMRUN_LAUNCHER_PORT`` if it is set).

    Raises:
        OSError: the port asked for is taken (the message says what to do).
    """
    wanted = wanted_port()
    if wanted is None:
        return socket.create_server((bind, 0), backlog=LISTEN_BACKLOG)
    try:
        return socket.create_server((bind, wanted), backlog=LISTEN_BACKLOG)
    except OSError as e:
        raise OSError(
            e.errno,
            f"the launcher cannot listen on {PORT_VAR}={wanted} ({e.strerror}): another "
            "process (or a launch not yet finished) holds it. Free it, pick another port, or "
            f"unset {PORT_VAR} to let slurmrun choose a free one.",
        ) from e
