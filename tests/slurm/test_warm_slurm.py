"""Warm launchers on the real 3-node SLURM test cluster: one srun step for every run.

Each test runs a launcher script inside ``salloc -N3``; the autouse fixture of conftest.py
fails any test that leaves a job in the queue or a process on a node.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import slurmrun
from tests.slurm.slurm_helpers import EMIT_STEPS_LEFT
from tests.slurm.slurm_helpers import emitted_lines as lines

REPO = str(Path(slurmrun.__file__).parents[1])

COMMON = """
import json, os, subprocess, sys, time
import psutil, slurmrun

def where():
    import torch.distributed as dist
    dist.barrier()
    agent = psutil.Process().parent().parent()
    return [os.environ["SLURMD_NODENAME"], agent.pid, os.getpid(),
            os.environ["SLURM_STEP_ID"]]

def emit(name, value):
    print(name + " " + json.dumps(value), flush=True)
"""


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_warm_runs_share_one_srun_step_and_fork_fresh_workers(run_in_allocation) -> None:
    cp = run_in_allocation(
        ["-N3"],
        COMMON
        + """
with slurmrun.Launcher(timeout=60) as launcher:
    for _ in range(3):
        t = time.perf_counter()
        emit("RUN", [launcher.run(where).return_values, time.perf_counter() - t])
""",
        timeout=120,
        env={"PYTHONPATH": REPO},
    )
    runs = [values for values, _ in lines(cp, "RUN")]  # type: ignore[misc]
    print("seconds per run:", [seconds for _, seconds in lines(cp, "RUN")])  # type: ignore[misc]
    agents = [[(n, a, s) for [[n, a, _w, s]] in values] for values in runs]
    assert [n for n, _, _ in agents[0]] == ["node1", "node2", "node3"]
    assert agents[0] == agents[1] == agents[2], "the same agents, in the same step"
    assert len({s for _, _, s in agents[0]}) == 1, "one srun step for all agents"
    workers = [w for values in runs for [[_n, _a, w, _s]] in values]
    assert len(set(workers)) == 9, "fresh workers every run"


def test_a_sigkilled_warm_launcher_leaves_nothing_on_any_node(
    run_in_allocation, node_processes
) -> None:
    cp = run_in_allocation(
        ["-N3"],
        COMMON
        + """
if sys.argv[1:] == ["child"]:
    with slurmrun.Launcher(timeout=60, heartbeat_timeout=20) as launcher:
        launcher.run(where)
        emit("IDLE", os.getpid())
        time.sleep(300)
child = subprocess.Popen([sys.executable, __file__, "child"], stdout=subprocess.PIPE, text=True)
line = child.stdout.readline()
print(line, flush=True)
child.kill()
child.wait()
"""
        + EMIT_STEPS_LEFT,
        timeout=180,
        env={"PYTHONPATH": REPO},
    )
    assert lines(cp, "STEPS_LEFT") == [[]], "the agents' step ended with its launcher"
    assert node_processes() == {}


def test_an_agent_killed_on_a_node_fails_its_run_and_the_next_run_gets_new_agents(
    run_in_allocation,
) -> None:
    cp = run_in_allocation(
        ["-N3"],
        COMMON
        + """
def kill_agent_on_node2():
    if os.environ["SLURMD_NODENAME"] == "node2":
        psutil.Process().parent().parent().kill()
    time.sleep(60)

with slurmrun.Launcher(timeout=60) as launcher:
    emit("BEFORE", launcher.run(where).return_values)
    try:
        launcher.run(kill_agent_on_node2)
    except slurmrun.AgentFailedError as e:
        emit("FAILED", str(e).splitlines()[0])
    emit("AFTER", launcher.run(where).return_values)
""",
        timeout=180,
        env={"PYTHONPATH": REPO},
    )
    [failed] = lines(cp, "FAILED")
    assert "node2" in str(failed)
    [before], [after] = lines(cp, "BEFORE"), lines(cp, "AFTER")
    steps = {v[0][3] for v in before}, {v[0][3] for v in after}  # type: ignore[index, union-attr]
    assert len(steps[0]) == len(steps[1]) == 1 and steps[0] != steps[1], "a new step"
