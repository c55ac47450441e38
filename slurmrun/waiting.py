"""Bounded waits on file descriptors, for both sides: poll(), never select().

A launcher with thousands of agents, or an agent with many workers, holds descriptors past
1024, which select() cannot watch.
"""

from __future__ import annotations

import select
from collections.abc import Sequence

__all__ = ["wait_readable"]


def wait_readable(fds: Sequence[int], timeout: float) -> bool:
    """Waits up to `timeout` seconds until one of `fds` is readable (or closed at the far end)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0.0, timeout) * 1000))
