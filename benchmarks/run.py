"""slurmrun's benchmark suite: one command runs every scenario against its peers.

    python benchmarks/run.py [--quick] [--json out.json] [--plots docs/] [--only launch,scale]
                             [--slow-peers] [--rounds N] [--torchrunx-python PATH]

Scenarios (docs/benchmarks.md says what each number means):

  launch   trivial function (one all_reduce) on 2 CPU workers: launch-call and whole-script
           time of slurmrun vs the physical floor (2 fresh processes + gloo), torchrun and
           torchrunx; first and second launch in one script; a 1/4-worker sweep for the plot.
  returns  each of 2 workers returns 64 MiB / 256 MiB / 1 GiB (tensor), a dict of 100 x 1 MiB
           tensors and a 1 GiB numpy array: effective MiB/s and the launcher's peak memory.
  failure  a worker SIGKILLs itself (or os._exit) while its peer waits in all_reduce: time
           from its death to the exception in the launcher.
  scale    a real launcher-side Session against 1..1024 fake agents x 8 workers (simulated).
  cli      `slurmrun train.py` vs `torchrun --standalone --nproc-per-node=2 train.py`, whole
           command, one all_reduce (bench_cli.py).
  slurm    on the 3-node test cluster (if up): trivial launch vs `srun -N3 python -c "import
           torch"` in the same allocation.

Every measured run is a fresh subprocess; within a scenario the tools alternate run by run,
and the tables show medians over the rounds (5; 3 with --quick) and ratios slurmrun/peer.
"""

from __future__ import annotations

import argparse
import compileall
import datetime
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import HERE, REPO, Run, median, mem_available_bytes, ratio, run_measured

MIB = 1 << 20
GIB = 1 << 30
TORCHRUNX_VENV_PYTHON = os.path.expanduser("~/.cache/slurmrun-bench/torchrunx-venv/bin/python")
TORCHRUNX_MEMORY_FACTOR = 10  # torchrunx holds about 10x the returned bytes (measured, 0.4.0)
FAIL_CAP_S = 60.0
CHATTER_S = 2.0  # seconds of simulated output before the results (scale.py --chatter)
SCENARIOS = ("launch", "returns", "failure", "scale", "cli", "slurm")


# ------------------------------------------------------------------ configuration


@dataclass(frozen=True)
class Config:
    """What this invocation runs."""

    quick: bool
    rounds: int
    slow_peers: bool
    only: tuple[str, ...]
    python: str
    torchrunx_python: str | None
    workdir: str


@dataclass(frozen=True)
class Case:
    """One measured command; run once per round."""

    key: str
    argv: list[str]
    cap_s: float = 300.0
    mem_limit: int | None = None


@dataclass
class Table:
    """A printed (markdown) table."""

    title: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class Target:
    """One target of the performance issue, and whether this run met it."""

    name: str
    measured: str
    target: str
    met: bool | None  # None: not measured


@dataclass
class Report:
    """Everything one invocation produced."""

    tables: list[Table] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)


def find_torchrunx_python(explicit: str | None) -> str | None:
    """An interpreter that can import torchrunx (it needs cloudpickle>=3: a venv of its own)."""
    candidates = [explicit, os.environ.get("TORCHRUNX_PYTHON")]
    if importlib.util.find_spec("torchrunx") is not None:
        candidates.append(sys.executable)
    candidates.append(TORCHRUNX_VENV_PYTHON)
    for python in candidates:
        if python and os.path.exists(python):
            probe = subprocess.run(
                [python, "-c", "import torchrunx"], capture_output=True, timeout=120, check=False
            )
            if probe.returncode == 0:
                return python
    return None


# ------------------------------------------------------------------ running cases


def script(name: str) -> str:
    """Absolute path of a benchmark script."""
    return os.path.join(HERE, name)


def run_rounds(
    cfg: Config, cases: Sequence[Case], rounds: int | None = None
) -> dict[str, list[Run]]:
    """Runs every case once per round, alternating; returns the runs of each case."""
    runs: dict[str, list[Run]] = {c.key: [] for c in cases}
    n = cfg.rounds if rounds is None else rounds
    for r in range(n):
        for case in cases:
            run = run_measured(
                case.argv, cap_s=case.cap_s, cwd=cfg.workdir, mem_limit_bytes=case.mem_limit
            )
            runs[case.key].append(run)
            status = "ok" if run.ok and run.data.get("ok", True) else "FAILED"
            print(f"  [{r + 1}/{n}] {case.key:<34} {run.wall_s:7.2f} s  {status}", flush=True)
            if status == "FAILED":
                print("    " + (run.stderr_tail or run.stdout_tail)[-600:].replace("\n", "\n    "))
    return runs


def values(runs: Sequence[Run], get: Callable[[Run], float | None]) -> list[float | None]:
    """`get` of each successful run (None for failed ones)."""
    out: list[float | None] = []
    for run in runs:
        try:
            out.append(get(run) if run.ok and run.data.get("ok", True) else None)
        except (KeyError, IndexError, TypeError):
            out.append(None)
    return out


def med(runs: Sequence[Run], get: Callable[[Run], float | None]) -> float | None:
    """Median of `get` over the successful runs."""
    return median(values(runs, get))


def fmt(x: float | None, unit: str = "s", digits: int = 2) -> str:
    """A number with its unit, or an em dash when missing."""
    if x is None:
        return "—"
    return f"{x:.{digits}f} {unit}".rstrip()


def fmt_ratio(x: float | None) -> str:
    """A ratio like 0.42x."""
    return "—" if x is None else f"{x:.2f}x"


