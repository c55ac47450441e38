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
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import REPO
from report import Config, Report, as_json, meta, recorded, render
from scenarios import SCENARIOS

TORCHRUNX_VENV_PYTHON = os.path.expanduser("~/.cache/slurmrun-bench/torchrunx-venv/bin/python")
NAMES = tuple(SCENARIOS)


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


def main() -> None:
    """Runs the selected scenarios, prints the tables, writes JSON (and plots)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="3 rounds, fewer sizes (~4 min)")
    parser.add_argument("--json", help="write all runs and summaries here")
    parser.add_argument("--plots", help="write the PNG plots into this directory")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(NAMES)}")
    parser.add_argument("--rounds", type=int, help="override the number of rounds")
    parser.add_argument("--torchrunx-python", help="interpreter with torchrunx installed")
    parser.add_argument(
        "--slow-peers",
        action="store_true",
        help="also torchrunx at 256 MiB and all peers in the worker sweep (+5 min)",
    )
    a = parser.parse_args()
    only = tuple(a.only.split(",")) if a.only else NAMES
    unknown = set(only) - set(NAMES)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; choose from {NAMES}")
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
    try:
        for name, measure in SCENARIOS.items():
            if name in only:
                measure(cfg, report)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report.data["meta"]["duration_s"] = round(time.perf_counter() - started, 1)
    text = render(report)
    print("\n" + text)
    print(f"(took {report.data['meta']['duration_s']:.0f} s)")
    if a.json:
        kept = recorded(a.json)
        with open(a.json, "w") as f:
            json.dump(as_json(report, kept), f, indent=1)
    if a.plots:
        from plots import make_plots

        for path in make_plots(report.data, a.plots):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
