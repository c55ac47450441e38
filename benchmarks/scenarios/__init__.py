"""The scenarios of benchmarks/run.py, each a module with one entry point, `measure`.

`measure(cfg, report)` runs its measured cases and adds its tables, targets and data to the
report. SCENARIOS lists them in the order run.py runs them (returns reuses launch's medians).
"""

from __future__ import annotations

from collections.abc import Callable

from report import Config, Report

from . import cli, failure, launch, returns, scale, slurm

SCENARIOS: dict[str, Callable[[Config, Report], None]] = {
    "launch": launch.measure,
    "returns": returns.measure,
    "failure": failure.measure,
    "scale": scale.measure,
    "cli": cli.measure,
    "slurm": slurm.measure,
}