def raw(runs: dict[str, list[Run]]) -> dict[str, list[dict[str, Any]]]:
    """JSON-able runs (without the output tails of successful runs)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for key, rs in runs.items():
        items = []
        for run in rs:
            d = asdict(run)
            if run.ok:
                d.pop("stdout_tail")
                d.pop("stderr_tail")
            items.append(d)
        out[key] = items
    return out


# ------------------------------------------------------------------ scenario 1: launch


def _launch_cases(cfg: Config, workers: int, launches: int, with_torchrunx: bool) -> list[Case]:
    py = cfg.python
    w = str(workers)
    cases = [
        Case(f"floor/w{w}", [py, script("floor.py"), "--workers", w]),
        Case(
            f"torchrun/w{w}",
            [
                py,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={w}",
                script("torchrun_job.py"),
            ],
        ),
        Case(
            f"slurmrun/w{w}",
            [
                py,
                script("bench_launch.py"),
                "--tool",
                "slurmrun",
                "--workers",
                w,
                "trivial",
                "--launches",
                str(launches),
            ],
        ),
    ]
    if with_torchrunx and cfg.torchrunx_python:
        cases.append(
            Case(
                f"torchrunx/w{w}",
                [
                    cfg.torchrunx_python,
                    script("bench_launch.py"),
                    "--tool",
                    "torchrunx",
                    "--workers",
                    w,
                    "trivial",
                    "--launches",
                    "1",
                ],
            )
        )
    return cases


def _launch_times(run: Run) -> list[float]:
    """The launch calls of a run; a command without one (torchrun) counts as one launch."""
    if "launch_s" not in run.data:
        return [run.wall_s]
    return [float(t) for t in run.data["launch_s"]]


def _first_launch(run: Run) -> float:
    return _launch_times(run)[0]


def _second_launch(run: Run) -> float | None:
    times = _launch_times(run)
    return times[1] if len(times) > 1 else None


def _whole_script_one_launch(run: Run) -> float:
    """Process start to exit, minus the second launch when the script launched twice."""
    second = _second_launch(run)
    return run.wall_s - (second or 0.0)


def scenario_launch(cfg: Config, report: Report) -> None:
    """Trivial launch on 2 workers, plus a 1/4-worker sweep (full runs only)."""
    print("== launch: trivial function, 2 CPU workers", flush=True)
    warm = Case(
        "slurmrun-warm/w2",
        [*_launch_cases(cfg, 2, 5, False)[2].argv, "--warm"],
    )
    runs = run_rounds(cfg, [*_launch_cases(cfg, 2, 2, True), warm])
    tools = [k.split("/")[0] for k in runs]
    stats: dict[str, dict[str, float | None]] = {}
    for key, rs in runs.items():
        tool = key.split("/")[0]
        stats[tool] = {
            "launch": med(rs, _first_launch),
            "second": med(rs, _second_launch),
            "script": med(rs, _whole_script_one_launch),
            "import": med(rs, lambda r: r.data.get("import_s")),
            "later": med(rs, _later_launches),
        }
    table = Table(
        "Launch overhead: trivial function (one all_reduce) on 2 CPU workers (medians)",
        ["metric", *tools, *[f"slurmrun/{t}" for t in tools if t != "slurmrun"]],
    )
    for metric, label in (
        ("launch", "launch call, 1st launch"),
        ("second", "launch call, 2nd launch in the same script"),
        ("later", "launch call, 2nd-5th runs of one warm Launcher"),
        ("script", "whole script, python start to exit (1 launch)"),
    ):
        row = [label, *[fmt(stats[t][metric]) for t in tools]]
        row += [
            fmt_ratio(ratio(stats["slurmrun"][metric], stats[t][metric]))
            for t in tools
            if t != "slurmrun"
        ]
        table.rows.append(row)
    table.notes.append(
        "floor = 2 fresh processes that import torch, init gloo (env://, 127.0.0.1) and "
        "all_reduce once; its 'launch call' is spawn-to-exit of both. torchrun has no launch "
        "call: its column shows the whole command. Whole script for 2-launch scripts = "
        "wall time minus the 2nd launch."
    )
    if not cfg.torchrunx_python:
        table.notes.append("torchrunx is not installed (see docs/benchmarks.md): no column.")
    report.tables.append(table)
    report.data["launch"] = {"runs": raw(runs), "medians": stats}
    _warm_critical_path(runs.get("slurmrun-warm/w2", []), report)
    _launch_targets(stats, report)
    if not cfg.quick:
        _launch_sweep(cfg, report, stats)


def _warm_critical_path(runs: Sequence[Run], report: Report) -> None:
    """Where a warm run's launch call goes, from stamps on both sides (bench_launch.critical_path).

    One measured run per process (after its timed ones); medians over the processes.
    """
    keys = (
        "launch_s",
        "call_to_func_s",
        "new_group_and_barrier_s",
        "all_reduce_s",
        "func_end_to_return_s",
    )
    parts = {
        key: med(runs, lambda r, k=key: (r.data.get("critical_path") or {}).get(k)) for key in keys
    }
    total = parts["launch_s"]
    if total is None or parts["call_to_func_s"] is None:
        return
    table = Table(
        "Where a warm run goes: one run of a warm Launcher, 2 workers (medians)",
        ["part", "time", "share"],
    )
    for label, key in (
        ("the whole launch call", "launch_s"),
        (
            "run() to func's start: hand-out, fork, unpickle, process group + barrier",
            "call_to_func_s",
        ),
        (
            "... of which a fresh process group's init + barrier (measured again)",
            "new_group_and_barrier_s",
        ),
        ("func: one all_reduce", "all_reduce_s"),
        ("func's end to run() returning: result back, DONE, END/IDLE", "func_end_to_return_s"),
    ):
        table.rows.append([label, fmt(parts[key], "s", 3), fmt_ratio(ratio(parts[key], total))])
    table.notes.append(
        "Rank 0 stamps time.time() when func starts and ends (one machine, one clock with the "
        "launcher's) and times a fresh process group with a barrier, as the worker's own, and "
        "one all_reduce. After func returns, the run waits for DONE (the workers exited, their "
        "output forwarded), then END/IDLE, so that the next run starts on clean agents."
    )
    report.tables.append(table)


def _later_launches(run: Run) -> float | None:
    """The median of a warm launcher's 2nd and later runs."""
    later = _launch_times(run)[1:]
    return statistics.median(later) if later else None


