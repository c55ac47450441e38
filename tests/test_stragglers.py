"""Stragglers and hangs found from sampled stacks, on localhost with gloo."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path

import pytest

import slurmrun
from slurmrun import protocol
from slurmrun.events import Event, Straggler
from slurmrun.node.relay import WorkerLink
from slurmrun.node.spawner import WorkerProcess
from slurmrun.node.stacks_answer import ask_workers
from slurmrun.stacks.report import StackSource
from slurmrun.transport import Connection

LIMIT = 60.0  # the most a test's run may last


@pytest.fixture(autouse=True)
def _logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path / "logs"))


def steps(step: float, slow_rank: int, slower: float, seconds: float, stop: str) -> int:
    """Steps of `step` s (a sleep) and an all_reduce, for `seconds` or until `stop` exists;
    `slow_rank`'s steps take `slower` times as long."""
    import pathlib

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    pause = step * (slower if rank == slow_rank else 1.0)
    end = time.monotonic() + seconds
    done = 0
    while True:
        time.sleep(pause)  # the step's work
        over = rank == 0 and (time.monotonic() > end or pathlib.Path(stop).exists())
        flag = torch.tensor([1.0 if over else 0.0])
        dist.all_reduce(flag)
        done += 1
        if flag.item() > 0:
            return done


def _run_steps(
    tmp_path: Path, slower: float, seconds: float, **options: object
) -> tuple[list[Event], float]:
    """Runs `steps` on 2 gloo workers; the events, and the workers' start (time.time())."""
    stop = tmp_path / "stop"
    events: list[Event] = []

    def on_event(event: Event) -> None:
        events.append(event)
        if isinstance(event, Straggler):
            stop.touch()  # found: the run may end

    slurmrun.launch(
        steps,
        (0.1, 1, slower, seconds, str(stop)),
        workers_per_host=2,
        backend="gloo",
        on_event=on_event,
        **options,  # type: ignore[arg-type]
    )
    started = next(e.time for e in events if e.kind == "workers_started")
    return events, started


