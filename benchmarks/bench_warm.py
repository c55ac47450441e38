"""Warm runs against Monarch: the time of a later call on workers that are already up.

    python benchmarks/bench_warm.py [--calls 30] [--json benchmarks/results/warm.json]
                                    [--only monarch,slurmrun,slurmrun-kept]
                                    [--monarch-python PATH]
                                    [--record benchmarks/results/latest.json]

Localhost, 2 workers. Per case and tool, one fresh subprocess starts the workers (Monarch:
``this_host().spawn_procs(per_host={"procs": 2})`` and an actor mesh; slurmrun: a
``with Launcher(hostnames=["localhost"], workers_per_host=2, backend=...)`` block), makes
the first call, then `--calls` later calls, each timed from the caller. Every tool runs in
its own interpreter, so no tool's imports reach another's workers. Cases:

  trivial       return the rank (slurmrun: backend=None)
  trivial-gloo  return dist.get_rank() (slurmrun only: backend="gloo")
  transformers  import transformers, return its version (slurmrun: backend="gloo")
  torch         import torch, return its version (slurmrun: backend=None)
  state         call 1 writes a value into the workers' state, later calls read it (Monarch:
                an attribute of the actor; slurmrun: ``slurmrun.worker_state()``, kept workers
                only)

``slurmrun-kept`` is ``Launcher(..., keep_workers=True)``; where the Launcher has no such
field, its rows say so. Monarch runs under its own interpreter (it needs cloudpickle>=3;
``bash benchmarks/setup_peers.sh`` installs it): ``--monarch-python``, ``MONARCH_PYTHON`` or
the venv setup_peers.sh makes; without one its rows are skipped.

One measured run (what the suite starts):

    python benchmarks/bench_warm.py --child slurmrun --case torch --calls 30
"""

from __future__ import annotations

import argparse
import compileall
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import REPO, Run, emit, record, render, run_measured

TOOLS = ("monarch", "slurmrun", "slurmrun-kept")
CASES = ("trivial", "trivial-gloo", "transformers", "torch", "state")
WORKERS = 2
MONARCH_VENV_PYTHON = os.path.expanduser("~/.cache/slurmrun-bench/monarch-venv/bin/python")
CAP_S = 600.0
TITLE = "Warm runs against Monarch: a later call on 2 workers already up, localhost"
# Cases a tool cannot run, and why (the table says so instead of a time).
NOT_APPLICABLE = {
    ("monarch", "trivial-gloo"): "n/a (no process group)",
    ("slurmrun", "state"): "n/a (fresh workers every run)",
}
# What each case calls, as the table's first column says it.
CASE_LABELS = {
    "trivial": "trivial: return the rank (slurmrun: backend=None)",
    "trivial-gloo": 'trivial, backend="gloo"',
    "transformers": 'import transformers (slurmrun: backend="gloo")',
    "torch": "import torch (slurmrun: backend=None)",
    "state": "state written in call 1, read in later calls",
}

# ------------------------------------------------------------------ slurmrun's functions
# Defined in __main__, so slurmrun ships them by value with cloudpickle.


def rank_plain() -> int:
    return int(os.environ["RANK"])


def rank_gloo() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def uses_transformers() -> str:
    import transformers

    return str(transformers.__version__)


def uses_torch() -> str:
    import torch

    return str(torch.__version__)


def state_write(value: int) -> int:
    import slurmrun

    slurmrun.worker_state()["value"] = value  # kept workers only (slurmrun.worker_state)
    return value


def state_read() -> int:
    import slurmrun

    return int(slurmrun.worker_state()["value"])


# ------------------------------------------------------------------ measured runs


def installed(module: str) -> str:
    """A package's version from its metadata: the caller must not import what it measures."""
    from importlib.metadata import version

    return version(module)


