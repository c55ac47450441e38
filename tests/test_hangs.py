"""Hangs failed with HangError from sampled stacks, on localhost with gloo."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

import slurmrun
from slurmrun.events import Event, Restarting
from slurmrun.stacks.report import StackSource


@pytest.fixture(autouse=True)
def _logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path / "logs"))


def hang_in_rank_1(steps: int, step: float, hung: str) -> int:
    """`steps` steps of `step` s, then rank 1 waits for ever outside the collective (the first
    attempt only: a restart finishes)."""
    import os
    import pathlib

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    restarted = int(os.environ.get("SLURMRUN_RESTART_COUNT", "0")) > 0
    for _ in range(steps):
        time.sleep(step)
        dist.all_reduce(torch.ones(1))
    if rank == 1 and not restarted:
        pathlib.Path(hung).write_text(str(time.time()))

        def load_the_next_batch() -> None:
            time.sleep(3600)

        load_the_next_batch()
    dist.all_reduce(torch.ones(1))
    return rank


def test_a_rank_stuck_outside_the_collective_fails_the_run_with_hang_error(
    tmp_path: Path,
) -> None:
    hung = tmp_path / "hung"
    with pytest.raises(slurmrun.HangError) as caught:
        slurmrun.launch(
            hang_in_rank_1, (3, 0.2, str(hung)), workers_per_host=2, backend="gloo",
            hang_timeout=2.0, flight_recorder=True,
        )  # fmt: skip
    took = time.time() - float(hung.read_text())
    error = caught.value
    assert took < 2.0 + 5.0, took
    assert error.stuck == (1,)
    text = str(error)
    assert "rank 0 waited in a collective while rank 1 did not join it" in text, text
    assert "rank 0 (localhost): waiting: all_reduce (distributed_c10d.py:" in text, text
    assert "rank 1 (localhost): working: load_the_next_batch (test_hangs.py:" in text, text
    assert Path(error.stacks_file).is_file()
    assert f"(every thread's stacks: {error.stacks_file})" in text, text
    notes = "\n".join(getattr(error, "__notes__", []))
    assert "where the ranks still running were" not in notes  # no second dump: it has them
    # gloo's flight recorder (torch 2.6 and later): rank 0 began a collective rank 1 did not.
    dumps = [Path(f) for f in error.flight_recorder]
    assert [f.name for f in dumps] == ["nccl_trace_rank_0", "nccl_trace_rank_1"], dumps
    assert all(f.parent.name == "flight_recorder" and f.stat().st_size for f in dumps)
    last = dict(re.findall(r"^rank (\d): gloo:all_reduce #(\d+)", text, re.MULTILINE))
    assert int(last["0"]) == int(last["1"]) + 1, text
    print(f"HangError {took:.1f} s after the hang (hang_timeout 2 s)")


def test_a_hang_is_restarted_by_max_restarts(tmp_path: Path) -> None:
    events: list[Event] = []
    result = slurmrun.launch(
        hang_in_rank_1, (2, 0.1, str(tmp_path / "hung")), workers_per_host=2, backend="gloo",
        hang_timeout=2.0, max_restarts=1, on_event=events.append,
    )  # fmt: skip
    assert result.return_values == [[0, 1]]
    restarting = [e for e in events if isinstance(e, Restarting)]
    assert [e.error for e in restarting] == ["HangError"]


def test_hang_timeout_auto_calibrates_on_the_gaps_between_collectives(tmp_path: Path) -> None:
    hung = tmp_path / "hung"
    with pytest.raises(slurmrun.HangError, match=r"hang_timeout \d") as caught:
        slurmrun.launch(
            hang_in_rank_1, (8, 1.0, str(hung)), workers_per_host=2, backend="gloo",
            hang_timeout="auto",
        )  # fmt: skip
    took = time.time() - float(hung.read_text())
    assert took < 5 * 1.0 + 3.0, took  # the floor (5 s) and a sample's latency
    assert caught.value.stuck == (1,)
    print(f"HangError {took:.1f} s after the hang (hang_timeout auto, steps of 1 s)")


def all_reduce_for(seconds: float) -> int:
    """Nothing but collectives: nearly every sample finds every rank in the same all_reduce."""
    import torch
    import torch.distributed as dist

    data = torch.ones(1 << 16)
    end = time.monotonic() + seconds
    count = 0
    while True:
        for _ in range(500):
            dist.all_reduce(data)
        count += 500
        flag = torch.tensor([1.0 if time.monotonic() > end else 0.0])
        dist.all_reduce(flag)
        if flag.item() > 0:
            return count


def test_ranks_busy_in_one_collective_after_another_do_not_hang() -> None:
    result = slurmrun.launch(
        all_reduce_for, (6.0,), workers_per_host=2, backend="gloo", hang_timeout=1.0
    )
    assert result.return_values[0][0] > 10


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "soon", True])
def test_hang_timeout_must_be_positive_seconds_or_auto(bad: object) -> None:
    with pytest.raises(slurmrun.OptionsError, match="hang_timeout must be"):
        slurmrun.launch(all_reduce_for, (0,), workers_per_host=1, hang_timeout=bad)  # type: ignore[arg-type]


def hold_the_gil_in_rank_1(hung: str) -> int:
    """Rank 1 holds its GIL in C code (a regex backtracking) while rank 0 waits for it."""
    import pathlib
    import re

    import torch
    import torch.distributed as dist

    for _ in range(3):
        time.sleep(0.2)
        dist.all_reduce(torch.ones(1))
    if dist.get_rank() == 1:
        pathlib.Path(hung).write_text(str(time.time()))
        re.match(r"(x+x+)+y", "x" * 29)  # ~9 s: no sample is answered meanwhile
    dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def test_a_hang_in_c_code_holding_the_gil_is_dumped_for_its_report(tmp_path: Path) -> None:
    hung = tmp_path / "hung"
    with pytest.raises(slurmrun.HangError) as caught:
        slurmrun.launch(
            hold_the_gil_in_rank_1, (str(hung),), workers_per_host=2, backend="gloo",
            hang_timeout=2.0,
        )  # fmt: skip
    took = time.time() - float(hung.read_text())
    assert took < 2.0 + 5.0, took
    error = caught.value
    assert error.stuck == (1,)
    rank1 = error.report.ranks[1]
    assert rank1.source is StackSource.FAULTHANDLER, rank1  # the hang's report dumps it
    assert "hold_the_gil_in_rank_1" in [f.function for t in rank1.threads for f in t.frames]
    print(f"HangError {took:.1f} s after the hang (hang_timeout 2 s)")