def _launch_targets(stats: dict[str, dict[str, float | None]], report: Report) -> None:
    warm = ratio(stats.get("slurmrun-warm", {}).get("later"), stats["floor"]["launch"])
    report.targets.append(
        Target(
            "warm launcher, 2nd and later runs <= 0.15x floor",
            fmt_ratio(warm),
            "<= 0.15x",
            None if warm is None else warm <= 0.15,
        )
    )
    s = stats["slurmrun"]["launch"]
    floor = ratio(s, stats["floor"]["launch"])
    report.targets.append(
        Target(
            "launch call <= 1.0x floor",
            fmt_ratio(floor),
            "<= 1.00x",
            None if floor is None else floor <= 1.0,
        )
    )
    trx = ratio(s, stats.get("torchrunx", {}).get("launch"))
    report.targets.append(
        Target(
            "launch call <= 0.40x torchrunx",
            fmt_ratio(trx),
            "<= 0.40x",
            None if trx is None else trx <= 0.40,
        )
    )


def _launch_sweep(cfg: Config, report: Report, at2: dict[str, dict[str, float | None]]) -> None:
    """1, 2 and 4 workers in the same rounds (so that one plot compares like with like)."""
    print("== launch sweep: 1, 2 and 4 workers", flush=True)
    cases = [
        c
        for w in (1, 2, 4)
        for c in _launch_cases(cfg, w, 1, cfg.slow_peers)
        if cfg.slow_peers or c.key.split("/")[0] in ("floor", "slurmrun")
    ]
    rounds = cfg.rounds if cfg.slow_peers else min(cfg.rounds, 3)
    runs = run_rounds(cfg, cases, rounds)
    series: dict[str, dict[int, float | None]] = {}
    for key, rs in runs.items():
        tool, w = key.split("/")
        series.setdefault(tool, {})[int(w[1:])] = med(rs, _first_launch)
    for tool, s in at2.items():  # peers not in the sweep: their 2-worker value from above
        series.setdefault(tool, {}).setdefault(2, s["launch"])
    table = Table("Launch call vs workers on localhost (medians)", ["workers", *series])
    for count in (1, 2, 4):
        table.rows.append([str(count), *[fmt(series[t].get(count)) for t in series]])
    if not cfg.slow_peers:
        table.notes.append(
            f"{rounds} rounds of floor and slurmrun at 1, 2 and 4 workers (all peers with "
            "--slow-peers); torchrun and torchrunx: their 2-worker values from the table above."
        )
    report.tables.append(table)
    report.data["launch_sweep"] = {"runs": raw(runs), "series": series}


# ------------------------------------------------------------------ scenario 2: returns


def _returns_sizes(cfg: Config) -> list[int]:
    return [64, 256] if cfg.quick else [64, 256, 1024]


def _fits(nbytes_total: int, factor: float) -> bool:
    """Whether `factor` x the bytes (plus 2 GiB) fits in 60 % of the available memory."""
    return factor * nbytes_total + 2 * GIB <= 0.6 * mem_available_bytes()


def _returns_cases(cfg: Config) -> tuple[list[Case], list[str]]:
    py = cfg.python
    limit = int(0.85 * mem_available_bytes())
    cases: list[Case] = []
    notes: list[str] = []
    for mib in _returns_sizes(cfg):
        total = 2 * mib * MIB
        if not _fits(total, 3):
            notes.append(f"{mib} MiB skipped: not enough memory for 3x {total >> 20} MiB")
            continue
        m = str(mib)
        cases.append(
            Case(
                f"floor/{m}",
                [py, script("floor.py"), "--workers", "2", "--return-mib", m],
                mem_limit=limit,
            )
        )
        cases.append(
            Case(
                f"slurmrun/{m}",
                [
                    py,
                    script("bench_launch.py"),
                    "--tool",
                    "slurmrun",
                    "returns",
                    "--kind",
                    "tensor",
                    "--mib",
                    m,
                ],
                mem_limit=limit,
            )
        )
        if cfg.torchrunx_python and not cfg.quick:
            if not _fits(total, TORCHRUNX_MEMORY_FACTOR):
                notes.append(
                    f"torchrunx skipped at {mib} MiB: it holds ~{TORCHRUNX_MEMORY_FACTOR}x the "
                    f"returned {total >> 20} MiB, more than this machine can spare"
                )
            elif mib > 64 and not cfg.slow_peers:
                notes.append(
                    f"torchrunx at {mib} MiB: only with --slow-peers (~30 s a run at 256 MiB)"
                )
            else:
                cases.append(
                    Case(
                        f"torchrunx/{m}",
                        [
                            cfg.torchrunx_python,
                            script("bench_launch.py"),
                            "--tool",
                            "torchrunx",
                            "returns",
                            "--kind",
                            "tensor",
                            "--mib",
                            m,
                        ],
                        mem_limit=limit,
                    )
                )
    cases.append(
        Case(
            "slurmrun/nested",
            [py, script("bench_launch.py"), "--tool", "slurmrun", "returns", "--kind", "nested"],
            mem_limit=limit,
        )
    )
    if not cfg.quick and _fits(2 * GIB, 3):
        cases.append(
            Case(
                "slurmrun/numpy1024",
                [
                    py,
                    script("bench_launch.py"),
                    "--tool",
                    "slurmrun",
                    "returns",
                    "--kind",
                    "numpy",
                    "--mib",
                    "1024",
                ],
                mem_limit=limit,
            )
        )
    if cfg.quick:
        notes.append("--quick: 64 and 256 MiB only, no torchrunx, no numpy 1 GiB")
    return cases, notes


