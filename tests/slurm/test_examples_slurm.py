"""The SLURM examples and the docs' cluster blocks, run on the 3-node test cluster.

Everything runs this checkout's slurmrun (PYTHONPATH), whatever is installed.
"""

from __future__ import annotations

import re
import sys

import pytest

from tests.slurm.conftest import JOB_NAME, REPO
from tests.test_docs import of_kind

ENV = {"PYTHONPATH": str(REPO)}


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_sbatch_job_runs_the_quickstart_on_both_nodes(sbatch, monkeypatch, node_processes):
    # sbatch's fixture takes the script's text; the job finds the examples through EXAMPLES_DIR
    # and this checkout through PYTHONPATH (sbatch passes the submitter's environment on).
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("EXAMPLES_DIR", str(REPO / "examples"))
    script = (REPO / "examples" / "sbatch_job.sh").read_text()
    result = sbatch(script, timeout=180)
    ranks = re.findall(r"rank (\d)/4: loss", result.output)
    assert sorted(ranks) == ["0", "1", "2", "3"], result.output
    assert node_processes() == {}


def test_submit_from_login_runs_on_every_node_of_a_new_job(run_cmd, node_processes):
    cp = run_cmd(
        [sys.executable, str(REPO / "examples" / "submit_from_login.py")],
        timeout=240,
        env={**ENV, "SUBMIT_JOB_NAME": JOB_NAME, "SUBMIT_TIMEOUT": "200"},
    )
    assert re.search(r"submitted job \d+", cp.stdout), cp.stdout
    assert "rank 0 on node1: all_reduce gave 2.0" in cp.stdout, cp.stdout
    assert "rank 1 on node2: all_reduce gave 2.0" in cp.stdout, cp.stdout
    assert node_processes() == {}


@pytest.mark.parametrize("block", of_kind("python {cluster}"))
def test_docs_cluster_block_runs_in_an_allocation(block, run_in_allocation, node_processes):
    cp = run_in_allocation(
        ["--nodes=2", "--ntasks-per-node=2"], block.text, timeout=180, check=False, env=ENV
    )
    assert cp.returncode == 0, f"{block.id}:\n{block.text}\n{cp.stdout}\n{cp.stderr}"
    assert node_processes() == {}


@pytest.mark.parametrize("block", of_kind("python {login}"))
def test_docs_login_block_runs_on_the_login_side(block, tmp_path, run_cmd, node_processes):
    # The block submits its own job: give it the tests' job name so the cleanup finds it.
    text = block.text.replace(
        "time_min=5,", f"time_min=5, slurm_parameters={{'job_name': '{JOB_NAME}'}},"
    )
    path = tmp_path / "block.py"
    path.write_text(text)
    cp = run_cmd([sys.executable, str(path)], timeout=240, check=False, env=ENV)
    assert cp.returncode == 0, f"{block.id}:\n{text}\n{cp.stdout}\n{cp.stderr}"
    assert node_processes() == {}
