"""Agents that cannot reach their launcher, on the 3-node test cluster.

Agents retry a refused connect with bounded, jittered backoff (slurmrun.node.agent); one that gives
up exits 1, and the launch fails at once naming its host, not after the connect timeout.
"""

from __future__ import annotations

import re

import pytest

from tests.slurm.conftest import REPO

SCRIPT = """
import slurmrun
from slurmrun.errors import AgentFailedError

try:
    slurmrun.launch(lambda: 1, workers_per_host=1, backend="gloo", timeout=600)
except AgentFailedError as e:
    print("ERROR", e)
"""


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_an_agent_that_gives_up_connecting_fails_the_launch_naming_its_host(
    run_in_allocation, slurm_cluster
) -> None:
    # Agents are told to reach the launcher at node3's address, where nothing listens: every
    # connect is refused. The launch's own connect timeout (600 s) is far beyond the test's.
    env = {
        "PYTHONPATH": str(REPO),
        "SLURMRUN_LAUNCHER_ADDR": slurm_cluster.addr("node3"),
        "SLURMRUN_CONNECT_RETRY": "2",
    }
    cp = run_in_allocation(["-N2"], SCRIPT, timeout=300, env=env)
    assert "ERROR" in cp.stdout, cp.stdout + cp.stderr
    error = cp.stdout[cp.stdout.index("ERROR") :]
    assert "did not connect within" not in error
    assert re.match(r"ERROR the agent on node[12] failed", error), error
    assert f"cannot reach the launcher at {slurm_cluster.addr('node3')}" in error, error
    # The agent's own exit code is srun's word on its task; srun's own code is the step's
    # (143 when srun ends the other tasks with SIGTERM), not the agent's.
    assert re.search(r"srun: node[12]: Exited with exit code 1\b", error), error
    assert re.search(r"; its srun step exited with code \d+", error), error