def _launch_time(run: Run) -> float:
    v = run.data["launch_s"]
    return float(v[0] if isinstance(v, list) else v)


def scenario_returns(cfg: Config, report: Report) -> None:
    """Large return values: effective throughput and launcher memory."""
    print("== returns: large return values, 2 workers", flush=True)
    cases, notes = _returns_cases(cfg)
    trivial: dict[str, dict[str, float | None]] = dict(
        report.data.get("launch", {}).get("medians", {})
    )
    # The trivial launch that "effective" subtracts is measured in the same rounds (load on a
    # shared machine drifts); --quick, and torchrunx (~10 s a run), reuse the launch scenario's.
    in_rounds = {"floor", "slurmrun"} if not cfg.quick else set()
    in_rounds |= {"floor", "slurmrun", "torchrunx"} - set(trivial)
    tools = {c.key.split("/")[0] for c in cases}
    base_cases = [
        c for c in _launch_cases(cfg, 2, 1, True) if c.key.split("/")[0] in tools & in_rounds
    ]
    runs = run_rounds(cfg, base_cases + cases)
    for c in base_cases:
        trivial[c.key.split("/")[0]] = {"launch": med(runs.pop(c.key), _first_launch)}
    measured_here = {c.key.split("/")[0] for c in base_cases}
    notes.append(
        "trivial launch subtracted for 'effective': "
        + ", ".join(
            f"{t} {fmt(trivial.get(t, {}).get('launch'))} "
            + ("(these rounds)" if t in measured_here else "(launch table)")
            for t in sorted(tools)
        )
    )
    table = Table(
        "Large returns: 2 workers each return the value (medians)",
        [
            "tool / value",
            "bytes returned",
            "launch call",
            "MiB/s plain",
            "MiB/s effective",
            "MiB/s after created",
            "launcher peak RSS - before",
            "÷ bytes",
            "process-tree peak RSS",
            "slurmrun/floor time",
        ],
    )
    stats: dict[str, dict[str, float | None]] = {}
    for key, rs in runs.items():
        tool, what = key.split("/")
        nbytes = med(rs, lambda r: r.data["bytes_returned"])
        launch = med(rs, _launch_time)
        base = trivial.get(tool, {}).get("launch")
        mem = med(rs, lambda r: r.data["peak_rss"] - r.data["rss_before"])
        s = {
            "bytes": nbytes,
            "launch": launch,
            "plain": None if not (nbytes and launch) else nbytes / MIB / launch,
            "effective": (
                None
                if not (nbytes and launch and base) or launch <= base
                else nbytes / MIB / (launch - base)
            ),
            "below_noise": float(bool(nbytes and launch and base and launch <= base)),
            "mem_delta": mem,
            "mem_ratio": ratio(mem, nbytes),
            "tree_peak": med(rs, lambda r: float(r.tree_peak_rss)),
        }
        after = med(rs, lambda r: r.data.get("after_created_s"))
        s["after_created"] = None if not (nbytes and after) else nbytes / MIB / after
        stats[key] = s
        floor_key = f"floor/{what}"
        vs_floor = (
            ratio(launch, stats[floor_key]["launch"])
            if tool != "floor" and floor_key in stats
            else None
        )
        table.rows.append(
            [
                f"{tool} / {_what_label(what)}",
                fmt(None if nbytes is None else nbytes / MIB, "MiB", 0),
                fmt(launch),
                fmt(s["plain"], "", 0),
                "n/m" if s["below_noise"] else fmt(s["effective"], "", 0),
                fmt(s["after_created"], "", 0),
                fmt(None if mem is None else mem / MIB, "MiB", 0),
                fmt_ratio(s["mem_ratio"]),
                fmt(None if s["tree_peak"] is None else s["tree_peak"] / MIB, "MiB", 0),
                fmt_ratio(vs_floor),
            ]
        )
    table.notes += [
        "effective = bytes / (launch call - the same tool's trivial launch call in this run); "
        "plain = bytes / launch call. Both include the workers creating the values. "
        "after created = bytes / (launch call returned - the last worker's value was created): "
        "the transfer alone (pickling, relays, receiving, unpickling, and the launch's end). "
        "n/m: not measurable, the launch with the value was no slower than the trivial one "
        "(the machine's noise exceeds the transfer time).",
        "launcher peak RSS - before: ru_maxrss of the launcher process minus its RSS just "
        "before the launch (after importing torch); 1.0x is the minimum (it holds the results).",
        "floor = 2 fresh processes that send the raw tensor bytes to the parent over loopback "
        "TCP (one connection each, received in parallel).",
        *notes,
    ]
    report.tables.append(table)
    report.data["returns"] = {"runs": raw(runs), "stats": stats}
    _returns_targets(stats, report)


def _what_label(what: str) -> str:
    if what == "nested":
        return "dict of 100 x 1 MiB tensors"
    if what.startswith("numpy"):
        return f"numpy {what[5:]} MiB"
    return f"tensor {what} MiB"


