"""`Launcher.map` against issue 49's targets, on the 3-node test cluster (2 fake GPUs a node).

    python benchmarks/map_bench.py            # from the login side: salloc, then the array

Inside ``salloc -N3 --gpus-per-node=2`` (the script runs itself there with ``--inside``):
120 no-op items on the 6 slots of a warm launcher after a warm-up map (three times); 12 items
of 1.5 s on the 6 slots, cold (the map starts the agents) and warm; and, beside them, the same
12 items as a loop of `Launcher.run` calls on a warm launcher (one item a call, every worker
of the allocation running it), and a cold `launch` of a no-op (the cold start). Outside, the
same 12 items as a SLURM job array of 12 tasks (one GPU each), timed from sbatch to the last
task's end; and from the login side as slurmrun submits them, each timed from the submission
to the last value: `slurmrun.submit_map` (one job of 3 nodes x 2 GPUs that maps them) and
`slurmrun.submit_array` (12 one-GPU jobs, each a launch of its own). Prints one
``BENCH_JSON`` line; benchmarks/results/map.json keeps three runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import emit

ITEM_SECONDS = 1.5


def noop(item: int) -> int:
    """An item that does nothing."""
    return item


def busy(item: int) -> int:
    """An item of `ITEM_SECONDS`."""
    time.sleep(ITEM_SECONDS)
    return item


def inside() -> dict[str, Any]:
    """The maps, in the allocation."""
    import slurmrun

    data: dict[str, Any] = {}
    t0 = time.perf_counter()
    slurmrun.launch(noop, (0,), backend="gloo")  # a cold start, for the cold map's reference
    data["cold_launch_noop_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert slurmrun.Launcher(backend="gloo").map(busy, range(12)) == list(range(12))
    data["12x1.5s_cold_s"] = time.perf_counter() - t0
    with slurmrun.Launcher(backend="gloo") as launcher:
        launcher.map(noop, range(6))  # the warm-up map: the agents start
        data["120_noop_s"] = []
        for _ in range(3):
            t0 = time.perf_counter()
            assert launcher.map(noop, range(120)) == list(range(120))
            data["120_noop_s"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        assert launcher.map(busy, range(12)) == list(range(12))
        data["12x1.5s_warm_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for k in range(12):
            launcher.run(busy, (k,))
        data["12x1.5s_run_loop_s"] = time.perf_counter() - t0
    return data


def job_array() -> float:
    """Seconds from sbatch to the end of a 12-task array of `ITEM_SECONDS` sleeps."""
    t0 = time.perf_counter()
    out = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--array=0-11",
            "--gpus-per-node=1",
            "-o",
            "/dev/null",
            "--wrap",
            f"{sys.executable} -c 'import time; time.sleep({ITEM_SECONDS})'",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    job = out.split(";")[0]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        queued = subprocess.run(
            ["squeue", "-h", "-j", job], check=False, capture_output=True, text=True, timeout=30
        ).stdout.strip()
        if not queued:
            return time.perf_counter() - t0
        time.sleep(0.1)
    subprocess.run(["scancel", job], check=False, timeout=30)
    raise TimeoutError("the job array did not end within 300 s")


def submitted(folder: str) -> dict[str, float]:
    """Seconds from submitting to the last value: 12 items as one mapped job, and as an array."""
    import slurmrun

    data: dict[str, float] = {}
    t0 = time.perf_counter()
    job = slurmrun.submit_map(
        busy,
        range(12),
        launcher=slurmrun.Launcher(backend="gloo"),
        nodes=3,
        gpus_per_node=2,
        folder=folder,
        time_min=5,
    )
    assert job.result(timeout=300, poll=0.1) == list(range(12))
    data["12x1.5s_submit_map_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    jobs = slurmrun.submit_array(
        busy, [(k,) for k in range(12)], nodes=1, gpus_per_node=1, folder=folder, time_min=5
    )
    assert [j.result(timeout=300, poll=0.1).values() for j in jobs] == [[k] for k in range(12)]
    data["12x1.5s_submit_array_s"] = time.perf_counter() - t0
    return data


def main() -> None:
    """Runs itself in salloc, then the job array; prints the numbers."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--inside", action="store_true")
    if parser.parse_args().inside:
        print("INSIDE " + json.dumps(inside()), flush=True)
        return
    cp = subprocess.run(
        [
            "salloc",
            "-N3",
            "--gpus-per-node=2",
            sys.executable,
            os.path.abspath(__file__),
            "--inside",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    found = [x[7:] for x in cp.stdout.splitlines() if x.startswith("INSIDE ")]
    if not found:
        emit({"error": (cp.stdout + cp.stderr)[-3000:]})
        return
    data = json.loads(found[0])
    data["12x1.5s_job_array_s"] = job_array()
    with tempfile.TemporaryDirectory(dir=os.getcwd()) as folder:  # the nodes see it
        data.update(submitted(folder))
    emit(data)


if __name__ == "__main__":
    main()
