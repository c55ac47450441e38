"""One classifier of stacks: waiting in a collective, working, or idle in slurmrun's code."""

from __future__ import annotations

import os
import threading
import time

import pytest

import slurmrun
from slurmrun.stacks.classify import Activity, activity, hot_frame, thread_activity
from slurmrun.stacks.report import (
    Frame,
    RankStacks,
    StackSource,
    ThreadStack,
    capture,
    parse_capture,
)

SITE = "/venv/lib/python3.11/site-packages"
C10D = f"{SITE}/torch/distributed/distributed_c10d.py"
LOGGER = f"{SITE}/torch/distributed/c10d_logger.py"
OURS = os.path.join(os.path.dirname(slurmrun.__file__), "node", "worker.py")
TRAIN = "/work/train.py"
CUDA = f"{SITE}/torch/cuda/__init__.py"
LOADER = f"{SITE}/torch/utils/data/dataloader.py"
THREADING = threading.__file__


def _thread(*frames: tuple[str, int, str] | tuple[str, int, str, str]) -> ThreadStack:
    return ThreadStack("MainThread", tuple(Frame(*f) for f in frames))


def _rank(*threads: ThreadStack) -> RankStacks:
    return RankStacks(0, "node1", 0, threads, StackSource.PYTHON)


@pytest.mark.parametrize(
    ("frames", "expected"),
    [
        # a collective, through torch's logging wrapper
        (
            [(TRAIN, 10, "step"), (LOGGER, 83, "wrapper"), (C10D, 2810, "all_reduce")],
            Activity.WAITING,
        ),
        ([(TRAIN, 10, "step"), (C10D, 4500, "barrier")], Activity.WAITING),
        ([(TRAIN, 10, "step"), (C10D, 4500, "broadcast")], Activity.WAITING),
        ([(TRAIN, 10, "step"), (C10D, 4500, "reduce_scatter_tensor")], Activity.WAITING),
        ([(TRAIN, 10, "step"), (C10D, 4500, "recv")], Activity.WAITING),
        ([(TRAIN, 10, "step"), (CUDA, 900, "synchronize")], Activity.WAITING),
        # a work handle's wait is C: the user's line shows it
        ([(TRAIN, 12, "step", "work.wait()")], Activity.WAITING),
        # torch.distributed, but no collective: working
        ([(TRAIN, 10, "step"), (C10D, 1200, "get_rank")], Activity.WORKING),
        # a Python wait (threading) is not a collective
        ([(TRAIN, 10, "step", "event.wait()"), (THREADING, 320, "wait")], Activity.WORKING),
        ([(TRAIN, 10, "step"), (LOADER, 631, "__next__")], Activity.WORKING),
        ([(TRAIN, 10, "step", "time.sleep(0.3)")], Activity.WORKING),
        ([(OURS, 400, "main"), (OURS, 300, "next_call")], Activity.IDLE),
        ([], Activity.UNKNOWN),
    ],
)
def test_thread_activity_names_collectives_waits_work_and_slurmruns_own_code(
    frames: list[tuple[str, int, str]], expected: Activity
) -> None:
    assert thread_activity(_thread(*frames)) is expected


def test_a_rank_is_what_its_main_thread_is() -> None:
    waiting = _thread((TRAIN, 10, "step"), (C10D, 2810, "all_reduce"))
    working = _thread((TRAIN, 30, "prefetch"))
    assert activity(_rank(waiting, working)) is Activity.WAITING
    assert activity(_rank(working, waiting)) is Activity.WORKING
    assert activity(RankStacks(3, "n", 0, (), StackSource.NONE, "exited")) is Activity.UNKNOWN


def test_the_hot_frame_is_the_innermost_of_the_users_code() -> None:
    loading = _thread(
        (TRAIN, 120, "main"),
        (TRAIN, 61, "train_step"),
        (LOADER, 631, "__next__"),
    )
    assert hot_frame(_rank(loading)) == Frame(TRAIN, 61, "train_step")
    only_torch = _thread((f"{SITE}/torch/nn/modules/module.py", 1500, "_call_impl"))
    assert hot_frame(_rank(only_torch)) == only_torch.frames[-1]
    assert hot_frame(RankStacks(3, "n", 0, (), StackSource.NONE)) is None


def test_a_real_capture_of_a_thread_sleeping_in_the_users_code_is_working() -> None:
    started = threading.Event()

    def sleeping_in_user_code() -> None:
        started.set()
        time.sleep(2)

    worker = threading.Thread(target=sleeping_in_user_code, daemon=True)
    worker.start()
    started.wait(5)
    time.sleep(0.1)
    threads = parse_capture(capture(skip={threading.get_ident()}))
    mine = next(t for t in threads if t.frames and t.frames[-1].function == "sleeping_in_user_code")
    assert thread_activity(mine) is Activity.WORKING
