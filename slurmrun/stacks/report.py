"""Python stacks of a process, and a report of many ranks grouped by identical stack.

A worker answers a stacks request with `capture()` (compact JSON, bounded); the launcher turns
each answer back into threads with `parse_capture()` (or `parse_faulthandler()` for the
signal-safe fallback's text), and a `StackReport` groups the ranks so that 1000 ranks waiting in
the same collective read as one line. Standard library only: every worker imports this.
"""

from __future__ import annotations

import json
import linecache
import os
import re
import sys
import threading
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from slurmrun.stacks.classify import activity
from slurmrun.stacks.frames import (
    OURS,
    STDLIB_DIR,
    Frame,
    RankStacks,
    StackSource,
    ThreadStack,
    is_ours,
    is_ours_or_stdlib,
    is_plumbing,
    where,
)

__all__ = [
    "MAX_CAPTURE_BYTES",
    "MAX_FRAMES",
    "MAX_THREADS",
    "Frame",
    "RankStacks",
    "StackReport",
    "StackSource",
    "ThreadStack",
    "capture",
    "is_ours",
    "is_ours_or_stdlib",
    "parse_capture",
    "parse_faulthandler",
    "rank_ranges",
    "where",
]

MAX_THREADS = 64
MAX_FRAMES = 48
MAX_CAPTURE_BYTES = 256 * 1024

_FORMAT_VERSION = 1
_MAX_TEXT = 300  # characters kept of a filename, function name, source line or thread name
_MAX_COUNT = 10**9  # bound on the counts of frames and threads left out that parse_capture accepts
_MAX_HOSTS_SHOWN = 8
# As frames name our files: absolute, or relative when imported through a relative sys.path entry
# A thread in slurmrun's pdb: these files hold its frames from the user's stop inwards.
_DEBUGGER = tuple(os.path.join(d, "node", "debugger.py") for d in OURS)
_DEBUGGER_FILES = (
    *_DEBUGGER,
    *(os.path.join(d, "node", "pdb_session.py") for d in OURS),
    *(STDLIB_DIR + f for f in ("bdb.py", "pdb.py", "cmd.py")),
)
_BARE_ID = re.compile(r"(?:Current thread|Thread) 0x[0-9a-fA-F]+")
_LEFT_OUT = re.compile(r"\(\d+ more threads? left out\)")
_FH_HEADER = re.compile(r"(Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):")
_FH_FRAME = re.compile(r'\s+File "(.*)", line (\d+|\?\?\?) in (.*?)\s*')


def _short(text: str) -> str:
    return text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 3] + "..."


def _left_out_thread(count: int) -> ThreadStack:
    return ThreadStack(f"({count} more thread{'s' if count != 1 else ''} left out)", ())


def _thread_stack(name: str, top: FrameType | None) -> ThreadStack | None:
    """A thread's stack without our outer plumbing; None for one of our own helper threads."""
    codes: list[tuple[str, int, str]] = []  # innermost first
    frame = top
    while frame is not None:
        code = frame.f_code
        codes.append((code.co_filename, frame.f_lineno or 0, code.co_name))
        frame = frame.f_back
    # A helper thread's outer frames are threading's bootstrap, its inner ones queue/socket calls.
    if (
        name.startswith("slurmrun-")
        and any(is_ours(c[0]) for c in codes)
        and all(is_ours_or_stdlib(c[0]) for c in codes)
    ):
        return None
    name, codes = _out_of_the_debugger(name, codes)
    outer = len(codes)
    if outer > 1 and codes[-1][0] == "<string>" and is_ours(codes[-2][0]):
        outer -= 1  # a `python -c` bootstrap that calls us (the ssh starter's agent)
    while outer > 0 and is_plumbing(codes[outer - 1][0]):
        outer -= 1
    if outer == 0:  # wholly ours: keep it all
        outer = len(codes)
    kept = codes[: min(outer, MAX_FRAMES)]
    frames = tuple(
        Frame(_short(f), n, _short(fn), _short(linecache.getline(f, n).strip()) if n else "")
        for f, n, fn in reversed(kept)
    )
    return ThreadStack(_short(name), frames, outer - len(kept))


