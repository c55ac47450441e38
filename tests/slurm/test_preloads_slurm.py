"""Learned preloads on the real 3-node SLURM test cluster: a successor takes each spawner's place.

Each test runs a launcher script inside ``salloc -N3`` whose workers import `learnme` from a
``site-packages`` directory under tmp_path; the autouse fixture of conftest.py fails any
test that leaves a job in the queue or a process on a node.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import slurmrun
from tests.slurm.slurm_helpers import EMIT_STEPS_LEFT
from tests.slurm.slurm_helpers import emitted_lines as lines

REPO = str(Path(slurmrun.__file__).parents[1])

COMMON = """
import json, os, subprocess, sys, time
import slurmrun

def import_then_wait(wait):
    loaded = "learnme" in sys.modules
    import learnme
    time.sleep(wait)
    return [os.environ["SLURMD_NODENAME"], loaded, os.getppid()]

def emit(name, value):
    print(name + " " + json.dumps(value), flush=True)

def until_loaded(launcher, name):
    # Runs until every node's workers find learnme loaded (at most 4 runs). Run 2 is the first
    # as a rule; with backend None, on the busy test machine, one node's run 2 was seen served
    # by its old spawner (its fork was still importing torch, as it does for a run without a
    # process group, and no run waits for it), and its run 3 by the fork. gloo: torch is the
    # spawner's from the start, the fork imports only learnme.
    for _ in range(4):
        values = launcher.run(import_then_wait, (0.0,)).return_values
        emit(name, values)
        if all(loaded for [[_, loaded, _]] in values):
            return
"""


def site(tmp_path: Path) -> dict[str, str]:
    packages = tmp_path / "site-packages"
    packages.mkdir()
    (packages / "learnme.py").write_text("VALUE = 1\n")
    return {"PYTHONPATH": os.pathsep.join([REPO, str(packages)])}


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_what_run_1_imported_early_is_loaded_on_every_node_at_run_2(
    run_in_allocation, tmp_path: Path
) -> None:
    cp = run_in_allocation(
        ["-N3"],
        COMMON
        + """
with slurmrun.Launcher(timeout=60, backend="gloo") as launcher:
    emit("RUN", launcher.run(import_then_wait, (3.0,)).return_values)
    until_loaded(launcher, "RUN")
""",
        timeout=120,
        env=site(tmp_path),
    )
    runs = [{n: (loaded, spawner) for [[n, loaded, spawner]] in run} for run in lines(cp, "RUN")]  # type: ignore[attr-defined]
    first, last = runs[0], runs[-1]
    assert sorted(last) == ["node1", "node2", "node3"]
    assert not any(loaded for loaded, _ in first.values())
    assert all(loaded for loaded, _ in last.values()), f"not preloaded: {runs}\n{cp.stderr}"
    assert all(first[n][1] != last[n][1] for n in first), "a spawner was not succeeded"
    print(f"every node had learnme loaded at run {len(runs)}")  # 2 unless the machine is busy


def test_a_sigkilled_launcher_leaves_no_successor_on_any_node(
    run_in_allocation, node_processes, tmp_path: Path
) -> None:
    cp = run_in_allocation(
        ["-N3"],
        COMMON
        + """
if sys.argv[1:] == ["child"]:
    with slurmrun.Launcher(timeout=60, heartbeat_timeout=20, backend="gloo") as launcher:
        launcher.run(import_then_wait, (3.0,))
        until_loaded(launcher, "LATER")
        print("DONE", flush=True)
        time.sleep(300)
child = subprocess.Popen([sys.executable, __file__, "child"], stdout=subprocess.PIPE, text=True)
for line in child.stdout:
    print(line, end="", flush=True)
    if line.startswith("DONE"):
        break
child.kill()
child.wait()
"""
        + EMIT_STEPS_LEFT,
        timeout=180,
        env=site(tmp_path),
    )
    last = lines(cp, "LATER")[-1]
    assert all(loaded for [[_, loaded, _]] in last), f"not preloaded: {last}\n{cp.stderr}"  # type: ignore[attr-defined]
    assert lines(cp, "STEPS_LEFT") == [[]], "the agents' step ended with its launcher"
    assert node_processes() == {}