def _returns_targets(stats: dict[str, dict[str, float | None]], report: Report) -> None:
    tensor = {k: s for k, s in stats.items() if k.startswith("slurmrun/") and k[9:].isdigit()}
    effs = {k: s["effective"] for k, s in tensor.items()}
    worst = min((v for v in effs.values() if v is not None), default=None)
    detail = ", ".join(
        f"{k[9:]} MiB: {'n/m' if tensor[k]['below_noise'] else fmt(v, '', 0)} "
        f"(after created {fmt(tensor[k]['after_created'], '', 0)})"
        for k, v in effs.items()
    )
    report.targets.append(
        Target(
            "tensor returns >= 1 GiB/s effective (1024 MiB/s)",
            detail,
            ">= 1024 MiB/s each",
            None if worst is None else worst >= 1024,
        )
    )
    mem = {k: s["mem_ratio"] for k, s in stats.items() if k.startswith("slurmrun/")}
    worst_mem = max((v for v in mem.values() if v is not None), default=None)
    detail = ", ".join(f"{k[9:]}: {fmt_ratio(v)}" for k, v in mem.items())
    report.targets.append(
        Target(
            "launcher peak memory <= 1.2x bytes returned",
            detail,
            "<= 1.20x each",
            None if worst_mem is None else worst_mem <= 1.2,
        )
    )


# ------------------------------------------------------------------ scenario 3: failure


def scenario_failure(cfg: Config, report: Report) -> None:
    """Worker death to launcher exception."""
    print("== failure: a worker dies while its peer waits in all_reduce", flush=True)
    py = cfg.python
    cases = []
    tools: list[tuple[str, str, str]] = [("slurmrun", py, "kill")]
    if not cfg.quick:
        tools.append(("slurmrun", py, "exit"))
    if cfg.torchrunx_python:
        tools.append(("torchrunx", cfg.torchrunx_python, "kill"))
    for tool, python, how in tools:
        death = os.path.join(cfg.workdir, f"death-{tool}-{how}")
        cases.append(
            Case(
                f"{tool}/{how}",
                [
                    python,
                    script("bench_launch.py"),
                    "--tool",
                    tool,
                    "fail",
                    "--how",
                    how,
                    "--death-file",
                    death,
                    "--cap",
                    str(FAIL_CAP_S),
                ],
                cap_s=FAIL_CAP_S + 60.0,
            )
        )
    runs = run_rounds(cfg, cases)
    table = Table(
        "Failure latency: worker death -> exception in the launcher (medians)",
        ["tool / death", "latency", "min", "max", "capped runs", "exception"],
    )
    stats: dict[str, float | None] = {}
    for key, rs in runs.items():
        lat = values(rs, lambda r: r.data.get("latency_s"))
        capped = sum(1 for r in rs if r.data.get("capped") or r.capped)
        stats[key] = median(lat)
        clean = [v for v in lat if v is not None]
        exc = next((r.data.get("exc_type", "") for r in rs if r.data.get("exc_type")), "")
        how = "SIGKILL" if key.endswith("kill") else "os._exit(3)"
        table.rows.append(
            [
                f"{key.split('/')[0]} / {how}",
                fmt(stats[key]) if capped < len(rs) else f">= {FAIL_CAP_S:.0f} s (cap)",
                fmt(min(clean) if clean else None),
                fmt(max(clean) if clean else None),
                f"{capped}/{len(rs)}",
                exc,
            ]
        )
    table.notes.append(
        "Rank 1 writes time.time() to a file, then kills itself; rank 0 is in all_reduce. "
        f"Cap: {FAIL_CAP_S:.0f} s after the death."
    )
    report.tables.append(table)
    report.data["failure"] = {"runs": raw(runs), "medians": stats}
    worst = max(
        (v for k, v in stats.items() if k.startswith("slurmrun") and v is not None), default=None
    )
    report.targets.append(
        Target(
            "worker death -> exception <= 0.5 s median",
            ", ".join(f"{k}: {fmt(v)}" for k, v in stats.items() if k.startswith("slurmrun")),
            "<= 0.50 s",
            None if worst is None else worst <= 0.5,
        )
    )


# ------------------------------------------------------------------ scenario 4: scale


