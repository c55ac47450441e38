"""The launcher's verdict on a silent agent counts only the silence it could have heard:
bytes waiting unread in the agent's socket are heard, and after a gap in the launcher's own
looks (it was stopped: Ctrl-Z, SIGSTOP; or not scheduled) every agent gets a fresh
heartbeat_timeout. Real sockets; the clock is passed in, as the launcher's loop passes it.
(The whole story, a launcher stopped with Ctrl-Z in a shell, is in tests/test_debugger.py.)
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from slurmrun.errors import AgentFailedError
from slurmrun.launcher.health import AgentHealth
from slurmrun.transport import Connection

SILENCE = 2.0
HEARD = 100.0  # when the agent's connection last delivered a frame


@dataclass
class Agent:
    node_rank: int
    hostname: str
    conn: Connection
    closed: bool = False


class Starter:
    """What the verdict reads of the agents' processes: their log files."""

    def log_file(self, node_rank: int | None) -> Path:
        return Path(f"/logs/agent{node_rank}.log")


@pytest.fixture
def pair() -> Iterator[tuple[Agent, socket.socket]]:
    ours, theirs = socket.socketpair()
    yield Agent(0, "node1", Connection(ours)), theirs
    ours.close()
    theirs.close()


def _health() -> AgentHealth:
    starter = Starter()  # (the verdict reads only its log_file)
    return AgentHealth(["node1"], starter, SILENCE, lambda _conn: HEARD)  # type: ignore[arg-type]


def _look(health: AgentHealth, agent: Agent, start: float, end: float) -> None:
    """The loop's looks every 50 ms from `start` to `end` (no gap)."""
    now = start
    while now <= end:
        health.check_silence({0: agent}, now)
        now += 0.05


def test_bytes_the_launcher_did_not_read_yet_count_as_heard(
    pair: tuple[Agent, socket.socket],
) -> None:
    agent, theirs = pair
    health = _health()
    theirs.send(b"\0" * 8)  # a heartbeat's first bytes, in the socket, not read
    _look(health, agent, HEARD, HEARD + 3 * SILENCE)
    agent.conn.sock.recv(8)  # read, and no frame came of it: silence is silence again
    with pytest.raises(AgentFailedError, match="sent nothing for 2 s"):
        _look(health, agent, HEARD + 3 * SILENCE, HEARD + 3 * SILENCE + 0.5)


def test_after_a_gap_in_its_own_looks_the_launcher_gives_agents_a_fresh_timeout(
    pair: tuple[Agent, socket.socket],
) -> None:
    agent, _ = pair
    health = _health()
    _look(health, agent, HEARD, HEARD + 1.0)
    resumed = HEARD + 30.0  # stopped for 29 s: nothing of it was read
    _look(health, agent, resumed, resumed + SILENCE - 0.1)
    with pytest.raises(AgentFailedError, match="sent nothing for 2 s"):
        _look(health, agent, resumed + SILENCE - 0.05, resumed + SILENCE + 1.1)
