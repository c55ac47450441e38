"""The srun command lines we build, compared with golden files (set UPDATE_GOLDEN=1 to rewrite)."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import pytest

from slurmrun import srun
from slurmrun.allocation import SlurmAllocation

GOLDEN = Path(__file__).parent / "golden"
EXPORT = ["HOME", "PATH", "SLURMRUN_SECRET"]


def _alloc(gpus: list[int] | None, cpus: list[int]) -> SlurmAllocation:
    return SlurmAllocation(
        job_id="42",
        hostnames=["node1", "node2", "node3"],
        cpus_per_node=cpus,
        tasks_per_node=[1, 1, 1],
        gpus_per_node=gpus,
    )


CASES = {
    "cpu_three_nodes": (_alloc([0, 0, 0], [4, 4, 4]), ["node1", "node2", "node3"]),
    "gpus_two_per_node": (_alloc([2, 2, 2], [8, 8, 8]), ["node1", "node2", "node3"]),
    "subset_of_nodes": (_alloc([2, 2, 2], [8, 4, 8]), ["node3", "node2"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_agents_step_command_matches_golden_file(name):
    alloc, hosts = CASES[name]
    cmd = srun.agents_step_command(alloc, hosts, "/logs", EXPORT, srun="srun")
    assert cmd[-3:] == [sys.executable, "-m", "slurmrun.agent_main"]
    text = (
        shlex.join([*cmd[:-3], "PYTHON", "-m", "slurmrun.agent_main"]).replace(" --", " \\\n  --")
        + "\n"
    )
    golden = GOLDEN / f"srun_{name}.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()


def test_the_secret_never_goes_on_the_srun_command_line():
    cmd = srun.agents_step_command(
        CASES["gpus_two_per_node"][0], ["node1"], "/logs", EXPORT, srun="srun"
    )
    assert "--export=HOME,PATH,SLURMRUN_SECRET" in cmd  # the name, so srun copies the value
    assert not any("=deadbeef" in part or part.endswith("SECRET=") for part in cmd)


def test_address_toward_a_host_is_a_local_address():
    assert srun.address_toward("127.0.0.1") == "127.0.0.1"


def test_address_toward_an_unknown_host_says_how_to_override():
    with pytest.raises(RuntimeError, match="SLURMRUN_LAUNCHER_ADDR"):
        srun.address_toward("no-such-host.invalid")