def scenario_scale(cfg: Config, report: Report) -> None:
    """Simulated agents against a real Session."""
    print("== scale: simulated agents x 8 workers against a real Session", flush=True)
    counts = [64, 1024, 4096] if cfg.quick else [1, 64, 256, 1024, 4096]
    log_counts = [64, 1024, 4096] if cfg.quick else [64, 256, 1024, 4096]
    cases = [
        Case(f"scale/{n}", [cfg.python, script("scale.py"), "--agents", str(n)]) for n in counts
    ]
    # The agents write their workers' files (srun agents do, on the shared filesystem): on a
    # cluster each node creates its own 8, here 2 processes of fake agents create all 32,768
    # in one directory on the launcher's 2 cores (~5 s). The launcher's share is measured with
    # the agents counting the lines instead (--no-agent-files); the "+files" rows have them
    # write, for the lines.
    no_files = ["--no-agent-files"]
    chatter_args = ["--chatter", str(CHATTER_S), *no_files]
    cases += [
        Case(
            f"scale+logs/{n}",
            [cfg.python, script("scale.py"), "--agents", str(n), "--logs", *no_files],
            cap_s=600.0,
        )
        for n in log_counts
    ]
    chatter = [
        Case(
            f"scale+chatter/{n}",
            [cfg.python, script("scale.py"), "--agents", str(n), *chatter_args],
            cap_s=600.0,
        )
        for n in (256, 1024, 4096)
    ]
    with_files = [
        Case(
            f"scale+logs+files/{n}",
            [cfg.python, script("scale.py"), "--agents", str(n), "--logs"],
            cap_s=600.0,
        )
        for n in (1024, 4096)
    ] + [
        Case(
            "scale+chatter+files/4096",
            [cfg.python, script("scale.py"), "--agents", "4096", "--chatter", str(CHATTER_S)],
            cap_s=600.0,
        )
    ]
    runs = run_rounds(cfg, [*cases, *chatter[:2]])
    # 32,768 ranks writing take long on the 2-core reference machine: one round
    runs.update(run_rounds(cfg, [*chatter[2:], *with_files], rounds=1))
    table = Table(
        "Scale (simulated): N agents x 8 workers against a real launcher Session (medians)",
        [
            "agents x workers",
            "logs",
            "connect wall",
            "hand-out+gather wall",
            "hand-out+gather CPU",
            "launch wall (all)",
            "launcher CPU (all)",
            "memory Δ",
            "per agent",
            "agents that retried connect: max (runs)",
            "log lines lost",
            "ok",
        ],
    )
    stats: dict[str, dict[str, float | None]] = {}
    for key, rs in runs.items():
        n = int(key.split("/")[1])
        s = {
            "agents": float(n),
            "connect": med(rs, lambda r: r.data["connect_wall_s"]),
            "hg_wall": med(rs, lambda r: r.data["handout_gather_wall_s"]),
            "hg_cpu": med(rs, lambda r: r.data["handout_gather_cpu_s"]),
            "total_wall": med(rs, lambda r: r.data["total_wall_s"]),
            "total_cpu": med(rs, lambda r: r.data["total_cpu_s"]),
            "mem": med(rs, lambda r: r.data["mem_delta"]),
            "connect_hg": med(
                rs, lambda r: r.data["connect_wall_s"] + r.data["handout_gather_wall_s"]
            ),
            "dropped": max(
                (float(r.data.get("retried_agents") or 0) for r in rs if r.data), default=None
            ),
            "runs_with_drops": float(sum(1 for r in rs if r.data.get("retried_agents"))),
            "lost": max(
                (
                    float(r.data.get("log_lines_expected", 0) - r.data.get("log_lines", 0))
                    for r in rs
                    if r.data
                ),
                default=None,
            ),
            "failed_runs": float(sum(1 for r in rs if not r.data.get("ok"))),
        }
        stats[key] = s
        oks = sum(1 for r in rs if r.data.get("ok"))
        errors = {
            f"{r.data.get('error', '')} ({r.data.get('fake_agent_failures')} fake agents saw: "
            f"{r.data.get('fake_agent_failure_example') or 'nothing'})"
            for r in rs
            if r.data and not r.data.get("ok")
        }
        mem = s["mem"]
        table.rows.append(
            [
                f"{n} x 8",
                key.split("/")[0].removeprefix("scale").removeprefix("+").replace("+", ", ")
                or "no",
                fmt(s["connect"]),
                fmt(s["hg_wall"], "s", 3),
                fmt(s["hg_cpu"], "s", 3),
                fmt(s["total_wall"]),
                fmt(s["total_cpu"]),
                fmt(None if mem is None else mem / MIB, "MiB", 1),
                fmt(None if mem is None else mem / 1024 / n, "KiB", 0),
                f"{fmt(s['dropped'], '', 0)} ({int(s['runs_with_drops'] or 0)}/{len(rs)})",
                fmt(s["lost"], "", 0),
                f"{oks}/{len(rs)}",
            ]
        )
        for e in sorted(errors):
            table.notes.append(f"{key}: a run failed: {e}")
    table.notes += [
        "Fake agents run in 2 separate processes, each one event loop for all of its agents "
        "(their CPU is not counted, but they share the 2 cores with the launcher). CPU = "
        "time.process_time() of the launcher process (all its threads). hand-out+gather = "
        "from the first start frame to the results unpickled. launch wall/CPU = the whole "
        "Session.run (connect, handshakes, hand-out, gather, stop).",
        "logs: each worker prints one line and the run uses its default log handlers, as a "
        "real launch does: agents write their workers' files and send the launcher rank 0's "
        "lines. Without 'files' the fake agents count the lines they would write (on a "
        "cluster each node creates its own files; here 2 processes create all of them, in "
        "one directory, on the launcher's 2 cores); with 'files' they write them. chatter: for "
        f"{CHATTER_S:g} s before its result rank 0 prints a progress-bar state every 10 ms "
        "and every other worker a line a second (hand-out+gather includes those seconds).",
        "agents that retried connect: fake agents connect with the real agent's bounded, "
        "jittered backoff (slurmrun.node.agent.Backoff); most in one run, and runs "
        "with any. log lines lost: expected lines minus lines found in the files (or "
        "counted by the agents).",
    ]
    report.tables.append(table)
    report.data["scale"] = {"runs": raw(runs), "stats": stats}
    _scale_targets(stats, report)


def _scale_targets(stats: dict[str, dict[str, float | None]], report: Report) -> None:
    big = stats.get("scale+logs/4096", {})
    total = big.get("connect_hg")
    report.targets.append(
        Target(
            "4096x8 with a log line per worker: connect + hand-out + gather <= 3 s",
            fmt(total, "s", 2),
            "<= 3.00 s",
            None if total is None else total <= 3.0,
        )
    )
    for what, key in (("CPU", "total_cpu"), ("memory", "mem")):
        small, large = stats.get("scale+logs/64", {}).get(key), big.get(key)
        growth = ratio(large, small)
        report.targets.append(
            Target(
                f"with logs: launcher {what} linear in agents (64 -> 4096)",
                f"{fmt_ratio(growth)} for 64x agents",
                "<= 80x (linear, 25 % slack)",
                None if growth is None else growth <= 80,
            )
        )
    failed = sum(int(s.get("failed_runs") or 0) for k, s in stats.items() if "4096" in k)
    report.targets.append(
        Target(
            "4096 agents connect (backoff on a full backlog): every run ok",
            f"{failed} failed runs",
            "0",
            failed == 0,
        )
    )
    chatter = stats.get("scale+chatter/4096", {})
    hg = chatter.get("hg_wall")
    lost = stats.get("scale+chatter+files/4096", chatter).get("lost")
    report.targets.append(
        Target(
            "tqdm at 100/s on rank 0 + a line/s from 32,767 ranks: no line lost",
            fmt(lost, "", 0),
            "0",
            None if lost is None else lost == 0,
        )
    )
    quiet = big.get("hg_wall")
    report.targets.append(
        Target(
            "... and it does not slow the launch: hand-out+gather - chatter time <= 1.5x quiet",
            fmt(None if hg is None else hg - CHATTER_S, "s", 2) + f" vs {fmt(quiet, 's', 2)}",
            "<= 1.5x",
            None if hg is None or quiet is None else hg - CHATTER_S <= 1.5 * quiet,
        )
    )


