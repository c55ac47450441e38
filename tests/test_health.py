"""A node's health check before its workers start: a failing node is lost, and named."""

from __future__ import annotations

from pathlib import Path

import pytest

import slurmrun

# Fails on the second node (its index is GROUP_RANK), saying why on its output.
ONLY_NODE_0 = 'if [ "$GROUP_RANK" != 0 ]; then echo "GPU 3 is gone"; exit 3; fi'


@pytest.fixture(autouse=True)
def _logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path / "logs"))


def test_a_node_failing_its_health_check_is_named_with_the_commands_output() -> None:
    with pytest.raises(slurmrun.NodeUnhealthyError) as caught:
        slurmrun.launch(
            lambda: 1, hostnames=["localhost", "localhost"], workers_per_host=1, backend=None,
            health_check=ONLY_NODE_0,
        )  # fmt: skip
    error = caught.value
    assert error.node_rank == 1 and error.hostname == "localhost"
    assert "localhost failed its health check:" in str(error)
    assert "failed (exit status 3): GPU 3 is gone" in str(error), error


def test_with_min_hosts_the_run_restarts_without_the_unhealthy_node() -> None:
    result = slurmrun.launch(
        lambda: 1, hostnames=["localhost", "localhost"], workers_per_host=1, backend=None,
        health_check=ONLY_NODE_0, max_restarts=1, min_hosts=1,
    )  # fmt: skip
    assert result.return_values == [[1]]
    assert list(result.lost_hosts) == ["localhost#1"]
    assert result.lost_hosts["localhost#1"].endswith("failed (exit status 3): GPU 3 is gone")


def test_a_passing_check_changes_nothing() -> None:
    result = slurmrun.launch(lambda: 2, workers_per_host=1, backend=None, health_check="true")
    assert result.return_values == [[2]]


def test_health_check_must_be_a_command() -> None:
    with pytest.raises(slurmrun.OptionsError, match="health_check must be a shell command"):
        slurmrun.launch(lambda: 1, workers_per_host=1, health_check="  ")
