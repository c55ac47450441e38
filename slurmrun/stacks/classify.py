"""What a rank is doing, read from its stack: waiting for the others, working, or idle.

One classifier for every reader of stacks: ``slurmrun stacks`` labels each group of ranks with
it (`slurmrun.stacks.report.StackReport.summary`), and the launcher's sampling of a running
job finds stragglers and hangs with it (`slurmrun.launcher.stragglers`). A thread **waits**
when it is inside a collective or a barrier of `torch.distributed` (``all_reduce``,
``barrier``, ``broadcast``, ``send``/``recv``, ...; gloo and NCCL wait under these calls), in
``torch.cuda.synchronize`` or a future's ``wait``, or on a line that calls ``.wait()`` on
something written in C (a `torch.distributed` work handle); it is **idle** when every frame is
slurmrun's own (a worker before or after the function, between a warm launcher's runs); else
it **works**. A rank is what its first thread (the main thread) is.

Standard library only, as the report it reads.
"""

from __future__ import annotations

import enum
import os
import re

from slurmrun.stacks.frames import (
    Frame,
    RankStacks,
    ThreadStack,
    is_ours,
    is_ours_or_stdlib,
    where,
)

__all__ = ["COLLECTIVES", "Activity", "activity", "hot_frame", "thread_activity", "where"]

# The functions of torch/distributed/ in which a rank waits for others.
COLLECTIVES = frozenset(
    {
        "all_gather",
        "all_gather_coalesced",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_reduce",
        "all_reduce_coalesced",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "batch_isend_irecv",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "init_process_group",
        "monitored_barrier",
        "new_group",
        "recv",
        "recv_object_list",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "send",
        "send_object_list",
        "_store_based_barrier",
        "wait",
    }
)
_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep
_SYNCHRONIZERS = (  # (where, function): waits of torch outside torch/distributed/
    (os.sep + os.path.join("torch", "cuda") + os.sep, "synchronize"),
    (os.sep + os.path.join("torch", "futures") + os.sep, "wait"),
)
_WAIT_CALL = re.compile(r"\.wait\(\s*\)")


class Activity(enum.Enum):
    """What a rank (or a thread) is doing, as its stack shows it."""

    WAITING = "waiting"  # in a collective, a barrier, a synchronisation
    WORKING = "working"  # anything else of the user's code
    IDLE = "idle"  # in slurmrun's own code only (before or after the function)
    UNKNOWN = "unknown"  # no stack (exited, no answer)


def _waits(frame: Frame) -> bool:
    if _DISTRIBUTED in frame.filename:
        return frame.function in COLLECTIVES
    return any(d in frame.filename and frame.function == f for d, f in _SYNCHRONIZERS)


def thread_activity(thread: ThreadStack) -> Activity:
    """What one thread is doing (see the module's docstring)."""
    frames = thread.frames
    if not frames:
        return Activity.UNKNOWN
    if any(_waits(frame) for frame in frames):
        return Activity.WAITING
    innermost = frames[-1]
    # ``work.wait()``: a C method, so the user's line is the innermost frame; a Python wait
    # (threading, queue, subprocess) would have frames of its own inside.
    if _WAIT_CALL.search(innermost.line) and not is_ours_or_stdlib(innermost.filename):
        return Activity.WAITING
    if all(is_ours(frame.filename) for frame in frames):
        return Activity.IDLE
    return Activity.WORKING


def activity(stacks: RankStacks) -> Activity:
    """What a rank is doing: what its first thread (the main thread) is doing."""
    if not stacks.threads:
        return Activity.UNKNOWN
    return thread_activity(stacks.threads[0])


def hot_frame(stacks: RankStacks) -> Frame | None:
    """Where a rank's main thread is in the user's code.

    Its innermost frame outside the standard library, installed packages and slurmrun (else
    its innermost frame); None without one.
    """
    if not stacks.threads or not stacks.threads[0].frames:
        return None
    frames = stacks.threads[0].frames
    for frame in reversed(frames):
        if not is_ours_or_stdlib(frame.filename) and not _installed(frame.filename):
            return frame
    return frames[-1]


def _installed(filename: str) -> bool:
    return any(d in filename for d in (os.sep + "site-packages" + os.sep, "dist-packages"))
