"""On the 3-node test cluster (if up): trivial launch vs `srun -N3 python -c "import torch"` in
the same allocation (benchmarks/slurm_bench.py); skipped, with the reason, when it is not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import asdict

from _harness import REPO, median, ratio, run_measured
from report import Config, Report, Table, Target, fmt, fmt_ratio, script


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


def measure(cfg: Config, report: Report) -> None:
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