# ------------------------------------------------------------------ scenario 5: slurm


def scenario_cli(cfg: Config, report: Report) -> None:
    """The ``slurmrun`` command against torchrun on the same script (bench_cli.py)."""
    print("== cli: slurmrun train.py vs torchrun --standalone", flush=True)
    out = os.path.join(cfg.workdir, "bench_cli.json")
    argv = [cfg.python, script("bench_cli.py"), "--rounds", str(cfg.rounds), "--json", out]
    subprocess.run(argv, check=True, timeout=600)
    with open(out) as f:
        d = json.load(f)
    med_s = d["median_s"]
    table = Table(
        "`slurmrun train.py` vs `torchrun --standalone --nproc-per-node=2 train.py` (medians)",
        ["command", "whole command", "ratio"],
    )
    table.rows += [
        ["torchrun", fmt(med_s["torchrun"]), ""],
        ["slurmrun", fmt(med_s["slurmrun"]), fmt_ratio(d["ratio"])],
    ]
    table.notes.append(f"{cfg.rounds} alternating rounds; 2 CPU workers; one all_reduce.")
    report.tables.append(table)
    report.targets.append(
        Target("slurmrun command vs torchrun", f"{d['ratio']:.2f}x", "< 0.5x", d["ratio"] < 0.5)
    )
    report.data["cli"] = d


