"""The command: `slurmrun train.py` vs `torchrun --standalone --nproc-per-node=2 train.py`,
whole command, one all_reduce (benchmarks/bench_cli.py).
"""

from __future__ import annotations

import json
import os
import subprocess

from report import Config, Report, Table, Target, fmt, fmt_ratio, script


def measure(cfg: Config, report: Report) -> None:
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
