"""Reserve once, iterate (issue 48): a reservation's runs beside ``salloc`` + a launcher inside.

    python benchmarks/bench_reserve.py [--rounds 5] [--record benchmarks/results/latest.json]

On the login side of the SLURM test cluster (no SLURM_* variables; tests/cluster/). Two nodes,
one CPU worker each, a trivial function (each rank returns its rank). First ``salloc -N2``
with this script inside it (``--child salloc``): cold launches, a warm launcher's runs, calls
with ``keep_workers``. Then, from here, the same on ``slurmrun.reserve(nodes=2)`` with
``Launcher(job=J)``; a new launcher process's first run (from its first line, ``import
slurmrun`` included, to its result: what it costs beyond its interpreter's start);
``release()`` until SLURM says the job ended; a launcher SIGKILLed mid-run until its workers
are gone from every node; a reservation left idle until SLURM says it ended. Prints a table and
the issue's targets; ``--record`` puts both into the results file's ``recorded`` list.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import MARK, emit, record, render

TITLE = "Reserve once, iterate (issue 48): the targets, beside salloc and a launcher inside it"
HEARTBEAT = 5.0  # the reservation's heartbeat_timeout
IDLE = 5.0  # the idle reservation's idle_timeout


def rank() -> int:
    """The trivial function: each rank returns its rank."""
    return int(os.environ["RANK"])


def nap() -> None:
    """A run that goes on until it is stopped."""
    time.sleep(300)


def median_s(values: list[float]) -> float:
    return statistics.median(values)


def timed(call: Any, *args: Any, **kwargs: Any) -> float:
    started = time.perf_counter()
    values = call(*args, **kwargs).values()
    elapsed = time.perf_counter() - started
    if values != list(range(len(values))) or not values:
        raise RuntimeError(f"unexpected values {values}")
    return elapsed


def series(rounds: int, job: str | None) -> dict[str, list[float]]:
    """Cold launches, a warm launcher's later runs, kept workers' calls (inside, or on `job`)."""
    import slurmrun

    where: dict[str, Any] = {"job": job} if job else {}
    out: dict[str, list[float]] = {"cold": [], "warm_first": [], "warm": [], "kept": []}
    for _ in range(rounds):
        out["cold"].append(timed(slurmrun.launch, rank, timeout=120, **where))
    with slurmrun.Launcher(timeout=120, **where) as launcher:
        out["warm_first"].append(timed(launcher.run, rank))
        out["warm"] += [timed(launcher.run, rank) for _ in range(rounds * 2)]
    with slurmrun.Launcher(timeout=120, keep_workers=True, **where) as launcher:
        timed(launcher.run, rank)
        out["kept"] += [timed(launcher.run, rank) for _ in range(rounds * 6)]
    return out


def child_salloc(rounds: int) -> dict[str, Any]:
    """Inside ``salloc -N2``: the baseline."""
    return series(rounds, None)


NEW_PROCESS = """
import time
started = time.perf_counter()
import slurmrun
imported = time.perf_counter()
def rank():
    import os
    return int(os.environ["RANK"])
assert slurmrun.launch(rank, job={job!r}, timeout=60).values() == [0, 1]
done = time.perf_counter()
print("SECONDS", done - started, done - imported)
"""

KILLED = """
import time
import slurmrun
def nap():
    time.sleep(300)
