"""Where hosts and workers come from: allocation providers, found through entry points.

A provider is a small class registered in the entry-point group ``slurmrun.allocations`` (the
group keeps that name, which providers register under, though this module is ``providers``);
slurmrun's own (``slurm``, ``hostfile``, ``localhost``) are registered there exactly as a
third-party one is::

    [project.entry-points."slurmrun.allocations"]
    my_scheduler = "my_package.module:MyScheduler"

The interface (`AllocationProvider`): a class whose instances have a ``priority`` (an int)
and a ``detect()`` method that returns the `Hosts` it sees, or None when it does not apply
here. With ``hostnames="auto"`` the launcher asks every provider in increasing ``priority``
(then name) order and takes the first answer: ``slurm`` (10: inside a SLURM job), then
``hostfile`` (20: ``$SLURMRUN_HOSTFILE`` is set), then ``localhost`` (1000: always). A
third-party provider picks its place with its priority (below 10 to come before SLURM).

`Hosts.agents` says how agents are started, by a name of ``slurmrun.launcher.agents.KINDS``:
``"srun"`` (one step of the SLURM job), ``"ssh"`` (one ``ssh`` per host) or ``"local"``
(subprocesses of the launcher; every host must be this machine).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Protocol

from slurmrun.errors import OptionsValueError
from slurmrun.slurm.job import job_hostnames

__all__ = [
    "GROUP",
    "HOSTFILE_VAR",
    "AllocationProvider",
    "HostfileProvider",
    "Hosts",
    "LocalhostProvider",
    "SlurmProvider",
    "detect",
    "providers",
    "read_hostfile",
]

GROUP = "slurmrun.allocations"
HOSTFILE_VAR = "SLURMRUN_HOSTFILE"


@dataclass(frozen=True)
class Hosts:
    """What a provider found.

    Attributes:
        hostnames: the hosts, in node-rank order.
        workers_per_host: workers on each host; None: each agent decides (one per GPU...).
        agents: how agents are started: a name of ``slurmrun.launcher.agents.KINDS``
            (``"srun"``, ``"ssh"``, ``"local"``).
        provider: the provider's entry-point name (filled in by `detect`).
    """

    hostnames: tuple[str, ...]
    workers_per_host: tuple[int, ...] | None = None
    agents: str = "ssh"
    provider: str = ""


class AllocationProvider(Protocol):
    """What an entry point of ``slurmrun.allocations`` names: a class, built without arguments.

    Attributes:
        priority: its place when ``hostnames="auto"`` asks (lower first).
    """

    priority: int

    def detect(self, environ: Mapping[str, str]) -> Hosts | None:
        """The hosts of this machine's allocation, or None if there is none of this kind.

        Args:
            environ: the launcher's environment.
        """


class SlurmProvider:
    """The nodes of the SLURM job this runs in (agents started with srun)."""

    priority = 10

    def detect(self, environ: Mapping[str, str]) -> Hosts | None:
        """See `AllocationProvider`."""
        # The node list alone: the launch reads the rest of the job once (`make_plan`), and
        # inside a step the rest would cost a second `scontrol show job`.
        hostnames = job_hostnames(environ)
        if hostnames is None:
            return None
        return Hosts(tuple(hostnames), None, "srun")


def read_hostfile(path: str) -> Hosts:
    """Reads a hostfile: one host per line, optionally ``slots=N``; ``#`` starts a comment.

    Raises:
        OptionsValueError: the file is empty or a line is malformed.
    """
    hosts: list[str] = []
    slots: list[int | None] = []
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f, 1):
            words = raw.split("#", 1)[0].split()
            if not words:
                continue
            count: int | None = None
            for word in words[1:]:
                key, _, value = word.partition("=")
                if key != "slots" or not value.isdigit() or int(value) < 1:
                    raise OptionsValueError(
                        f"{path}:{number}: expected 'HOST' or 'HOST slots=N', got {raw.strip()!r}"
                    )
                count = int(value)
            hosts.append(words[0])
            slots.append(count)
    if not hosts:
        raise OptionsValueError(f"the hostfile {path} lists no host")
    counts = None if any(c is None for c in slots) else tuple(c for c in slots if c is not None)
    return Hosts(tuple(hosts), counts, "ssh")


class HostfileProvider:
    """The hosts of the file ``$SLURMRUN_HOSTFILE`` names (agents started over ssh)."""

    priority = 20

    def detect(self, environ: Mapping[str, str]) -> Hosts | None:
        """See `AllocationProvider`."""
        path = environ.get(HOSTFILE_VAR)
        return read_hostfile(path) if path else None


class LocalhostProvider:
    """This machine alone (agents as subprocesses): the answer when nothing else applies."""

    priority = 1000

    def detect(self, environ: Mapping[str, str]) -> Hosts | None:
        """See `AllocationProvider`."""
        return Hosts(("localhost",), None, "local")


_BUILTIN: dict[str, type[AllocationProvider]] = {
    "slurm": SlurmProvider,
    "hostfile": HostfileProvider,
    "localhost": LocalhostProvider,
}


def providers() -> list[tuple[str, AllocationProvider]]:
    """Every registered provider, by name, in the order ``"auto"`` asks them.

    The built-in ones are added when this slurmrun runs from a checkout whose entry points are
    not installed (the same classes, under the same names).
    """
    classes: dict[str, type[AllocationProvider]] = {}
    for point in entry_points(group=GROUP):
        classes.setdefault(point.name, point.load())
    for name, cls in _BUILTIN.items():
        classes.setdefault(name, cls)
    found = [(name, cls()) for name, cls in classes.items()]
    return sorted(found, key=lambda item: (int(item[1].priority), item[0]))


def detect(environ: Mapping[str, str] | None = None) -> Hosts:
    """The first answer of `providers` (``hostnames="auto"``); localhost at the latest."""
    environ = os.environ if environ is None else environ
    for name, provider in providers():
        hosts = provider.detect(environ)
        if hosts is not None:
            if not hosts.hostnames:
                raise ValueError(f"the allocation provider {name!r} found no host")
            return Hosts(hosts.hostnames, hosts.workers_per_host, hosts.agents, name)
    return Hosts(("localhost",), None, "local", "localhost")  # pragma: no cover
