"""slurmrun.stacks: capturing a process's Python stacks, parsing them (ours and faulthandler's),
and the report that groups ranks by identical stack."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from slurmrun.stacks import report as stacks
from slurmrun.stacks.report import (
    MAX_CAPTURE_BYTES,
    MAX_FRAMES,
    MAX_THREADS,
    Frame,
    RankStacks,
    StackReport,
    StackSource,
    ThreadStack,
    capture,
    parse_capture,
    parse_faulthandler,
    rank_ranges,
)

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _line_of(path: Path, marker: str) -> int:
    """The line number of the one line of `path` that holds `marker`."""
    (line,) = [n for n, text in enumerate(path.read_text().splitlines(), 1) if marker in text]
    return line


def _wait_until_in(ident: int | None, function: str) -> None:
    """Waits (up to 5 s) until thread `ident`'s innermost Python frame is `function`."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        top = sys._current_frames().get(ident or 0)
        if top is not None and top.f_code.co_name == function:
            return
        time.sleep(0.005)
    raise AssertionError(f"thread {ident} never reached {function}")


# The user's script of a worker in script mode: slurmrun's run_script runs it with runpy, from a
# `python -c` bootstrap, as the ssh starter's agents do. It prints capture() from its main thread.
USER_SCRIPT = """\
import os, sys, threading, time
from slurmrun.cli.script import run_script
from slurmrun.stacks.report import capture
from slurmrun.waiting import wait_readable

event = threading.Event()
r, w = os.pipe()

def waiting_here():
    event.wait(20)  # waiting here

def until_in(thread, function):
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        top = sys._current_frames().get(thread.ident)
        if top is not None and function in (top.f_code.co_name, top.f_code.co_filename):
            return
        time.sleep(0.005)
    raise SystemExit(f"{thread.name} never reached {function}")

def main():
    user = threading.Thread(target=waiting_here, name="user-thread", daemon=True)
    ours = threading.Thread(target=wait_readable, args=([r], 20), name="slurmrun-poll", daemon=True)
    named = threading.Thread(target=waiting_here, name="slurmrun-but-user-code", daemon=True)
    calls = threading.Thread(
        target=run_script, args=(sys.argv[1], []), name="slurmrun-calls-user", daemon=True
    )
    waits = ((user, "wait"), (ours, "wait_readable"), (named, "wait"), (calls, sys.argv[1]))
    for thread, function in waits:
        thread.start()
        until_in(thread, function)
    sys.stdout.buffer.write(capture())  # capturing here

main()  # run main
"""


def test_capture_in_script_mode_shows_each_thread_from_the_users_code(tmp_path: Path) -> None:
    script = tmp_path / "user.py"
    script.write_text(USER_SCRIPT)
    other = tmp_path / "other.py"
    other.write_text("import time\ntime.sleep(20)\n")
    bootstrap = (
        "from slurmrun.cli.script import run_script; run_script(*sys.argv[1:2], sys.argv[2:])"
    )
    result = subprocess.run(
        [sys.executable, "-c", "import sys; " + bootstrap, str(script), str(other)],
        env=ENV,
        capture_output=True,
        timeout=30,
        check=True,
    )
    threads = parse_capture(result.stdout)
    # The main thread first; slurmrun's helper (all our code, named slurmrun-) left out.
    names = ["MainThread", "user-thread", "slurmrun-but-user-code", "slurmrun-calls-user"]
    assert [t.name for t in threads] == names
    main, user, named, calls = threads
    assert (calls.frames[-1].filename, calls.frames[-1].lineno) == (str(other), 2)
    # The main thread starts at the script (run_script, runpy and the -c bootstrap dropped).
    assert [(f.filename, f.lineno, f.function) for f in main.frames[:2]] == [
        (str(script), _line_of(script, "# run main"), "<module>"),
        (str(script), _line_of(script, "# capturing here"), "main"),
    ]
    assert main.frames[1].line == "sys.stdout.buffer.write(capture())  # capturing here"
    assert main.frames[-1].function == "capture"
    assert main.cut == 0
    for thread in (user, named):
        assert [f.function for f in thread.frames] == [
            "_bootstrap",
            "_bootstrap_inner",
            "run",
            "waiting_here",
            "wait",  # Event.wait
            "wait",  # Condition.wait
        ]
        here = thread.frames[3]
        assert (here.filename, here.lineno) == (str(script), _line_of(script, "# waiting here"))
        assert here.line == "event.wait(20)  # waiting here"


