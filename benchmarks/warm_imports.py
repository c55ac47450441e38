"""Later runs of a warm launcher whose function imports a heavy package (learned preloads).

Usage:
    python benchmarks/warm_imports.py torch --runs 8 --pause 1
    python benchmarks/warm_imports.py transformers --backend gloo --runs 8 --pause 1

Localhost, 2 workers. Each run's function imports the package and returns whether it was
loaded when the worker started; every run's wall time (the `Launcher.run` call) is printed,
then the median of the runs after the first two (the first starts the agents; the spawner
learns after a run, in the background). ``--pause``: seconds between runs, as between a
notebook's cells. ``--no-learn``: ``learn_preloads=False``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from typing import Any

import slurmrun


def import_it(name: str) -> bool:
    """Whether `name` was loaded when this worker started; imports it."""
    loaded = name in sys.modules
    importlib.import_module(name)
    return loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package")
    parser.add_argument("--backend", default=None)
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--pause", type=float, default=0.0)
    parser.add_argument("--no-learn", action="store_true")
    a = parser.parse_args()
    options: dict[str, Any] = {"workers_per_host": 2, "backend": a.backend}
    if a.no_learn:
        options["learn_preloads"] = False
    times, loaded = [], []
    with slurmrun.Launcher(**options) as launcher:
        for _ in range(a.runs):
            start = time.perf_counter()
            values = launcher.run(import_it, (a.package,)).values()
            times.append(round(time.perf_counter() - start, 3))
            loaded.append(all(values))
            time.sleep(a.pause)
    summary = {"package": a.package, "backend": a.backend, "times": times, "loaded": loaded}
    print(json.dumps(summary))
    print(f"median of runs 3-{a.runs}: {statistics.median(times[2:]):.3f} s")


if __name__ == "__main__":
    main()