print("starting", flush=True)
slurmrun.launch(nap, job={job!r}, timeout=60)
"""


def workers_of(job: str) -> list[int]:
    """The pids of job `job`'s workers on any node (the cluster's nodes share our pids)."""
    found = []
    needle = f"SLURM_JOB_ID={job}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            if not cmdline.startswith(b"slurmrun: ") or b" rank " not in cmdline:
                continue
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def until(check: Any, timeout: float, step: float = 0.05) -> float:
    """Seconds until `check()` is true (`timeout` if never)."""
    started = time.perf_counter()
    while not check() and time.perf_counter() - started < timeout:
        time.sleep(step)
    return time.perf_counter() - started


def killed_run(job: str) -> float:
    """A launcher SIGKILLed mid-run: seconds until its workers are gone from every node."""
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED.format(job=job)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        until(lambda: len(workers_of(job)) == 2, 30)
        proc.kill()
        proc.wait(10)
        return until(lambda: not workers_of(job), HEARTBEAT + 30)
    finally:
        proc.kill()


def reservation(rounds: int, folder: Path) -> dict[str, Any]:
    """The same series on a reservation, and its ends."""
    import slurmrun

    out: dict[str, Any] = {}
    started = time.perf_counter()
    r = slurmrun.reserve(nodes=2, time_min=15, heartbeat_timeout=HEARTBEAT, folder=folder)
    try:
        r.wait(300)
        out["ready_s"] = time.perf_counter() - started
        out["first_s"] = timed(slurmrun.launch, rank, job=r.job_id, timeout=120)
        out.update(series(rounds, r.job_id))
        out["new_process"], out["new_process_past_imports"] = [], []
        for _ in range(rounds):
            said = subprocess.run(
                [sys.executable, "-c", NEW_PROCESS.format(job=r.job_id)],
                capture_output=True, text=True, timeout=120, check=True,
            ).stdout  # fmt: skip
            whole, past = said.split("SECONDS")[1].split()
            out["new_process"].append(float(whole))
            out["new_process_past_imports"].append(float(past))
        out["killed"] = [killed_run(r.job_id) for _ in range(3)]
        timed(slurmrun.launch, rank, job=r.job_id, timeout=120)  # free again
    finally:
        released = time.perf_counter()
        r.release(60)
        out["release_s"] = time.perf_counter() - released
    idle = slurmrun.reserve(nodes=2, time_min=5, idle_timeout=IDLE, folder=folder)
    try:
        idle.wait(300)
        ready = time.perf_counter()
        until(lambda: idle.state not in ("RUNNING", "COMPLETING"), IDLE + 60, 0.2)
        out["idle_gone_s"] = time.perf_counter() - ready
    finally:
        idle.release(60)
    return out


def salloc(rounds: int) -> dict[str, Any]:
    """The baseline, in ``salloc -N2`` with this script's child inside it."""
    cp = subprocess.run(
        ["salloc", "-N2", "--ntasks-per-node=1", "--time=10", "--job-name=slurmrun-bench",
         sys.executable, os.path.abspath(__file__), "--child", "salloc", "--rounds", str(rounds)],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    line = next((ln for ln in cp.stdout.splitlines() if ln.startswith(MARK)), None)
    if line is None:
        raise RuntimeError(f"salloc's child said nothing:\n{cp.stdout[-3000:]}{cp.stderr[-3000:]}")
    return dict(json.loads(line[len(MARK) :]))


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 0.1 else f"{seconds:.2f} s"


def target(name: str, measured: float, limit: float, shown: str, unit: str) -> list[str]:
    return [name, shown, f"<= {limit:g}{unit}", "yes" if measured <= limit else "NO"]


def report(base: dict[str, Any], res: dict[str, Any]) -> tuple[list[list[str]], list[list[str]]]:
    """The table (inside salloc, reservation) and the targets."""
    m = {k: median_s(v) for k, v in {**base}.items() if isinstance(v, list)}
    n = {k: median_s(v) for k, v in res.items() if isinstance(v, list)}
    rows = [
        ["a cold launch (inside: a new srun step; reservation: launch(job=J))",
         ms(m["cold"]), ms(n["cold"])],
        ["the first run once the job runs (reservation: first launch in this process)",
         ms(m["cold"]), ms(res["first_s"])],
        ["a warm launcher's later runs", ms(m["warm"]), ms(n["warm"])],
        ["a call with keep_workers", ms(m["kept"]), ms(n["kept"])],
        ["a new launcher process's first run, from its first line (import slurmrun included)",
         "", ms(n["new_process"])],
        ["the agents ready after submitting", "", ms(res["ready_s"])],
        ["release() until SLURM says the job ended", "", ms(res["release_s"])],
        [f"a SIGKILLed launcher's run gone from every node (heartbeat_timeout {HEARTBEAT:g} s)",
         "", ms(n["killed"])],
        [f"an idle reservation ended by SLURM, from its agents ready (idle_timeout {IDLE:g} s)",
         "", ms(res["idle_gone_s"])],
    ]  # fmt: skip
    first = res["first_s"] / m["cold"]
    later = n["warm"] / m["warm"]
    killed = max(res["killed"])
    targets = [
        target("first run once the job runs <= 1.5x a cold launch inside the job", first, 1.5,
               f"{first:.2f}x", "x"),
        target("later runs <= 1.2x a warm run inside the job", later, 1.2, f"{later:.2f}x", "x"),
        target("a call with keep_workers <= 5 ms", n["kept"] * 1000, 5, ms(n["kept"]), " ms"),
        target("a new launcher process's first run <= 1 s beyond its Python start",
               n["new_process"], 1.0, ms(n["new_process"]), " s"),
        target("release() -> job gone <= 10 s", res["release_s"], 10, ms(res["release_s"]), " s"),
        target(f"client SIGKILLed -> run stopped on every node <= heartbeat_timeout + 5 s "
               f"({HEARTBEAT + 5:g} s)", killed, HEARTBEAT + 5, ms(killed), " s"),
        target(f"idle reservation gone <= idle_timeout + 15 s ({IDLE + 15:g} s)",
               res["idle_gone_s"], IDLE + 15, ms(res["idle_gone_s"]), " s"),
    ]  # fmt: skip
    return rows, targets


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--folder", default="slurmrun_jobs", help="the reservations' folder")
    parser.add_argument("--record", help="put the table and targets into this results file")
    parser.add_argument("--child", choices=["salloc"], help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.child:
        emit(child_salloc(a.rounds))
        return
    if any(k.startswith("SLURM_JOB") for k in os.environ):
        parser.error("run it on the login side, outside any job (SLURM_JOB_* is set)")
    started = time.perf_counter()
    base = salloc(a.rounds)
    res = reservation(a.rounds, Path(a.folder))
    rows, targets = report(base, res)
    headers = ["what", "inside salloc -N2", "reservation (direct)"]
    print(f"\n### {TITLE}\n\n{render(headers, rows)}\n")
    print(render(["target", "measured", "wanted", "met"], targets))
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    if a.record:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from report import machine, slurmrun_commit

        facts = machine(sys.executable)
        date = datetime.datetime.now().isoformat(timespec="seconds")
        desc = (
            f"{facts['cpu_model']}, {facts['cores']} cores, {facts['mem_total_gib']} GiB, "
            f"{facts['os']}, {facts['slurm']} (the 3-node test cluster), Python "
            f"{sys.version.split()[0]}, slurmrun {slurmrun_commit()}"
        )
        how = (
            f"python benchmarks/bench_reserve.py --rounds {a.rounds}: 2 nodes, one CPU worker "
            "each, each rank returns its rank; medians; the launcher on the login side"
        )
        common = {"date": date[:10], "machine": desc, "how": how, "notes": []}
        record(a.record, {"title": TITLE, **common, "headers": headers, "rows": rows})
        target_headers = ["target", "measured", "wanted", "met"]
        entry = {"title": f"{TITLE}: targets", **common, "headers": target_headers}
        record(a.record, {**entry, "rows": targets})
        print(f"recorded in {a.record}")


if __name__ == "__main__":
    main()
