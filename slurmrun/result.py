"""What `launch` returns."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["LaunchResult"]

T = TypeVar("T")


@dataclass(frozen=True)
class LaunchResult(Generic[T]):
    """Every worker's return value, grouped by host in rank order.

    Attributes:
        hostnames: the hosts, in node-rank order.
        return_values: per host, the return values of its workers by local rank.
        timings: seconds since the launch started at which every agent had connected, every
            worker had started, the first and the last result arrived, and the launch ended
            (``agents_connected``, ``workers_started``, ``first_result``, ``last_result``,
            ``total``, in that order). A failed launch's exception carries them as
            ``exc.timings`` (the milestones it reached).
        lost_hosts: the hosts lost during the launch and why (`Launcher.min_hosts`), by their
            log label (a host named twice in `hostnames` is ``host#<node rank>`` from its
            second entry on); the run that returned ran on `hostnames` without them.
    """

    hostnames: list[str]
    return_values: list[list[T]]
    timings: Mapping[str, float] = field(default_factory=dict)
    lost_hosts: Mapping[str, str] = field(default_factory=dict)

    def rank(self, rank: int) -> T:
        """Returns the value of global rank `rank` (ranks run host by host).

        Raises:
            IndexError: `rank` is negative or not below the world size.
        """
        if rank < 0:
            raise IndexError(f"rank must be >= 0, got {rank}")
        for values in self.return_values:
            if rank < len(values):
                return values[rank]
            rank -= len(values)
        raise IndexError(f"rank out of range: the world size is {self.world_size}")

    def index(self, hostname: str, local_rank: int) -> T:
        """Returns the value of the worker with `local_rank` on `hostname`.

        Raises:
            ValueError: `hostname` was not part of the launch.
            IndexError: `local_rank` is out of range on that host.
        """
        try:
            values = self.return_values[self.hostnames.index(hostname)]
        except ValueError:
            raise ValueError(f"{hostname!r} is not one of the hosts {self.hostnames}") from None
        if not 0 <= local_rank < len(values):
            raise IndexError(f"{hostname} ran {len(values)} workers; no local rank {local_rank}")
        return values[local_rank]

    @property
    def world_size(self) -> int:
        """The number of workers."""
        return sum(len(v) for v in self.return_values)

    def values(self) -> list[T]:
        """All return values in global rank order."""
        return [v for host_values in self.return_values for v in host_values]