def _out_of_the_debugger(
    name: str, codes: list[tuple[str, int, str]]
) -> tuple[str, list[tuple[str, int, str]]]:
    """A thread stopped in slurmrun's pdb (`slurmrun.node.debugger`): from where it stopped.

    Its inner frames are the debugger's (bdb, pdb, cmd, ours) waiting for the user's line.
    """
    if not any(c[0].startswith(_DEBUGGER) for c in codes):
        return name, codes
    inner = max(i for i, c in enumerate(codes) if c[0].startswith(_DEBUGGER_FILES))
    return f"{name} (in pdb)", codes[inner + 1 :]


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _encode_thread(thread: ThreadStack, budget: int) -> str | None:
    """The thread as JSON in at most `budget` characters, its outermost frames cut to fit.

    None if not even its innermost frame fits.
    """
    encoded = [_dumps([f.filename, f.lineno, f.function, f.line]) for f in thread.frames]
    name = _dumps(thread.name)
    room = budget - len(f"[{name},{thread.cut + len(encoded)},[]]")  # the longest cut count
    keep = 0
    for item in reversed(encoded):
        room -= len(item) + (keep > 0)  # and a comma
        if room < 0:
            break
        keep += 1
    if room < 0 and keep == 0:
        return None
    cut = thread.cut + len(encoded) - keep
    return f"[{name},{cut},[{','.join(encoded[len(encoded) - keep :])}]]"


def capture(skip: Collection[int] = ()) -> bytes:
    """Every Python thread's stack in this process, as compact JSON for `parse_capture()`.

    The main thread comes first. Frames of slurmrun's own package (and runpy's, and a ``python -c``
    bootstrap's that calls ours) at the outer end of a stack are dropped, so that it starts at the
    user's code; a stack that is wholly ours keeps its frames. Threads named "slurmrun-..." that
    run only our code (and the standard library's) are left out: our helpers. At most MAX_THREADS
    threads of at most MAX_FRAMES innermost frames each, in at most MAX_CAPTURE_BYTES; what is
    left out is counted (a thread's `cut`, a final "(N more threads left out)").

    Args:
        skip: Thread idents to leave out (the capturing thread, say).

    Returns:
        At most MAX_CAPTURE_BYTES bytes of JSON.
    """
    tops = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate() if t.ident is not None}
    main = threading.main_thread().ident
    # The main thread, the others in the order they started, then any threading does not know
    started = {ident: i for i, ident in enumerate(names)}
    order = sorted(tops, key=lambda ident: (ident != main, started.get(ident, len(started))))
    threads: list[ThreadStack] = []
    for ident in order:
        if ident in skip:
            continue
        stack = _thread_stack(names.get(ident, f"Thread 0x{ident:016x}"), tops[ident])
        if stack is not None:
            threads.append(stack)
    del tops  # frames hold locals alive
    envelope = f'{{"v":{_FORMAT_VERSION},"left_out":{len(threads)},"threads":[]}}'
    budget = MAX_CAPTURE_BYTES - len(envelope)
    parts: list[str] = []
    for thread in threads[:MAX_THREADS]:
        part = _encode_thread(thread, budget - len(parts))  # a comma for each part before
        if part is not None:  # else counted in left_out; a smaller one after it may still fit
            parts.append(part)
            budget -= len(part)
    text = (
        f'{{"v":{_FORMAT_VERSION},"left_out":{len(threads) - len(parts)},'
        f'"threads":[{",".join(parts)}]}}'
    )
    return text.encode("ascii")  # json.dumps escapes all else


def _count(value: Any, what: str) -> int:
    if type(value) is not int or not 0 <= value <= _MAX_COUNT:
        raise ValueError(f"stacks capture: {what} is {value!r}, not a count")
    return value


def _text(value: Any, what: str) -> str:
    if type(value) is not str or len(value) > _MAX_TEXT:
        raise ValueError(f"stacks capture: {what} is not a string of up to {_MAX_TEXT} characters")
    return value


def _list(value: Any, length: int | None, most: int, what: str) -> list[Any]:
    if type(value) is not list or len(value) > most or (length and len(value) != length):
        raise ValueError(f"stacks capture: {what} is not a list of the expected length")
    return value


