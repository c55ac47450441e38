"""Output throughput: MB/s from a worker's prints to the launcher's terminal and to the files.

    python benchmarks/bench_output.py [--mb 100] [--rounds 3] [--repo PATH ...] [--no-srun]

A worker prints `--mb` MB of 100-byte lines as fast as Python writes them; the figure is the
marginal rate, MB / (time with the lines - time of the same command printing nothing), so
that start-up costs cancel out. Rows:

- floor: the same Python loop writing to the file itself (no relay at all);
- srun relay: ``srun -N1 python -c ...`` on the SLURM test cluster, stdout to a file (the
  peer: SLURM's own output forwarding; skipped without ``sinfo``);
- slurmrun terminal: ``slurmrun.launch`` on localhost, rank 0's lines on the launcher's stdout
  (a file: the default handlers, with their ``[host:rank]`` prefix);
- slurmrun files: rank 1's lines into its log file (``$SLURMRUN_LOG_DIR``; the agent writes
  it), none shown: the files' own rate.

Each ``--repo`` (a checkout) is measured in turn, for before/after tables; every line count is
checked, so a relay that drops lines shows as such instead of as a fast one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LINE = 100  # bytes per line, newline included
REPO = Path(__file__).resolve().parent.parent

PRINT = f"""
import sys
n = int(sys.argv[1])
filler = "x" * {LINE - 12}
write = sys.stdout.write
for i in range(n):
    write(f"{{i:010d}} {{filler}}\\n")
sys.stdout.flush()
"""

LAUNCH = f"""
import os, sys
import slurmrun

def work(n, rank):
    if int(os.environ["RANK"]) == rank:
        filler = "x" * {LINE - 12}
        write = sys.stdout.write
        for i in range(n):
            write(f"{{i:010d}} {{filler}}\\n")
        sys.stdout.flush()
    return 0

n, rank = int(sys.argv[1]), int(sys.argv[2])
slurmrun.launch(work, (n, rank), hostnames=["localhost"], workers_per_host=2, backend="gloo")
"""


def _timed(cmd: list[str], out: Path, env: dict[str, str]) -> float:
    # In the output's folder: `python -c` imports from its working directory first, which
    # would be this checkout, whatever --repo says.
    with out.open("wb") as f:
        t0 = time.perf_counter()
        subprocess.run(
            cmd,
            stdout=f,
            stderr=subprocess.DEVNULL,
            env=env,
            check=True,
            timeout=900,
            cwd=out.parent,
        )
        return time.perf_counter() - t0


def _lines_in(path: Path) -> int:
    with path.open("rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


def _rate(mb: float, full: list[float], empty: list[float]) -> float:
    return mb / max(1e-6, statistics.median(full) - statistics.median(empty))


def measure(
    name: str,
    cmd: list[str],
    lines: int,
    rounds: int,
    env: dict[str, str],
    *,
    counted: str | None = None,
) -> tuple[str, float, str]:
    """(row, MB/s, what arrived) for `cmd`, which takes the line count as its last argument."""
    work = Path(tempfile.mkdtemp(prefix="slurmrun-bench-output-"))
    try:
        full, empty, arrived = [], [], ""
        for _ in range(rounds):
            for n, series in ((0, empty), (lines, full)):
                logs = work / "logs"
                shutil.rmtree(logs, ignore_errors=True)
                logs.mkdir()
                argv = [a.replace("LINES", str(n)) for a in cmd]
                run_env = {k: v.replace("LOGS", str(logs)) for k, v in env.items()}
                series.append(_timed(argv, work / "out", run_env))
            where = work / "out" if counted is None else next(logs.rglob(counted), work / "none")
            got = _lines_in(where) if where.exists() else 0
            arrived = f"{got}/{lines}" if got != lines else "all"
        return name, _rate(lines * LINE / 1e6, full, empty), arrived
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    """Measures every row for every --repo and prints a markdown table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repo", action="append", help="a checkout to measure (default: this)")
    parser.add_argument("--no-srun", action="store_true")
    a = parser.parse_args()
    lines = int(a.mb * 1e6 / LINE)
    env = dict(os.environ)
    rows: list[tuple[str, float, str]] = []
    rows.append(
        measure(
            "floor (python > file)", [sys.executable, "-c", PRINT, "LINES"], lines, a.rounds, env
        )
    )
    if not a.no_srun and shutil.which("sinfo"):
        cmd = ["srun", "-N1", sys.executable, "-c", PRINT, "LINES"]
        rows.append(measure("srun relay (srun -N1)", cmd, lines, a.rounds, env))
    for repo in a.repo or [str(REPO)]:
        env = {**os.environ, "PYTHONPATH": repo, "SLURMRUN_LOG_DIR": ""}
        script = [sys.executable, "-c", LAUNCH]
        tag = Path(repo).name
        rows.append(
            measure(f"slurmrun terminal ({tag})", [*script, "LINES", "0"], lines, a.rounds, env)
        )
        env = {**env, "SLURMRUN_LOG_DIR": "LOGS"}
        rows.append(
            measure(
                f"slurmrun files ({tag})",
                [*script, "LINES", "1"],
                lines,
                a.rounds,
                env,
                counted="*.1.log",
            )
        )
    peer = next((r for r in rows if r[0].startswith("srun")), None)
    print(f"\n{a.mb:g} MB in {LINE}-byte lines, median of {a.rounds} rounds (marginal MB/s)\n")
    print("| relay | MB/s | / srun | lines arrived |")
    print("|---|---|---|---|")
    for name, rate, arrived in rows:
        ratio = f"{rate / peer[1]:.2f}" if peer else "-"
        print(f"| {name} | {rate:.1f} | {ratio} | {arrived} |")


if __name__ == "__main__":
    main()