def timed_calls(
    started: float, first: Callable[[], bool], later: Callable[[], bool], calls: int
) -> dict[str, Any]:
    """The first call (timed from `started`, the workers' start) and `calls` later ones."""
    ok = first()
    first_s = time.perf_counter() - started
    later_s: list[float] = []
    for _ in range(calls):
        t0 = time.perf_counter()
        ok = later() and ok
        later_s.append(time.perf_counter() - t0)
    return {"first_s": first_s, "later_s": later_s, "ok": ok}


def child_monarch(case: str, calls: int) -> dict[str, Any]:
    """Monarch: spawn 2 procs on this host, one actor each, call an endpoint on all of them."""
    t0 = time.perf_counter()
    from monarch.actor import (  # type: ignore[import-not-found]  # in its own venv
        Actor,
        current_rank,
        endpoint,
        this_host,
    )

    import_s = time.perf_counter() - t0

    class Bench(Actor):  # type: ignore[misc]  # monarch ships no type information
        def __init__(self) -> None:
            self.state: dict[str, int] = {}

        @endpoint  # type: ignore[untyped-decorator]
        def rank(self) -> int:
            return int(current_rank().rank)

        @endpoint  # type: ignore[untyped-decorator]
        def transformers(self) -> str:
            import transformers

            return str(transformers.__version__)

        @endpoint  # type: ignore[untyped-decorator]
        def torch(self) -> str:
            import torch

            return str(torch.__version__)

        @endpoint  # type: ignore[untyped-decorator]
        def write(self, value: int) -> int:
            self.state["value"] = value
            return value

        @endpoint  # type: ignore[untyped-decorator]
        def read(self) -> int:
            return self.state["value"]

    def values(endpoint_: Any, *args: Any) -> list[Any]:
        return list(endpoint_.call(*args).get().values())

    started = time.perf_counter()
    procs = this_host().spawn_procs(per_host={"procs": WORKERS})
    actors = procs.spawn("bench", Bench)
    ranks = list(range(WORKERS))
    if case == "trivial":
        data = timed_calls(
            started,
            lambda: values(actors.rank) == ranks,
            lambda: values(actors.rank) == ranks,
            calls,
        )
    elif case in ("transformers", "torch"):
        want = [installed(case)] * WORKERS
        ep = getattr(actors, case)
        data = timed_calls(started, lambda: values(ep) == want, lambda: values(ep) == want, calls)
    else:
        data = timed_calls(
            started,
            lambda: values(actors.write, 7) == [7] * WORKERS,
            lambda: values(actors.read) == [7] * WORKERS,
            calls,
        )
    procs.stop().get()
    return {**data, "import_s": import_s, "version": installed("torchmonarch"), "available": True}


def child_slurmrun(case: str, calls: int, kept: bool) -> dict[str, Any]:
    """slurmrun: one warm Launcher block (with ``keep_workers=True`` if `kept`)."""
    import dataclasses

    t0 = time.perf_counter()
    import slurmrun

    import_s = time.perf_counter() - t0
    options: dict[str, Any] = {"hostnames": ["localhost"], "workers_per_host": WORKERS}
    if kept:
        if "keep_workers" not in {f.name for f in dataclasses.fields(slurmrun.Launcher)}:
            return {"available": False}
        options["keep_workers"] = True
    ranks = list(range(WORKERS))
    started = time.perf_counter()
    if case in ("trivial", "trivial-gloo"):
        func = rank_plain if case == "trivial" else rank_gloo
        backend: Literal["gloo"] | None = None if case == "trivial" else "gloo"
        with slurmrun.Launcher(**options, backend=backend) as launcher:

            def call() -> bool:
                return list(launcher.run(func).values()) == ranks

            data = timed_calls(started, call, call, calls)
    elif case in ("transformers", "torch"):
        want = [installed(case)] * WORKERS
        func_v = uses_transformers if case == "transformers" else uses_torch
        backend_v: Literal["gloo"] | None = "gloo" if case == "transformers" else None
        with slurmrun.Launcher(**options, backend=backend_v) as launcher:

            def call_v() -> bool:
                return list(launcher.run(func_v).values()) == want

            data = timed_calls(started, call_v, call_v, calls)
    else:
        with slurmrun.Launcher(**options, backend=None) as launcher:
            data = timed_calls(
                started,
                lambda: list(launcher.run(state_write, (7,)).values()) == [7] * WORKERS,
                lambda: list(launcher.run(state_read).values()) == [7] * WORKERS,
                calls,
            )
    return {**data, "import_s": import_s, "available": True}