def cluster_up() -> tuple[bool, str]:
    """Whether the SLURM test cluster is up and idle (no other jobs queued)."""
    cluster = os.path.join(REPO, "tests", "cluster", "slurm-cluster.sh")
    if not os.path.exists(cluster) or shutil.which("salloc") is None:
        return False, "no tests/cluster/slurm-cluster.sh or no salloc"
    try:
        status = subprocess.run(
            ["bash", cluster, "status"], capture_output=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"cluster status failed: {e}"
    if status.returncode != 0:
        return False, "the SLURM test cluster is down (slurm-cluster.sh status exits non-zero)"
    queue = subprocess.run(
        ["squeue", "-h"], capture_output=True, text=True, timeout=30, check=False
    ).stdout.strip()
    if queue:
        return False, f"the cluster is busy (other jobs in squeue: {queue.splitlines()[0]!r} ...)"
    return True, ""


def scenario_slurm(cfg: Config, report: Report) -> None:
    """Trivial launch on the 3-node test cluster next to a bare srun."""
    print("== slurm: 3-node test cluster", flush=True)
    table = Table(
        "SLURM test cluster (3 nodes, 1 worker each): launch vs bare srun (medians)",
        ["metric", "time", "ratio"],
    )
    up, why = cluster_up()
    if not up:
        table.notes.append(f"skipped: {why}")
        report.tables.append(table)
        report.data["slurm"] = {"skipped": why}
        print(f"  skipped: {why}")
        return
    rounds = min(cfg.rounds, 2) if cfg.quick else cfg.rounds
    argv = [
        "salloc",
        "-N3",
        "--job-name=slurmrun-bench",
        "--time=10",
        cfg.python,
        script("slurm_bench.py"),
        "--rounds",
        str(rounds),
    ]
    run = run_measured(argv, cap_s=420.0, cwd=cfg.workdir)
    d = run.data
    if not d or d.get("error"):
        why = d.get("error") or (run.stderr_tail or run.stdout_tail)[-400:]
        table.notes.append(f"skipped: slurmrun could not launch on the cluster: {why}")
        report.tables.append(table)
        report.data["slurm"] = {"skipped": why, "run": asdict(run)}
        print(f"  skipped: {why}")
        return
    srun_s = median(d["srun_s"])
    launch_s = median(d["launch_s"][1:] or d["launch_s"])
    table.rows += [
        ['srun -N3 python -c "import torch"', fmt(srun_s), ""],
        [
            "slurmrun.launch, 1st in the allocation",
            fmt(d["launch_s"][0]),
            fmt_ratio(ratio(d["launch_s"][0], srun_s)),
        ],
        ["slurmrun.launch, later ones", fmt(launch_s), fmt_ratio(ratio(launch_s, srun_s))],
    ]
    warm = d.get("warm_s") or []
    later = median(warm[1:]) if len(warm) > 1 else None
    if warm:
        table.rows += [
            ["warm Launcher, 1st run (starts the agents)", fmt(warm[0]), ""],
            [
                "warm Launcher, 2nd and later runs",
                fmt(later, "s", 3),
                f"{fmt_ratio(ratio(later, warm[0]))} of its 1st",
            ],
        ]
    report.targets.append(
        Target(
            "3-node cluster: warm launcher, 2nd and later runs <= 0.25x its 1st",
            fmt_ratio(ratio(later, warm[0] if warm else None)),
            "<= 0.25x",
            None if later is None else later <= 0.25 * warm[0],
        )
    )
    table.notes.append(
        f"{rounds} alternating rounds inside one `salloc -N3`; ratio = vs srun; then one warm "
        f"Launcher runs the same function {rounds + 1} times (one srun step)."
    )
    report.tables.append(table)
    report.data["slurm"] = d


# ------------------------------------------------------------------ output


def render(report: Report) -> str:
    """The report as markdown tables."""
    lines: list[str] = []
    for t in report.tables:
        lines += [
            f"### {t.title}",
            "",
            "| " + " | ".join(t.headers) + " |",
            "|" + "---|" * len(t.headers),
        ]
        lines += ["| " + " | ".join(r) + " |" for r in t.rows]
        lines += [""] + [f"- {n}" for n in t.notes] + [""]
    lines += ["### Targets", "", "| target | measured | wanted | met |", "|---|---|---|---|"]
    for tg in report.targets:
        met = "n/a" if tg.met is None else ("yes" if tg.met else "**NO**")
        lines.append(f"| {tg.name} | {tg.measured} | {tg.target} | {met} |")
    return "\n".join(lines) + "\n"


def machine(python: str) -> dict[str, Any]:
    """What the figures were measured on: CPU, cores, memory, OS, SLURM and torch versions."""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        cpu = platform.processor()
    os_name = platform.platform()
    try:
        with open("/etc/os-release") as f:
            fields = dict(ln.rstrip("\n").split("=", 1) for ln in f if "=" in ln)
        os_name = f"{fields.get('PRETTY_NAME', '').strip(chr(34))}, Linux {platform.release()}"
    except OSError:
        pass
    slurm = ""
    if shutil.which("srun"):
        cp = subprocess.run(
            ["srun", "--version"], capture_output=True, text=True, timeout=30, check=False
        )
        slurm = cp.stdout.strip() if cp.returncode == 0 else ""
    torch = subprocess.run(
        [python, "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    ).stdout.strip()
    return {
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1),
        "os": os_name,
        "slurm": slurm,
        "torch": torch,
    }


def recorded(path: str) -> list[Any]:
    """The `recorded` measurements of an existing results file, which a new run keeps.

    They are figures the docs quote that run.py does not measure (the GPU suite, before/after
    comparisons, earlier runs), each with its date, machine and command; tests/test_figures.py
    checks that every figure a page quotes is in this file.
    """
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return []
    return list(old.get("recorded", [])) if isinstance(old, dict) else []


def meta(cfg: Config) -> dict[str, Any]:
    """Machine and version facts for the JSON file."""

    def version(python: str | None, module: str) -> str:
        if python is None:
            return ""
        cp = subprocess.run(
            [python, "-c", f"import {module}; print({module}.__version__)"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        return cp.stdout.strip()

    commit = subprocess.run(
        ["git", "-C", REPO, "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(cfg.python),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1),
        "python": platform.python_version(),
        "torch": version(cfg.python, "torch"),
        "torchrunx": version(cfg.torchrunx_python, "torchrunx"),
        "slurmrun_commit": commit,
        "quick": cfg.quick,
        "rounds": cfg.rounds,
    }


def main() -> None:
    """Runs the selected scenarios, prints the tables, writes JSON (and plots)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="3 rounds, fewer sizes (~4 min)")
    parser.add_argument("--json", help="write all runs and summaries here")
    parser.add_argument("--plots", help="write the PNG plots into this directory")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(SCENARIOS)}")
    parser.add_argument("--rounds", type=int, help="override the number of rounds")
    parser.add_argument("--torchrunx-python", help="interpreter with torchrunx installed")
    parser.add_argument(
        "--slow-peers",
        action="store_true",
        help="also torchrunx at 256 MiB and all peers in the worker sweep (+5 min)",
    )
    a = parser.parse_args()
    only = tuple(a.only.split(",")) if a.only else SCENARIOS
    unknown = set(only) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; choose from {SCENARIOS}")
    if a.plots and importlib.util.find_spec("matplotlib") is None:  # before, not after, the run
        parser.error("--plots needs matplotlib: pip install -e '.[bench]' (or leave out --plots)")
    workdir = tempfile.mkdtemp(prefix="slurmrun-bench-")
    cfg = Config(
        quick=a.quick,
        rounds=a.rounds or (3 if a.quick else 5),
        slow_peers=a.slow_peers,
        only=only,
        python=sys.executable,
        torchrunx_python=find_torchrunx_python(a.torchrunx_python),
        workdir=workdir,
    )
    # pip compiles a wheel's modules when it installs them; a checkout that was never imported
    # with bytecode writing on (PYTHONDONTWRITEBYTECODE=1 is set on the reference machine) would
    # recompile slurmrun in every agent and worker. Compile it the way an install would.
    compileall.compile_dir(os.path.join(REPO, "slurmrun"), quiet=1, legacy=False)
    report = Report()
    report.data["meta"] = meta(cfg)
    print(
        f"slurmrun benchmarks: rounds={cfg.rounds} quick={cfg.quick} "
        f"torchrunx={cfg.torchrunx_python or 'not installed'} workdir={workdir}",
        flush=True,
    )
    started = time.perf_counter()
    steps: dict[str, Callable[[Config, Report], None]] = {
        "launch": scenario_launch,
        "returns": scenario_returns,
        "failure": scenario_failure,
        "scale": scenario_scale,
        "cli": scenario_cli,
        "slurm": scenario_slurm,
    }
    try:
        for name in SCENARIOS:
            if name in only:
                steps[name](cfg, report)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report.data["meta"]["duration_s"] = round(time.perf_counter() - started, 1)
    text = render(report)
    print("\n" + text)
    print(f"(took {report.data['meta']['duration_s']:.0f} s)")
    if a.json:
        kept = recorded(a.json)
        with open(a.json, "w") as f:
            json.dump(
                {
                    "tables": [asdict(t) for t in report.tables],
                    "targets": [asdict(t) for t in report.targets],
                    **report.data,
                    "recorded": kept,
                },
                f,
                indent=1,
            )
    if a.plots:
        from plots import make_plots

        for path in make_plots(report.data, a.plots):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
