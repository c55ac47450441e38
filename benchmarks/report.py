"""What a benchmark run is made of and what it produces, shared by run.py and the scenarios.

A scenario (benchmarks/scenarios/<name>.py) gets the invocation's `Config`, runs its `Case`s
with `run_rounds`, and adds `Table`s, `Target`s and its raw data to the `Report`, which run.py
renders as markdown (`render`) and writes as JSON (with `meta` and the kept `recorded`).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from _harness import HERE, REPO, Run, median, run_measured

MIB = 1 << 20
GIB = 1 << 30


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


def as_json(report: Report, recorded: list[Any]) -> dict[str, Any]:
    """The results file's content (benchmarks/results/latest.json's keys)."""
    return {
        "tables": [asdict(t) for t in report.tables],
        "targets": [asdict(t) for t in report.targets],
        **report.data,
        "recorded": recorded,
    }


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

    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(cfg.python),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1),
        "python": platform.python_version(),
        "torch": version(cfg.python, "torch"),
        "torchrunx": version(cfg.torchrunx_python, "torchrunx"),
        "slurmrun_commit": slurmrun_commit(),
        "quick": cfg.quick,
        "rounds": cfg.rounds,
    }


def slurmrun_commit() -> str:
    """The checkout's commit (``git describe --always --dirty``) that the figures are of."""
    return subprocess.run(
        ["git", "-C", REPO, "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