# ------------------------------------------------------------------ the suite


def find_monarch_python(explicit: str | None) -> str | None:
    """An interpreter that can import monarch.actor (a venv of its own: cloudpickle>=3)."""
    for python in (explicit, os.environ.get("MONARCH_PYTHON"), MONARCH_VENV_PYTHON):
        if python and os.path.exists(python):
            probe = subprocess.run(
                [python, "-c", "import monarch.actor"],
                capture_output=True,
                timeout=120,
                check=False,
            )
            if probe.returncode == 0:
                return python
            print(f"bench_warm: {python} cannot import monarch.actor; trying the next one")
    return None


def p90(values: Sequence[float]) -> float:
    """The 90th percentile (inclusive: between the largest values for few samples)."""
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def fmt(x: float) -> str:
    """A time in ms below 0.1 s (Monarch's calls take about a millisecond), else in s."""
    return f"{x * 1000:.1f} ms" if x < 0.1 else f"{x:.2f} s"


def row(case: str, tool: str, run: Run | str) -> list[str]:
    """One table row: a case, a tool, its first call, later median and p90 (or why none)."""
    if isinstance(run, str):
        return [CASE_LABELS[case], tool, run, "", ""]
    data = run.data
    if data.get("available") is False:
        return [CASE_LABELS[case], tool, "n/a (not available)", "", ""]
    if not run.ok or not data.get("ok"):
        return [CASE_LABELS[case], tool, "FAILED", "", ""]
    later = data["later_s"]
    return [
        CASE_LABELS[case],
        tool,
        fmt(data["first_s"]),
        fmt(statistics.median(later)),
        fmt(p90(later)),
    ]


def versions(python: str, packages: Sequence[str]) -> dict[str, str]:
    """The installed version of each package under `python` ('' where it is missing)."""
    code = (
        "import json, sys\n"
        "from importlib.metadata import PackageNotFoundError, version\n"
        "out = {}\n"
        "for p in sys.argv[1:]:\n"
        "    try: out[p] = version(p)\n"
        "    except PackageNotFoundError: out[p] = ''\n"
        "print(json.dumps(out))\n"
    )
    cp = subprocess.run(
        [python, "-c", code, *packages], capture_output=True, text=True, timeout=300, check=False
    )
    return dict(json.loads(cp.stdout)) if cp.returncode == 0 else {}