def test_a_rank_30_percent_slower_is_named_a_straggler_within_20_s(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    events, started = _run_steps(tmp_path, 1.3, LIMIT)
    found = [e for e in events if isinstance(e, Straggler)]
    assert found, [e.kind for e in events]
    first = found[0]
    assert first.rank == 1 and first.host == "localhost", first
    assert first.time - started < 20.0, first.time - started
    assert first.score >= 0.15, first
    assert first.hot_frames[0].startswith("steps (test_stragglers.py:"), first.hot_frames
    report = Path(first.report_file)
    assert report.parent.name == "stragglers" and report.is_file()
    assert "straggler: rank 1 (localhost)" in report.read_text()
    assert "Python stacks of 2 ranks" in report.read_text()  # a sample's, whole
    line = [r.getMessage() for r in caplog.records if "straggler: rank 1" in r.getMessage()]
    assert len(line) == 1 and "at steps (test_stragglers.py:" in line[0], caplog.text
    print(f"straggler named {first.time - started:.1f} s after the workers started")


def test_balanced_ranks_are_never_named_stragglers(tmp_path: Path) -> None:
    events, _ = _run_steps(tmp_path, 1.0, 20.0)
    assert not [e for e in events if isinstance(e, Straggler)]
    assert not list((tmp_path / "logs").glob("*/stragglers/*"))


# A busy process on one core, until its parent (a worker) is gone.
BUSY = """
import os, sys
os.sched_setaffinity(0, {int(sys.argv[1])})
while os.getppid() == int(sys.argv[2]):
    pass
"""


def starved_steps(step: float, seconds: float, stop: str) -> float:
    """Balanced `steps`, but rank 1's main thread shares a core with two busy processes, at
    the lowest priority (SCHED_IDLE): after each sleep it waits for the CPU, as a rank on a
    busy node does. Returns the share of the time its main thread spent on the run queue."""
    import subprocess
    import sys

    import torch.distributed as dist

    if dist.get_rank() != 1:
        steps(step, -1, 1.0, seconds, stop)
        return 0.0
    cpu = max(os.sched_getaffinity(0))
    busy = [
        subprocess.Popen([sys.executable, "-c", BUSY, str(cpu), str(os.getpid())]) for _ in range(2)
    ]
    try:
        os.sched_setaffinity(0, {cpu})  # this thread only: the inbox thread still answers
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        began, queued = time.monotonic(), _queued()
        steps(step, -1, 1.0, seconds, stop)
        return (_queued() - queued) / (time.monotonic() - began)
    finally:
        for process in busy:
            process.kill()
            process.wait()


def _queued() -> float:
    """Seconds this thread spent on the run queue (Linux's schedstat)."""
    with open(f"/proc/self/task/{threading.get_native_id()}/schedstat", encoding="ascii") as f:
        return int(f.read().split()[1]) / 1e9


def test_a_rank_that_waits_for_a_busy_cpu_is_not_named_a_straggler(tmp_path: Path) -> None:
    events: list[Event] = []
    result = slurmrun.launch(
        starved_steps, (0.1, 20.0, str(tmp_path / "stop")), workers_per_host=2,
        backend="gloo", on_event=events.append,
    )  # fmt: skip
    starved = result.rank(1)
    assert starved >= 0.05, starved  # it did wait for the CPU, a while after each sleep
    assert not [e for e in events if isinstance(e, Straggler)], starved
    print(f"rank 1 waited for a CPU {starved:.0%} of the time; not named")


def answers_for(seconds: float) -> int:
    """How many stacks requests this worker answered in `seconds` (its inbox's answers)."""
    from slurmrun.node import inbox

    answered = []
    real = inbox._answer

    def counted(*args: object) -> None:
        answered.append(1)
        real(*args)  # type: ignore[arg-type]

    inbox._answer = counted
    time.sleep(seconds)
    inbox._answer = real
    return len(answered)


def test_sampling_is_on_by_default_off_for_one_rank_once_a_second_for_a_hang_timeout_alone() -> (
    None
):
    judged = slurmrun.launch(answers_for, (2.0,), workers_per_host=2, backend=None).values()
    assert all(n >= 6 for n in judged), judged  # stragglers, by default: four times a second
    alone = slurmrun.launch(answers_for, (2.0,), workers_per_host=1, backend=None).rank(0)
    assert alone == 0  # one rank is no one's straggler
    off = slurmrun.launch(
        answers_for, (2.0,), workers_per_host=2, backend=None, stragglers=False
    ).values()
    assert off == [0, 0], off
    sampled = slurmrun.launch(
        answers_for, (4.0,), workers_per_host=2, backend=None, stragglers=False,
        hang_timeout=600.0,
    ).values()  # fmt: skip
    assert all(3 <= n <= 5 for n in sampled), sampled  # calm: once a second, not four times


def hold_the_gil_while_sampled(dumped: str) -> str:
    """Seconds in C code that holds the GIL, with the stacks signal's dump sent to `dumped`."""
    import faulthandler
    import re

    from slurmrun.stacks import stacks_signal

    with open(dumped, "w", encoding="utf-8") as f:
        faulthandler.register(stacks_signal(), file=f, all_threads=True, chain=False)
        time.sleep(0.6)  # sampled: the worker's own thread answers
        re.match(r"(x+x+)+y", "x" * 27)  # ~2 s; no thread of this worker can answer meanwhile
    return Path(dumped).read_text(encoding="utf-8")


def test_a_sample_never_dumps_a_worker_that_holds_the_gil(tmp_path: Path) -> None:
    dumped = slurmrun.launch(
        hold_the_gil_while_sampled, (str(tmp_path / "dump"),), workers_per_host=1,
        backend=None, hang_timeout="auto",  # one rank: sampled four times a second for this
    ).rank(0)  # fmt: skip
    assert dumped == "", dumped  # the stacks signal never came: no faulthandler dump


def test_a_sample_never_waits_for_a_worker_that_reads_nothing() -> None:
    """A sample is passed on from the agent's thread that reads the launcher: a worker whose C
    code holds its GIL reads no request, and once its socket is full a send would hold that
    thread (no END, no Ctrl-C handled). The worker is silent in that sample instead."""
    agent_side, worker_side = socket.socketpair()
    launcher_side, agent_to_launcher = socket.socketpair()
    sentinel, never_written = os.pipe()
    try:
        agent_side.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:  # what the silent worker left unread
                agent_side.send(b"\0" * 65536)
        agent_side.setblocking(True)
        worker = WorkerLink(
            0, process=WorkerProcess(pid=os.getpid(), sentinel=sentinel),
            conn=Connection(agent_side), streams=worker_side,
        )  # fmt: skip
        ask = protocol.AskStacks(run=1, request=7, purpose=protocol.StacksPurpose.SAMPLE.value)
        done = threading.Event()

        def sample() -> None:
            ask_workers([worker], Connection(agent_to_launcher), ask)
            done.set()

        threading.Thread(target=sample, daemon=True).start()
        assert done.wait(5.0), "the agent's thread waited for a worker that reads nothing"
        frame = Connection(launcher_side).recv()
        assert frame is not None
        answer = protocol.parse(frame.header)
        assert isinstance(answer, protocol.Stacks), answer
        assert (answer.request, answer.source) == (7, StackSource.SILENT.value), answer
    finally:
        for sock in (agent_side, worker_side, launcher_side, agent_to_launcher):
            sock.close()  # ends the sample's thread too, if it was stuck
        os.close(sentinel)
        os.close(never_written)