def parse_capture(data: bytes | bytearray | memoryview) -> tuple[ThreadStack, ...]:
    """The threads of a `capture()` answer; a final "(N more threads left out)" if any were.

    Raises:
        ValueError: `data` is not a capture (it comes over the network: nothing is trusted).
    """
    raw = bytes(data)
    if len(raw) > MAX_CAPTURE_BYTES:
        raise ValueError(f"stacks capture: {len(raw)} bytes, more than {MAX_CAPTURE_BYTES}")
    try:
        top = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise ValueError(f"stacks capture: not JSON ({e.__class__.__name__})") from None
    if type(top) is not dict or set(top) != {"v", "left_out", "threads"}:
        raise ValueError("stacks capture: not an object with v, left_out and threads")
    if top["v"] != _FORMAT_VERSION or type(top["v"]) is not int:
        raise ValueError(f"stacks capture: version {top['v']!r}, expected {_FORMAT_VERSION}")
    left_out = _count(top["left_out"], "left_out")
    threads: list[ThreadStack] = []
    for i, item in enumerate(_list(top["threads"], None, MAX_THREADS, "threads")):
        name, cut, frames = _list(item, 3, 3, f"thread {i}")
        parsed: list[Frame] = []
        for j, entry in enumerate(_list(frames, None, MAX_FRAMES, f"thread {i}'s frames")):
            where = f"thread {i}, frame {j}"
            filename, lineno, function, line = _list(entry, 4, 4, where)
            filename, function = _text(filename, where), _text(function, where)
            parsed.append(Frame(filename, _count(lineno, where), function, _text(line, where)))
        threads.append(
            ThreadStack(_text(name, f"thread {i}: name"), tuple(parsed), _count(cut, "cut"))
        )
    if left_out:
        threads.append(_left_out_thread(left_out))
    return tuple(threads)


def parse_faulthandler(text: str) -> tuple[ThreadStack, ...]:
    """The threads of `faulthandler.dump_traceback(all_threads=True)` text, current thread first.

    Threads are named as the text shows them ("Thread 0x7f...", "Current thread 0x7f..."). A
    stack that faulthandler truncated ("...") counts one frame cut: at least one was. Garbled or
    partial text gives what parses; this never raises.
    """
    threads: list[ThreadStack] = []
    name: str | None = None
    frames: list[Frame] = []  # innermost first, as the text has them
    cut = 0

    def close() -> None:
        if name is not None:
            extra = max(0, len(frames) - MAX_FRAMES)  # the innermost are kept
            threads.append(ThreadStack(name, tuple(reversed(frames[:MAX_FRAMES])), cut + extra))

    for line in text.splitlines():
        header = _FH_HEADER.fullmatch(line.strip())
        if header:
            close()
            name, frames, cut = f"{header[1]} {header[2]}", [], 0
            continue
        frame = _FH_FRAME.fullmatch(line)
        if frame:
            if name is None:  # frames before any header: the text's start was lost
                name = "Thread (unknown)"
            lineno = int(frame[2]) if frame[2].isdigit() else 0
            frames.append(Frame(_short(frame[1]), lineno, _short(frame[3])))
        elif line.strip() == "..." and name is not None and line.startswith(" "):
            cut += 1
    close()
    threads.sort(key=lambda t: not t.name.startswith("Current thread"))
    if len(threads) > MAX_THREADS:
        threads[MAX_THREADS:] = [_left_out_thread(len(threads) - MAX_THREADS)]
    return tuple(threads)


def rank_ranges(ranks: Iterable[int]) -> str:
    """Ranks as ranges: [0, 1, 2, 3, 5, 7, 8] -> "0-3, 5, 7-8"."""
    runs: list[list[int]] = []
    for rank in sorted(set(ranks)):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _ranks_label(ranks: list[int]) -> str:
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {rank_ranges(ranks)}"


def _key(stacks: RankStacks) -> tuple[Any, ...]:
    if not stacks.threads:
        return ("none", stacks.note)
    return tuple(
        (
            None if _BARE_ID.fullmatch(t.name) else t.name,
            t.cut,
            tuple((f.filename, f.lineno, f.function) for f in t.frames),
        )
        for t in stacks.threads
    )