def waiting_here(event: threading.Event) -> None:
    event.wait(10)  # the test thread waits here


def test_capture_puts_the_main_thread_first_and_leaves_out_skipped_threads() -> None:
    event = threading.Event()
    thread = threading.Thread(target=waiting_here, args=(event,), name="the-waiter")
    thread.start()
    try:
        _wait_until_in(thread.ident, "wait")
        everything = parse_capture(capture())
        skipped = parse_capture(capture(skip={threading.get_ident()}))
    finally:
        event.set()
        thread.join(5)
    assert everything[0].name == "MainThread"
    assert "the-waiter" in [t.name for t in everything]
    (waiter,) = [t for t in everything if t.name == "the-waiter"]
    here = waiter.frames[-3]
    assert (here.filename, here.function) == (__file__, "waiting_here")
    assert here.lineno == waiting_here.__code__.co_firstlineno + 1  # its event.wait
    # pytest's stack is deeper than MAX_FRAMES: the innermost are kept, the rest counted
    main = everything[0]
    assert main.frames[-1].function == "capture"
    assert len(main.frames) + main.cut > 20
    assert "MainThread" not in [t.name for t in skipped]
    assert [t.name for t in skipped] == [t.name for t in everything if t.name != "MainThread"]


# A long source line on each frame, to fill the byte bound with fewer threads than MAX_THREADS
DEEP_MODULE = f"""\
def recurse(depth, event):
    if depth > 0:
        recurse(depth - 1, event)  # {"recursing " * 25}
    else:
        event.wait(10)
"""


