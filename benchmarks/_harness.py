"""Shared helpers of the benchmark scripts: measured subprocess runs, result lines, medians.

A measured script prints exactly one line ``BENCH_JSON {...}`` on stdout; `run_measured`
starts it as a fresh process in its own session, times it from spawn to exit (the "whole
script" time), optionally samples the resident memory of its whole process tree, enforces a
hard cap, and kills whatever the run left behind (only processes it started itself).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil

MARK = "BENCH_JSON "
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def emit(data: Mapping[str, Any]) -> None:
    """Prints the one result line of a measured script."""
    sys.stdout.flush()
    print(MARK + json.dumps(data), flush=True)


def read_float(path: str) -> float | None:
    """The float written in a file (None if it is missing or not yet written)."""
    try:
        with open(path) as f:
            return float(f.read())
    except (OSError, ValueError):
        return None


def last_stamp(stamp_dir: str) -> float | None:
    """The latest time.time() written into the files of `stamp_dir` (None if none)."""
    stamps = [read_float(os.path.join(stamp_dir, n)) for n in os.listdir(stamp_dir)]
    clean = [t for t in stamps if t is not None]
    return max(clean) if clean else None


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    """This process's resident set size now."""
    return int(psutil.Process().memory_info().rss)


@dataclass
class Run:
    """One measured subprocess run."""

    wall_s: float
    returncode: int | None
    data: dict[str, Any]
    tree_peak_rss: int = 0
    capped: bool = False
    stdout_tail: str = ""
    stderr_tail: str = ""

    @property
    def ok(self) -> bool:
        """Whether the script ran to its result line without being capped."""
        return not self.capped and bool(self.data)


@dataclass
class _TreeWatch:
    """Samples the summed RSS of a process and its descendants; remembers every pid seen."""

    root: int
    interval: float
    limit_bytes: int | None
    peak: int = 0
    pids: dict[int, float] = field(default_factory=dict)  # pid -> create_time
    over_limit: bool = False
    stop: threading.Event = field(default_factory=threading.Event)

    def loop(self) -> None:
        try:
            root = psutil.Process(self.root)
        except psutil.Error:
            return
        while not self.stop.is_set():
            total = 0
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                procs = []
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    self.pids.setdefault(p.pid, p.create_time())
                    total += p.memory_info().rss
            self.peak = max(self.peak, total)
            if self.limit_bytes is not None and total > self.limit_bytes:
                self.over_limit = True
                return
            self.stop.wait(self.interval)


def _kill_leftovers(pgid: int, seen: Mapping[int, float]) -> None:
    """SIGKILLs the run's process group and every descendant the watcher saw (same pid+age)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    for pid, created in seen.items():
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if abs(p.create_time() - created) < 0.01:
                p.kill()


def run_measured(
    argv: Sequence[str],
    *,
    cap_s: float,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    sample_interval: float = 0.1,
    mem_limit_bytes: int | None = None,
) -> Run:
    """Runs `argv` as a fresh process and returns its wall time and its BENCH_JSON data."""
    full_env = dict(os.environ if env is None else env)
    start = time.perf_counter()
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        cwd=cwd,
        start_new_session=True,
    )
    watch = _TreeWatch(proc.pid, sample_interval, mem_limit_bytes)
    watcher = threading.Thread(target=watch.loop, daemon=True)
    watcher.start()
    capped = False
    out, err = "", ""
    try:
        deadline = start + cap_s
        while True:
            try:
                out, err = proc.communicate(
                    timeout=min(0.5, max(0.01, deadline - time.perf_counter()))
                )
                break
            except subprocess.TimeoutExpired:
                if watch.over_limit or time.perf_counter() >= deadline:
                    capped = True
                    break
    finally:
        wall = time.perf_counter() - start
        watch.stop.set()
        watcher.join(timeout=2.0)
        _kill_leftovers(proc.pid, watch.pids)
    if capped:
        with contextlib.suppress(subprocess.TimeoutExpired):
            out, err = proc.communicate(timeout=5.0)
    data = parse_result(out)
    if watch.over_limit:
        data = {**data, "killed_for_memory": True}
    return Run(
        wall_s=wall,
        returncode=proc.returncode,
        data=data,
        tree_peak_rss=watch.peak,
        capped=capped,
        stdout_tail=(out or "")[-2000:],
        stderr_tail=(err or "")[-3000:],
    )


def parse_result(stdout: str | None) -> dict[str, Any]:
    """The data of the last BENCH_JSON line of `stdout` ({} if there is none)."""
    for line in reversed((stdout or "").splitlines()):
        if line.startswith(MARK):
            parsed = json.loads(line[len(MARK) :])
            return dict(parsed)
    return {}


def median(values: Iterable[float | None]) -> float | None:
    """Median of the values that are not None (None if there are none)."""
    clean = [v for v in values if v is not None]
    return statistics.median(clean) if clean else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def mem_available_bytes() -> int:
    """Memory the kernel says is available now."""
    return int(psutil.virtual_memory().available)


def render(headers: list[str], rows: list[list[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def record(path: str, entry: dict[str, Any]) -> None:
    """Puts `entry` into the `recorded` list of a results file, replacing one of its title.

    Written as benchmarks/results/latest.json is kept: indent 2, a newline at the end.
    """
    with open(path) as f:
        data = json.load(f)
    kept = [e for e in data.get("recorded", []) if e.get("title") != entry["title"]]
    data["recorded"] = [*kept, entry]
    with open(path, "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")