@dataclass(frozen=True)
class StackReport:
    """Every rank's stacks at one moment, and why they were asked for."""

    ranks: tuple[RankStacks, ...]
    why: str  # "asked", "no output for 60 s", "Ctrl-C", "the run failed"
    when: float  # time.time()

    def groups(self) -> list[tuple[list[int], RankStacks]]:
        """Ranks grouped by identical stacks, with the first rank's stacks, by first rank.

        Bare thread ids ("Thread 0x...") and source texts do not count; filenames, line numbers,
        functions, other thread names and the threads' order do. Ranks without stacks group by
        their note.
        """
        found: dict[tuple[Any, ...], list[RankStacks]] = {}
        for stacks in sorted(self.ranks, key=lambda r: r.rank):
            found.setdefault(_key(stacks), []).append(stacks)
        return [([r.rank for r in group], group[0]) for group in found.values()]

    def _summary_line(self, ranks: list[int], stacks: RankStacks) -> str:
        label = _ranks_label(ranks)
        if len(ranks) == 1:
            label += f" ({stacks.host})"
        if not stacks.threads:
            return f"{label}: no stacks" + (f": {stacks.note}" if stacks.note else "")
        frames = stacks.threads[0].frames
        if not frames:
            return f"{label}: no Python frame"
        word = activity(stacks).value
        return f"{label}: {word}: " + " <- ".join(where(f) for f in reversed(frames[-3:]))

    def summary(self) -> str:
        """One line per group: its ranks, what they do, the main thread's innermost frames.

        What they do is `slurmrun.stacks.classify`'s word (waiting, working, idle); then the
        main thread's three innermost frames.
        """
        return "\n".join(self._summary_line(ranks, stacks) for ranks, stacks in self.groups())

    def format(self) -> str:
        """The whole report: title, summary, then each group's stacks as Python prints them."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.when))
        count = len(self.ranks)
        out = [
            f"Python stacks of {count} rank{'s' if count != 1 else ''} at {stamp} ({self.why})",
            "",
            self.summary(),
        ]
        by_rank = {r.rank: r for r in self.ranks}
        for ranks, stacks in self.groups():
            hosts = list(dict.fromkeys(by_rank[r].host for r in ranks))
            shown = ", ".join(hosts[:_MAX_HOSTS_SHOWN])
            if len(hosts) > _MAX_HOSTS_SHOWN:
                shown += f" and {len(hosts) - _MAX_HOSTS_SHOWN} more hosts"
            out += ["", f"== {_ranks_label(ranks)} ({shown}) =="]
            out += _format_rank(stacks)
        return "\n".join(out) + "\n"

    def write(self, directory: str | os.PathLike[str]) -> Path:
        """Writes `format()` to directory/stacks-<YYYYmmdd-HHMMSS>.txt (-2, -3, ... if taken).

        Returns:
            The file's path. The directory is created if missing.

        Raises:
            FileExistsError: 1000 files of this second are there already.
        """
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        stem = "stacks-" + time.strftime("%Y%m%d-%H%M%S", time.localtime(self.when))
        text = self.format()
        for n in range(1, 1001):
            path = folder / (f"{stem}.txt" if n == 1 else f"{stem}-{n}.txt")
            try:
                with path.open("x", encoding="utf-8") as f:
                    f.write(text)
            except FileExistsError:
                continue
            return path
        raise FileExistsError(f"{folder}: {stem}.txt to {stem}-1000.txt exist; clean up old ones")


def _format_rank(stacks: RankStacks) -> list[str]:
    out: list[str] = []
    if stacks.note:
        out.append(f"note: {stacks.note}")
    if not stacks.threads:
        out.append("no stacks")
        return out
    faulthandler = stacks.source is StackSource.FAULTHANDLER
    if faulthandler:
        out.append("(stacks from faulthandler: no thread names, no source lines)")
    for thread in stacks.threads:
        if _LEFT_OUT.fullmatch(thread.name) and not thread.frames:
            out += ["", thread.name]
            continue
        title = thread.name if _BARE_ID.fullmatch(thread.name) else f"Thread {thread.name}"
        out += ["", f"{title} (most recent call last):"]
        if thread.cut:
            out.append(f"  ({'at least ' if faulthandler else ''}{thread.cut} more frames)")
        if not thread.frames:
            out.append("  <no Python frame>")
        for frame in thread.frames:
            out.append(f'  File "{frame.filename}", line {frame.lineno}, in {frame.function}')
            if frame.line:
                out.append(f"    {frame.line}")
    return out
