"""The words of a stack: frames, threads, a rank's stacks, and whose file a frame is in.

The ground both `slurmrun.stacks.report` (captures and reports) and `slurmrun.stacks.classify`
(what a rank does) stand on. Standard library only: every worker imports this.
"""

from __future__ import annotations

import enum
import os
import threading
from dataclasses import dataclass

from slurmrun.stacks.sched import Sched

__all__ = [
    "NOT_STDLIB",
    "OURS",
    "PACKAGE",
    "STDLIB_DIR",
    "Frame",
    "RankStacks",
    "StackSource",
    "ThreadStack",
    "is_ours",
    "is_ours_or_stdlib",
    "is_plumbing",
    "where",
]

PACKAGE = os.path.dirname(os.path.dirname(__file__))  # slurmrun/, above slurmrun/stacks/
OURS = (os.path.abspath(PACKAGE) + os.sep, PACKAGE + os.sep)
STDLIB_DIR = os.path.dirname(os.path.abspath(threading.__file__)) + os.sep
NOT_STDLIB = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


class StackSource(enum.Enum):
    """How a rank's stacks were obtained."""

    PYTHON = "python"  # the worker's own thread answered (sys._current_frames)
    FAULTHANDLER = "faulthandler"  # the signal-safe fallback (a worker holding the GIL in C code)
    NONE = "none"  # no stacks (exited, its agent gone, ...: the note says why)
    # Alive, but it did not answer in time (C code holding the GIL): a sample's answer, which
    # never dumps it (`slurmrun.protocol.StacksPurpose`), or an answer that came too late.
    SILENT = "silent"


@dataclass(frozen=True)
class Frame:
    """One frame: where, and the source text there, stripped ("" if unknown)."""

    filename: str
    lineno: int
    function: str
    line: str = ""


@dataclass(frozen=True)
class ThreadStack:
    """One thread's frames, outermost first (traceback order); `cut` frames were left out."""

    name: str
    frames: tuple[Frame, ...]
    cut: int = 0


@dataclass(frozen=True)
class RankStacks:
    """The threads of one rank, how they were obtained, and a note ("exited", "no answer ...")."""

    rank: int
    host: str
    local_rank: int
    threads: tuple[ThreadStack, ...]
    source: StackSource
    note: str = ""
    progress: int | None = None  # collectives begun (`slurmrun.protocol.Stacks`); None: unknown
    recorder: str = ""  # a hang's report: the rank's flight recorder dump ("": none)
    recorder_last: str = ""  # the last collective it recorded, in words
    sched: Sched | None = None  # its main thread's CPU and run-queue time so far; None: unknown


def is_ours(filename: str) -> bool:
    """Whether `filename` is one of slurmrun's own files."""
    return filename.startswith(OURS)


def is_plumbing(filename: str) -> bool:
    """Ours, or runpy's (which a worker's script mode and `python -m` run the user's code by)."""
    return is_ours(filename) or filename in ("<frozen runpy>", STDLIB_DIR + "runpy.py")


def is_ours_or_stdlib(filename: str) -> bool:
    """Whether `filename` is slurmrun's or the standard library's (not an installed package's)."""
    if is_ours(filename) or filename.startswith("<frozen "):
        return True
    return filename.startswith(STDLIB_DIR) and not any(d in filename for d in NOT_STDLIB)


def where(frame: Frame) -> str:
    """A frame in a few words: ``function (file.py:line)``."""
    return f"{frame.function} ({os.path.basename(frame.filename)}:{frame.lineno})"