def suite(a: argparse.Namespace) -> None:
    """Runs every (case, tool) in its own subprocess; prints the table; writes the JSON."""
    tools = tuple(a.only.split(",")) if a.only else TOOLS
    monarch_python = find_monarch_python(a.monarch_python) if "monarch" in tools else None
    if "monarch" in tools and monarch_python is None:
        print(
            "bench_warm: monarch rows skipped: no interpreter imports monarch.actor "
            "(bash benchmarks/setup_peers.sh, or --monarch-python PATH, or MONARCH_PYTHON)"
        )
    # As run.py does: an editable checkout would otherwise be byte-compiled in every agent.
    compileall.compile_dir(os.path.join(REPO, "slurmrun"), quiet=1, legacy=False)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
    }
    workdir = tempfile.mkdtemp(prefix="slurmrun-bench-warm-")
    load_before = os.getloadavg()[0]  # the 2-core reference machine is shared: say how busy
    runs: dict[str, Any] = {}
    rows: list[list[str]] = []
    for case in CASES:
        for tool in tools:
            if (tool, case) in NOT_APPLICABLE:
                rows.append(row(case, tool, NOT_APPLICABLE[tool, case]))
                continue
            if tool == "monarch" and monarch_python is None:
                rows.append(row(case, tool, "skipped (monarch not installed)"))
                continue
            python = monarch_python if tool == "monarch" and monarch_python else sys.executable
            argv = [python, os.path.abspath(__file__), "--child", tool, "--case", case]
            run = run_measured([*argv, "--calls", str(a.calls)], cap_s=CAP_S, env=env, cwd=workdir)
            runs[f"{tool}/{case}"] = {
                "wall_s": run.wall_s,
                "returncode": run.returncode,
                "data": run.data,
                **({} if run.ok else {"stderr_tail": run.stderr_tail}),
            }
            rows.append(row(case, tool, run))
            print(f"  {tool:<14} {case:<13} {run.wall_s:6.1f} s  {' | '.join(rows[-1][2:])}")
            if not run.ok or not run.data.get("ok", True):
                print("    " + (run.stderr_tail or run.stdout_tail)[-800:].replace("\n", "\n    "))
    shutil.rmtree(workdir, ignore_errors=True)
    headers = ["case", "tool", "first call (with the workers' start)", "later median", "later p90"]
    notes = [
        f"{a.calls} later calls after the first; each timed in the caller, from the call to "
        "every worker's value in hand. The first call includes starting the workers (Monarch: "
        "spawn_procs + spawn; slurmrun: the Launcher block's agents).",
        "Every (case, tool) is a fresh interpreter: no tool's imports reach another's workers.",
    ]
    print(
        "\n### "
        + TITLE
        + "\n\n"
        + render(headers, rows)
        + "\n\n"
        + "\n".join(f"- {n}" for n in notes)
    )
    from report import machine, slurmrun_commit  # as latest.json describes them

    facts = machine(sys.executable)
    vers = versions(sys.executable, ["torch", "transformers"])
    if monarch_python:
        vers["torchmonarch"] = versions(monarch_python, ["torchmonarch"]).get("torchmonarch", "")
    commit = slurmrun_commit()
    date = datetime.datetime.now().isoformat(timespec="seconds")
    table = {"title": TITLE, "headers": headers, "rows": rows, "notes": notes}
    if a.json:
        meta = {
            "date": date,
            "machine": facts,
            "versions": vers,
            "slurmrun_commit": commit,
            "load_average_before": load_before,
            "calls": a.calls,
        }
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "tables": [table], "runs": runs}, f, indent=1)
        print(f"wrote {a.json}")
    if a.record:
        desc = (
            f"{facts['cpu_model']}, {facts['cores']} cores, {facts['mem_total_gib']} GiB, "
            f"{facts['os']}, Python {sys.version.split()[0]}, torch {vers.get('torch')}, "
            f"transformers {vers.get('transformers')}, "
            f"torchmonarch {vers.get('torchmonarch') or 'absent'}, "
            f"slurmrun {commit}; load average {load_before:.1f} before the run"
        )
        how = (
            "python benchmarks/bench_warm.py --calls "
            + str(a.calls)
            + " ("
            + (a.json or "no json")
            + ")"
        )
        record(a.record, {**table, "date": date[:10], "machine": desc, "how": how})
        print(f"recorded in {a.record}")


def main() -> None:
    """Parses the command line: the suite, or one measured run (--child)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=30, help="later calls after the first")
    parser.add_argument("--json", help="write the table and every run here")
    parser.add_argument("--record", help="also put the table into this results file's `recorded`")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(TOOLS)}")
    parser.add_argument("--monarch-python", help="interpreter with torchmonarch installed")
    parser.add_argument("--child", choices=TOOLS, help=argparse.SUPPRESS)
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.only and set(a.only.split(",")) - set(TOOLS):
        parser.error(f"--only: choose from {','.join(TOOLS)}")
    if a.child is None:
        suite(a)
    elif a.child == "monarch":
        emit(child_monarch(a.case, a.calls))
    else:
        emit(child_slurmrun(a.case, a.calls, kept=a.child == "slurmrun-kept"))


if __name__ == "__main__":
    main()
