"""Long jobs on localhost (issue 12, section 3): nothing but a real failure ends a launch.

- A rank that stays busy long after the others returned (rank 0 evaluating, or writing a
  checkpoint) is healthy: the launch waits for it, however long that takes.
- Failure checks run on a clock: ranks that print as fast as they can do not postpone the
  verdict on an agent that went silent.
- An agent's output readers work with file descriptors past 1024 (select() does not).

A rank stuck in a collective that the others never joined is a row of the fault matrix
(tests/test_faults.py, ``worker_hangs_in_a_collective``); an agent whose launcher went silent
is tested on the cluster (tests/slurm/test_long_jobs_slurm.py), where the launcher's traffic
can be dropped by a firewall.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import slurmrun
from slurmrun.node.agent import Agent
from slurmrun.node.link import LauncherConnection
from slurmrun.node.relay import WorkerLink
from slurmrun.transport import Connection

# ---------------------------------------------------------------- functions run on workers


def rank() -> int:
    return int(os.environ["RANK"])


def busy_long_after_the_others(seconds: float) -> int:
    """Rank 0 works on alone (say, evaluating) for `seconds` after the others returned."""
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))
    if rank() == 0:
        time.sleep(seconds)
    return rank()


def print_flat_out_while_rank_0_stops_its_agent(path: str, seconds: float) -> None:
    if rank() == 0:
        agent = psutil.Process().parent().parent()  # worker -> spawner -> agent
        assert " ".join(agent.cmdline()) == "slurmrun agent (localhost)"
        with open(path, "w") as f:
            f.write(repr(time.time()))
        agent.suspend()  # SIGSTOP: alive, but it sends nothing any more
    line = "x" * 100
    # Bounded, so that a launcher that only judges silence once output stops still ends.
    deadline = time.time() + seconds
    i = 0
    while time.time() < deadline:
        print(line, i)
        i += 1
    time.sleep(300)


# ---------------------------------------------------------------- tests


def test_a_rank_busy_long_after_the_others_returned_is_waited_for() -> None:
    timeout = 5
    busy = 3 * timeout + 1
    result = slurmrun.launch(
        busy_long_after_the_others, (busy,), workers_per_host=2, timeout=timeout, backend="gloo"
    )
    assert result.values() == [0, 1]


def sleep_then_rank(seconds: float) -> int:
    time.sleep(seconds)
    return rank()


def test_heartbeats_keep_up_with_a_timeout_shorter_than_heartbeat_timeout() -> None:
    # Silence counts against min(timeout, heartbeat_timeout): heartbeats must come often
    # enough for that, not for heartbeat_timeout alone (60 / 5 = 12 s apart would be > 5 s).
    result = slurmrun.launch(
        sleep_then_rank, (8.0,), workers_per_host=1, timeout=5, heartbeat_timeout=60, backend=None
    )
    assert result.values() == [0]


def test_a_silent_agent_is_found_while_other_ranks_print_flat_out(tmp_path: Path) -> None:
    path = tmp_path / "stopped_at"
    heartbeat_timeout = 3.0
    printing = 90.0  # how long ranks print: far beyond the bound below
    with pytest.raises(slurmrun.AgentFailedError) as info:
        slurmrun.launch(
            print_flat_out_while_rank_0_stops_its_agent,
            (str(path), printing),
            hostnames=["localhost", "localhost"],
            workers_per_host=4,
            backend=None,
            timeout=60,
            heartbeat_timeout=heartbeat_timeout,
        )
    detected = time.time() - float(path.read_text())
    print(f"silent agent found {detected:.2f} s after SIGSTOP (heartbeat_timeout=3)")
    assert f"sent nothing for {heartbeat_timeout:g} s (no heartbeat)" in str(info.value)
    # The verdict comes at heartbeat_timeout; then the other agent stops its workers (up to
    # its grace period) before the launcher raises. The bound holds on a loaded 2-core machine;
    # a launcher that waits for the output to stop raises only after `printing` seconds.
    assert detected < heartbeat_timeout + 25.0, f"{detected:.2f} s"
    deadline = time.monotonic() + 10.0
    while (left := live_children()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"left behind: {left}"


def live_children() -> list[int]:
    alive = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p.pid)
    return alive


@contextlib.contextmanager
def fds_past_1024() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(2048, hard), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_agent_forwards_worker_output_on_fds_past_1024() -> None:
    """About 200 CPU workers on one node give an agent fds past select()'s limit."""
    with fds_past_1024():
        to_launcher, launcher_side = socket.socketpair()
        ours, workers = socket.socketpair()  # a worker's stdout
        assert ours.fileno() > 1024 and to_launcher.fileno() > 1024
        launcher_side.settimeout(30.0)
        agent = Agent(
            launcher=LauncherConnection(to_launcher),
            hostname="node",
            spawner=None,  # type: ignore[arg-type]  # never spawns here
            connect=socket.socket,
        )
        worker = WorkerLink(3, process=None, conn=None, streams=None)  # type: ignore[arg-type]
        worker.outputs = [ours]
        reader = threading.Thread(target=agent.relay._forward_output, args=(worker, ours, "stdout"))
        reader.start()
        try:
            workers.sendall(b"first line\nsecond line\n")
            agent.relay.drain_output(worker)  # returns once both lines are on their way
            lines: list[tuple[str, int]] = []
            while len(lines) < 2:  # the lines of one read travel in one message
                frame = Connection(launcher_side).recv()
                assert frame is not None
                lines += [
                    (t, frame.header["local_rank"]) for t in bytes(frame.body).decode().split("\n")
                ]
        finally:
            workers.close()
            reader.join(timeout=30.0)
        assert lines == [("first line", 3), ("second line", 3)]
        assert not reader.is_alive()  # it saw the end of the stream and closed its socket
        assert ours.fileno() == -1
        to_launcher.close()
        launcher_side.close()


def test_an_agent_stops_waiting_for_runs_when_its_launcher_dies_in_a_frame() -> None:
    # The launcher's end of the connection sends the start of a frame and then dies: the
    # agent's reader must still tell `serve` that there will be no more runs.
    to_launcher, launcher_side = socket.socketpair()
    agent = Agent(
        launcher=LauncherConnection(to_launcher),
        hostname="node",
        spawner=None,
        connect=socket.socket,
    )
    launcher_side.sendall(b"SRF1\0\0")  # a frame prefix, cut short
    launcher_side.close()
    reader = threading.Thread(target=agent._read_launcher, daemon=True)
    reader.start()
    reader.join(timeout=30.0)
    assert agent.inbox.get(timeout=30.0) is None
    assert agent.runs.gone()
    to_launcher.close()