def _import_deep_module(tmp_path: Path) -> Any:
    path = tmp_path / "deep_module.py"
    path.write_text(DEEP_MODULE)
    spec = importlib.util.spec_from_file_location("deep_module", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_capture_stays_within_its_byte_bound_and_counts_what_it_cut(tmp_path: Path) -> None:
    recurse = _import_deep_module(tmp_path).recurse
    event = threading.Event()
    threads = [
        threading.Thread(target=recurse, args=(300, event), name=f"deep-{i}")
        for i in range(MAX_THREADS + 6)
    ]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            _wait_until_in(thread.ident, "wait")
        # Only these threads: those of earlier tests in this process may still be alive.
        ours = {thread.ident for thread in threads}
        data = capture(skip={ident for ident in sys._current_frames() if ident not in ours})
    finally:
        event.set()
        for thread in threads:
            thread.join(5)
    assert len(data) <= MAX_CAPTURE_BYTES
    assert len(data) > MAX_CAPTURE_BYTES - 10_000  # filled, not cut far short
    *kept, note = parse_capture(data)
    assert 2 < len(kept) < MAX_THREADS  # the bytes ran out before the thread count
    left = len(threads) - len(kept)
    assert note == ThreadStack(f"({left} more threads left out)", ())
    # The first threads whole (their innermost MAX_FRAMES), then those the bytes' end cut
    # shorter: one, and after it any that still fit a few frames (which one, depends on the
    # lengths of the file names, the tmp path's among them).
    full = sum(len(t.frames) == MAX_FRAMES for t in kept)
    assert full >= 2 and all(len(t.frames) == MAX_FRAMES for t in kept[:full])
    assert all(len(t.frames) < MAX_FRAMES for t in kept[full:])
    for thread in kept:  # the innermost frames are kept: each thread's wait, then the recursion
        innermost = ["recurse", "wait", "wait"][-len(thread.frames) :]
        assert [f.function for f in thread.frames[-3:]] == innermost
        assert thread.cut == 3 + 301 + 2 - len(thread.frames)  # bootstrap, recurse, wait


def test_parse_capture_round_trips_a_capture_exactly() -> None:
    data = capture()
    threads = parse_capture(data)
    again = json.loads(data)
    assert again["left_out"] == 0
    assert [[t.name, t.cut, [[f.filename, f.lineno, f.function, f.line] for f in t.frames]]
            for t in threads] == again["threads"]  # fmt: skip
    assert all(isinstance(f, Frame) for t in threads for f in t.frames)


def _capture_with(**changes: object) -> bytes:
    top: dict[str, object] = {
        "v": 1,
        "left_out": 0,
        "threads": [["MainThread", 0, [["a.py", 3, "f", "x = 1"]]]],
    }
    top.update(changes)
    return json.dumps(top).encode()


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not json",
        b"\xff\xfe",
        b"[]",
        b"[" * 100_000,
        b"x" * (MAX_CAPTURE_BYTES + 1),
        _capture_with(v=2),
        _capture_with(v=True),
        _capture_with(extra=1),
        _capture_with(left_out=-1),
        _capture_with(left_out="3"),
        _capture_with(threads={}),
        _capture_with(threads=[["MainThread", 0]]),
        _capture_with(threads=[[1, 0, []]]),
        _capture_with(threads=[["t", True, []]]),
        _capture_with(threads=[["t", 0, [["a.py", "3", "f", ""]]]]),
        _capture_with(threads=[["t", 0, [["a.py", 3.0, "f", ""]]]]),
        _capture_with(threads=[["t", 0, [["a.py", -3, "f", ""]]]]),
        _capture_with(threads=[["t", 0, [["a.py", 3, "f"]]]]),
        _capture_with(threads=[["t", 0, [["a.py", 3, None, ""]]]]),
        _capture_with(threads=[["t", 0, [["a.py", 3, "f", "x" * 1000]]]]),
        _capture_with(threads=[["t", 0, [["a.py", 3, "f", ""]] * (MAX_FRAMES + 1)]]),
        _capture_with(threads=[["t", 0, []]] * (MAX_THREADS + 1)),
    ],
)
def test_parse_capture_rejects_what_is_not_a_capture(data: bytes) -> None:
    with pytest.raises(ValueError, match="stacks capture"):
        parse_capture(data)


def test_parse_capture_accepts_a_well_formed_one() -> None:
    assert parse_capture(memoryview(_capture_with(left_out=1))) == (
        ThreadStack("MainThread", (Frame("a.py", 3, "f", "x = 1"),)),
        ThreadStack("(1 more thread left out)", ()),
    )


FAULTHANDLER_SCRIPT = """\
import faulthandler, signal, sys, threading, time

event = threading.Event()

def waiting_here():
    event.wait(20)

def sleeping_here():
    print("ready", flush=True)
    time.sleep(20)

def dumping_here():
    faulthandler.dump_traceback(file=sys.stdout, all_threads=True)

thread = threading.Thread(target=waiting_here, daemon=True)
thread.start()
deadline = time.monotonic() + 5
while sys._current_frames()[thread.ident].f_code.co_name != "wait":
    assert time.monotonic() < deadline
    time.sleep(0.005)
if sys.argv[1] == "dump":
    dumping_here()
else:
    faulthandler.register(signal.SIGUSR1, file=open(sys.argv[2], "w"), all_threads=True)
    sleeping_here()
"""


def _script_line(start: str) -> int:
    """The number of the one line of FAULTHANDLER_SCRIPT that starts with `start`."""
    lines = FAULTHANDLER_SCRIPT.splitlines()
    (number,) = [n for n, line in enumerate(lines, 1) if line.startswith(start)]
    return number


def _wait_until_sleeping(pid: int) -> None:
    """Waits (up to 5 s) until the main thread of process `pid` sleeps (state S)."""
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "S":
        assert time.monotonic() < deadline
        time.sleep(0.001)


WAITING = ["_bootstrap", "_bootstrap_inner", "run", "waiting_here", "wait", "wait"]


