"""Launch overhead: a trivial function (one all_reduce) on 2 CPU workers.

Launch-call and whole-script time of slurmrun vs the physical floor (2 fresh processes + gloo),
torchrun and torchrunx; first and second launch in one script; where a warm run's time goes;
a 1/4-worker sweep for the plot (full runs only).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from _harness import Run, ratio
from report import Case, Config, Report, Table, Target, fmt, fmt_ratio, med, raw, run_rounds, script


def launch_cases(cfg: Config, workers: int, launches: int, with_torchrunx: bool) -> list[Case]:
    """The trivial launch by each tool on `workers` workers (also the returns scenario's base)."""
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


def first_launch(run: Run) -> float:
    """The first launch call of a run (the whole command for torchrun)."""
    return _launch_times(run)[0]


def _second_launch(run: Run) -> float | None:
    times = _launch_times(run)
    return times[1] if len(times) > 1 else None


def _whole_script_one_launch(run: Run) -> float:
    """Process start to exit, minus the second launch when the script launched twice."""
    second = _second_launch(run)
    return run.wall_s - (second or 0.0)


def measure(cfg: Config, report: Report) -> None:
    """Trivial launch on 2 workers, plus a 1/4-worker sweep (full runs only)."""
    print("== launch: trivial function, 2 CPU workers", flush=True)
    warm = Case(
        "slurmrun-warm/w2",
        [*launch_cases(cfg, 2, 5, False)[2].argv, "--warm"],
    )
    runs = run_rounds(cfg, [*launch_cases(cfg, 2, 2, True), warm])
    tools = [k.split("/")[0] for k in runs]
    stats: dict[str, dict[str, float | None]] = {}
    for key, rs in runs.items():
        tool = key.split("/")[0]
        stats[tool] = {
            "launch": med(rs, first_launch),
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
        for c in launch_cases(cfg, w, 1, cfg.slow_peers)
        if cfg.slow_peers or c.key.split("/")[0] in ("floor", "slurmrun")
    ]
    rounds = cfg.rounds if cfg.slow_peers else min(cfg.rounds, 3)
    runs = run_rounds(cfg, cases, rounds)
    series: dict[str, dict[int, float | None]] = {}
    for key, rs in runs.items():
        tool, w = key.split("/")
        series.setdefault(tool, {})[int(w[1:])] = med(rs, first_launch)
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
