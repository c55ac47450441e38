"""Failure latency: a worker SIGKILLs itself (or os._exit) while its peer waits in all_reduce;
time from its death to the exception in the launcher.
"""

from __future__ import annotations

import os

from _harness import median
from report import Case, Config, Report, Table, Target, fmt, raw, run_rounds, script, values

FAIL_CAP_S = 60.0


def measure(cfg: Config, report: Report) -> None:
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