def test_parse_faulthandler_reads_a_real_dump_current_thread_first() -> None:
    result = subprocess.run(
        [sys.executable, "-c", FAULTHANDLER_SCRIPT, "dump"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    threads = parse_faulthandler(result.stdout)
    assert len(threads) == 2
    current, other = threads
    assert current.name.startswith("Current thread 0x")
    assert [f.function for f in current.frames] == ["<module>", "dumping_here"]
    assert [(f.filename, f.lineno) for f in current.frames] == [
        ("<string>", _script_line("    dumping_here()")),
        ("<string>", _script_line("    faulthandler.dump_traceback(")),
    ]
    assert other.name.startswith("Thread 0x")
    assert [f.function for f in other.frames] == WAITING
    assert other.frames[3].lineno == _script_line("    event.wait(20)")
    assert all(f.line == "" for t in threads for f in t.frames)


def test_parse_faulthandler_reads_a_dump_from_a_signal_during_sleep(tmp_path: Path) -> None:
    out = tmp_path / "dump.txt"
    child = subprocess.Popen(
        [sys.executable, "-c", FAULTHANDLER_SCRIPT, "signal", str(out)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "ready\n"
        _wait_until_sleeping(child.pid)  # in time.sleep, not between the print and it
        child.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while not ("in <module>\n" in out.read_text() and "in _bootstrap\n" in out.read_text()):
            assert time.monotonic() < deadline, out.read_text()
            time.sleep(0.01)
    finally:
        child.kill()
        child.communicate(timeout=5)
    threads = parse_faulthandler(out.read_text())
    by_end = {t.frames[-1].function: t for t in threads}
    assert set(by_end) == {"sleeping_here", "wait"}
    main = by_end["sleeping_here"]
    assert [(f.function, f.lineno) for f in main.frames] == [
        ("<module>", _script_line("    sleeping_here()")),
        ("sleeping_here", _script_line("    time.sleep(20)")),
    ]
    assert [f.function for f in by_end["wait"].frames] == WAITING
    assert threads[0].name.startswith("Current thread 0x")


REAL_DUMP = """\
Thread 0x00007f0a1b2c3640 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/usr/lib/python3.11/threading.py", line 622 in wait
  File "/work/train.py", line 6 in waiting_here
  File "/usr/lib/python3.11/threading.py", line 975 in run
  ...

Current thread 0x00007f0a1c4d5740 (most recent call first):
  File "/work/train.py", line 12 in dumping_here
  File "/work/train.py", line ??? in <module>

Thread 0x00007f0a1d6e7f80 (most recent call first):
  <no Python frame>
"""


def test_parse_faulthandler_reads_truncated_stacks_unknown_lines_and_frameless_threads() -> None:
    assert parse_faulthandler(REAL_DUMP) == (
        ThreadStack(
            "Current thread 0x00007f0a1c4d5740",
            (Frame("/work/train.py", 0, "<module>"), Frame("/work/train.py", 12, "dumping_here")),
        ),
        ThreadStack(
            "Thread 0x00007f0a1b2c3640",
            (
                Frame("/usr/lib/python3.11/threading.py", 975, "run"),
                Frame("/work/train.py", 6, "waiting_here"),
                Frame("/usr/lib/python3.11/threading.py", 622, "wait"),
                Frame("/usr/lib/python3.11/threading.py", 320, "wait"),
            ),
            cut=1,
        ),
        ThreadStack("Thread 0x00007f0a1d6e7f80", ()),
    )


def test_parse_faulthandler_takes_what_parses_of_cut_or_garbled_text() -> None:
    for end in range(len(REAL_DUMP)):  # every prefix: a dump cut anywhere
        threads = parse_faulthandler(REAL_DUMP[:end])
        assert len(threads) <= 3
    cut = parse_faulthandler(REAL_DUMP[: REAL_DUMP.index("line 622")])
    assert [f.function for t in cut for f in t.frames] == ["wait"]
    junk = '\x00\udcff garbage\n  File "x\nThread 0xZZ (most recent\n' + REAL_DUMP[40:200]
    assert [t.name for t in parse_faulthandler(junk)] == ["Thread (unknown)"]
    assert parse_faulthandler("") == ()
    deep = "Thread 0x1 (most recent call first):\n" + "".join(
        f'  File "a.py", line {n} in f{n}\n' for n in range(60)
    )
    (thread,) = parse_faulthandler(deep + "  ...\n")
    assert [f.lineno for f in thread.frames] == list(range(MAX_FRAMES - 1, -1, -1))
    assert thread.cut == 60 - MAX_FRAMES + 1
    many = "".join(f"Thread 0x{i:x} (most recent call first):\n" for i in range(100))
    threads = parse_faulthandler(many)
    assert len(threads) == MAX_THREADS + 1
    assert threads[-1].name == f"({100 - MAX_THREADS} more threads left out)"


def test_rank_ranges() -> None:
    assert rank_ranges([0, 1, 2, 3, 5, 7, 8]) == "0-3, 5, 7-8"
    assert rank_ranges([8, 7, 7, 3]) == "3, 7-8"
    assert rank_ranges([4]) == "4"
    assert rank_ranges([]) == ""


def _stack(*where: tuple[str, int, str], name: str = "MainThread") -> ThreadStack:
    return ThreadStack(name, tuple(Frame(f, n, fn, f"line {n}") for f, n, fn in where))


COLLECTIVE = _stack(
    ("/work/train.py", 120, "main"),
    ("/work/train.py", 88, "train_step"),
    ("/torch/distributed/distributed_c10d.py", 2810, "all_reduce"),
)
LOADING = _stack(
    ("/work/train.py", 120, "main"),
    ("/work/train.py", 61, "train_step"),
    ("/torch/utils/data/dataloader.py", 631, "__next__"),
)
WHEN = 1_790_000_000.0


def _rank(rank: int, *threads: ThreadStack, **kw: object) -> RankStacks:
    host = f"node{1 + rank // 8}"
    source = StackSource.PYTHON if threads else StackSource.NONE
    return RankStacks(rank, host, rank % 8, threads, source, **kw)


def test_a_report_groups_ranks_with_the_same_stack_into_one_line() -> None:
    ranks = [_rank(r, LOADING if r == 7 else COLLECTIVE) for r in range(16)]
    report = StackReport(tuple(reversed(ranks)), "asked", WHEN)
    assert [(g, s.rank) for g, s in report.groups()] == [
        ([0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15], 0),
        ([7], 7),
    ]
    assert report.summary() == (
        "ranks 0-6, 8-15: waiting: all_reduce (distributed_c10d.py:2810)"
        " <- train_step (train.py:88) <- main (train.py:120)\n"
        "rank 7 (node1): working: __next__ (dataloader.py:631) <- train_step (train.py:61)"
        " <- main (train.py:120)"
    )


def test_grouping_ignores_bare_thread_ids_and_source_text_but_not_frames_or_order() -> None:
    other = _stack(("/work/train.py", 30, "prefetch"), name="Thread 0x00007f00000000a1")
    same_other = _stack(("/work/train.py", 30, "prefetch"), name="Thread 0x00007f00000000b2")
    other_line = ThreadStack(COLLECTIVE.name, tuple(Frame(f.filename, f.lineno, f.function, "?")
                                                    for f in COLLECTIVE.frames))  # fmt: skip
    report = StackReport(
        (
            _rank(0, COLLECTIVE, other),
            _rank(1, other_line, same_other),  # the same as 0
            _rank(2, same_other, COLLECTIVE),  # order differs
            _rank(3, COLLECTIVE, _stack(("/work/train.py", 31, "prefetch"))),  # a line differs
            _rank(4, COLLECTIVE, replace_name(other, "loader")),  # a real name differs
            _rank(5, note="exited"),
            _rank(6, note="no answer within 5 s"),
            _rank(9, note="exited"),
            _rank(10),
        ),
        "Ctrl-C",
        WHEN,
    )
    assert [g for g, _ in report.groups()] == [[0, 1], [2], [3], [4], [5, 9], [6], [10]]
    assert report.summary().splitlines()[4:] == [
        "ranks 5, 9: no stacks: exited",
        "rank 6 (node1): no stacks: no answer within 5 s",
        "rank 10 (node2): no stacks",
    ]


def replace_name(thread: ThreadStack, name: str) -> ThreadStack:
    return ThreadStack(name, thread.frames, thread.cut)


def test_format_prints_the_title_summary_and_each_groups_stacks_as_tracebacks() -> None:
    cut = ThreadStack("loader", LOADING.frames[-1:], cut=2)
    faulthandler = RankStacks(
        3,
        "node1",
        3,
        (
            ThreadStack("Current thread 0x00007f0a1c4d5740", LOADING.frames),
            ThreadStack("Thread 0x00007f0a1b2c3640", ()),
        ),
        StackSource.FAULTHANDLER,
        "held the GIL",
    )
    report = StackReport(
        (
            _rank(0, COLLECTIVE, cut),
            _rank(1, COLLECTIVE, cut),
            _rank(8, COLLECTIVE, cut),
            faulthandler,
            _rank(5, note="exited"),
        ),
        "no output for 60 s",
        WHEN,
    )
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(WHEN))
    assert report.format() == textwrap.dedent(f"""\
        Python stacks of 5 ranks at {stamp} (no output for 60 s)

        ranks 0-1, 8: waiting: all_reduce (distributed_c10d.py:2810) <- train_step (train.py:88) <- main (train.py:120)
        rank 3 (node1): working: __next__ (dataloader.py:631) <- train_step (train.py:61) <- main (train.py:120)
        rank 5 (node1): no stacks: exited

        == ranks 0-1, 8 (node1, node2) ==

        Thread MainThread (most recent call last):
          File "/work/train.py", line 120, in main
            line 120
          File "/work/train.py", line 88, in train_step
            line 88
          File "/torch/distributed/distributed_c10d.py", line 2810, in all_reduce
            line 2810

        Thread loader (most recent call last):
          (2 more frames)
          File "/torch/utils/data/dataloader.py", line 631, in __next__
            line 631

        == rank 3 (node1) ==
        note: held the GIL
        (stacks from faulthandler: no thread names, no source lines)

        Current thread 0x00007f0a1c4d5740 (most recent call last):
          File "/work/train.py", line 120, in main
            line 120
          File "/work/train.py", line 61, in train_step
            line 61
          File "/torch/utils/data/dataloader.py", line 631, in __next__
            line 631

        Thread 0x00007f0a1b2c3640 (most recent call last):
          <no Python frame>

        == rank 5 (node1) ==
        note: exited
        no stacks
        """)  # noqa: E501


def test_write_names_the_file_by_time_and_suffixes_a_taken_name(tmp_path: Path) -> None:
    report = StackReport((_rank(0, COLLECTIVE),), "asked", WHEN)
    directory = tmp_path / "logs" / "stacks"
    paths = [report.write(directory) for _ in range(3)]
    stem = "stacks-" + time.strftime("%Y%m%d-%H%M%S", time.localtime(WHEN))
    assert [p.name for p in paths] == [f"{stem}.txt", f"{stem}-2.txt", f"{stem}-3.txt"]
    assert all(p.parent == directory for p in paths)
    assert all(p.read_text() == report.format() for p in paths)


def test_importing_the_module_imports_nothing_heavy() -> None:
    code = "import sys, slurmrun.stacks.report; print(sorted(m for m in sys.modules if m in %r))"
    heavy = ["torch", "numpy", "cloudpickle", "slurmrun.transport", "slurmrun.protocol"]
    result = subprocess.run(
        [sys.executable, "-c", code % heavy],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert result.stdout == "[]\n"
    assert stacks.__file__.startswith(str(ROOT))


def test_the_package_loads_its_report_names_when_first_used() -> None:
    """`slurmrun.stacks` is the whole feature's package; the spawner imports it for the signal
    alone, before anything else, so its report (``slurmrun.stacks.StackReport``) loads later."""
    code = (
        "import sys, slurmrun.stacks as s; s.stacks_signal()\n"
        "print('slurmrun.stacks.report' in sys.modules)\n"
        "from slurmrun.stacks import StackReport\n"
        "print(StackReport.__module__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert result.stdout == "False\nslurmrun.stacks.report\n"
