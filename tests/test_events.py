"""Launch events and timings (slurmrun.events), on localhost with real agents and workers."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from pathlib import Path

import pytest

import slurmrun
from slurmrun import events
from slurmrun.errors import WorkerFailedError


def pid_of_rank() -> int:
    return os.getpid()


def fail_on_rank_1() -> int:
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 fails")
    return 0


def die_on_rank_1() -> int:
    if os.environ["RANK"] == "1":
        print("last words", flush=True)
        os._exit(3)
    return 0


def test_a_launch_reports_its_events_in_order_with_real_pids_and_timings() -> None:
    seen: list[events.Event] = []
    result = slurmrun.launch(pid_of_rank, workers_per_host=2, backend="gloo", on_event=seen.append)
    kinds = [e.kind for e in seen]
    assert kinds == ["launch_started", "agent_connected", "workers_started", "launch_finished"]
    assert len({e.launch_id for e in seen}) == 1
    assert all(dataclasses.is_dataclass(e) for e in seen)
    with pytest.raises(dataclasses.FrozenInstanceError):
        seen[0].time = 0.0  # type: ignore[misc]
    started, _, workers, finished = seen
    assert isinstance(started, events.LaunchStarted)
    assert started.hosts == ("localhost",) and started.world_size == 2
    assert isinstance(workers, events.WorkersStarted)
    assert workers.pids == tuple(result.values())  # the workers' own os.getpid()
    assert isinstance(finished, events.LaunchFinished) and finished.ok and finished.error is None
    assert list(result.timings) == list(events.TIMING_KEYS)
    values = list(result.timings.values())
    assert values == sorted(values) and values[0] > 0
    assert finished.timings == result.timings
    assert [e.time for e in seen] == sorted(e.time for e in seen)


def test_an_event_is_built_whole_and_the_trace_stamps_its_launch_and_time() -> None:
    """`trace.emit(Stalled(...))`: the event is built with every field of its own (none has a
    default to hide a forgotten one), and the trace adds its launch id and the time."""
    with pytest.raises(TypeError, match="summary"):
        events.Stalled(seconds=1.0, stacks_file="")  # type: ignore[call-arg]
    seen: list[events.Event] = []
    trace = events.Trace(seen.append)
    trace.emit(events.Stalled(seconds=2.0, summary="s", stacks_file="f"))
    trace.finish(None)
    stalled, finished = seen
    assert stalled == events.Stalled(
        launch_id=trace.launch_id, time=stalled.time, seconds=2.0, summary="s", stacks_file="f"
    )
    assert stalled.time > 0 and finished.launch_id == trace.launch_id


def test_a_failed_launch_ends_with_launch_finished_and_its_timings_on_the_exception() -> None:
    seen: list[events.Event] = []
    with pytest.raises(ValueError, match="rank 1 fails") as info:
        slurmrun.launch(fail_on_rank_1, workers_per_host=2, backend=None, on_event=seen.append)
    assert seen[0].kind == "launch_started" and seen[-1].kind == "launch_finished"
    failed = [e for e in seen if isinstance(e, events.WorkerFailed)]
    assert len(failed) == 1 and failed[0].local_rank == 1 and failed[0].error == "ValueError"
    assert "rank 1 fails" in failed[0].last_lines
    finished = seen[-1]
    assert isinstance(finished, events.LaunchFinished)
    assert not finished.ok and finished.error == "ValueError"
    timings = info.value.timings  # type: ignore[attr-defined]
    assert "agents_connected" in timings and "total" in timings
    assert "last_result" not in timings or timings["last_result"] <= timings["total"]


def test_a_dead_worker_restart_and_final_failure_are_reported() -> None:
    seen: list[events.Event] = []
    with pytest.raises(WorkerFailedError):
        slurmrun.launch(
            die_on_rank_1, workers_per_host=2, backend=None, max_restarts=1, on_event=seen.append
        )
    kinds = [e.kind for e in seen]
    assert kinds[0] == "launch_started" and kinds[-1] == "launch_finished"
    assert kinds.count("worker_failed") == 2 and kinds.count("restarting") == 1
    died = next(e for e in seen if isinstance(e, events.WorkerFailed))
    assert died.exitcode == 3 and died.signal is None and "last words" in died.last_lines
    restarting = next(e for e in seen if isinstance(e, events.Restarting))
    assert restarting.attempt == 1 and restarting.error == "WorkerFailedError"
    assert kinds.index("restarting") < len(kinds) - 1


def test_a_raising_or_stuck_handler_never_breaks_or_stalls_the_launch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = threading.Event()

    def raising(event: events.Event) -> None:
        raise RuntimeError(f"handler bug on {event.kind}")

    def stuck(event: events.Event) -> None:
        release.wait(60)  # released below: the launch must not wait for it

    try:
        with caplog.at_level(logging.WARNING, logger="slurmrun"):
            assert slurmrun.launch(lambda: 7, workers_per_host=1, on_event=raising).rank(0) == 7
            assert slurmrun.launch(lambda: 8, workers_per_host=1, on_event=stuck).rank(0) == 8
    finally:
        release.set()
    messages = [r.getMessage() for r in caplog.records]
    assert any("event handler" in m and "failed on launch_started" in m for m in messages)
    assert any("failed on launch_finished" in m for m in messages)
    assert any("did not finish within" in m for m in messages)


def test_events_go_to_logging_and_to_the_json_lines_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "events.jsonl"
    monkeypatch.setenv(events.EVENTS_FILE_VAR, str(path))
    with caplog.at_level(logging.INFO, logger="team.metrics"):
        slurmrun.launch(lambda: 1, workers_per_host=1, on_event=events.log_events("team.metrics"))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["kind"] == "launch_started"
    assert lines[-1]["kind"] == "launch_finished" and lines[-1]["ok"] is True
    assert list(lines[-1]["timings"]) == list(events.TIMING_KEYS)
    records = [r for r in caplog.records if r.name == "team.metrics"]
    assert [r.event.kind for r in records] == [d["kind"] for d in lines]  # type: ignore[attr-defined]
    assert records[0].getMessage().startswith("launch_started {")


def test_each_run_of_a_warm_launcher_is_a_launch_of_its_own() -> None:
    seen: list[events.Event] = []
    with slurmrun.Launcher(workers_per_host=1, backend=None, on_event=seen.append) as launcher:
        first = launcher.run(lambda: 1)
        second = launcher.run(lambda: 2)
    ids = list(dict.fromkeys(e.launch_id for e in seen))
    assert len(ids) == 2
    runs = [[e.kind for e in seen if e.launch_id == i] for i in ids]
    assert runs[0][0] == runs[1][0] == "launch_started"
    assert runs[0][-1] == runs[1][-1] == "launch_finished"
    assert "agent_connected" in runs[0] and "agent_connected" not in runs[1]  # kept agents
    assert "workers_started" in runs[1]
    assert first.rank(0) == 1 and second.rank(0) == 2
    assert list(second.timings) == list(events.TIMING_KEYS)
