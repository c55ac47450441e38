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


def test_gpus_given_on_a_node_without_nvidias_driver_fail_gpu_check_on_saying_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # what SLURM's gres gives (fake here)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no nvidia-smi
    with pytest.raises(slurmrun.NodeUnhealthyError) as caught:
        slurmrun.launch(lambda: 1, workers_per_host=1, backend=None, gpu_check="on")
    text = str(caught.value)
    assert (
        "localhost failed its health check: GPU check: CUDA_VISIBLE_DEVICES=0,1 gives 2 GPU(s)"
        in text
    )
    assert "but this node has no NVIDIA driver (no nvidia-smi on the PATH" in text, text
    # "auto" (the default) judges no GPU on a node without the driver: the run goes on.
    assert slurmrun.launch(lambda: 1, workers_per_host=1, backend=None).return_values == [[1]]


def test_a_log_directory_that_a_node_cannot_write_fails_its_health_check(tmp_path: Path) -> None:
    with slurmrun.Launcher(workers_per_host=1, backend=None) as launcher:
        assert launcher.run(lambda: 1).return_values == [[1]]
        (log_dir,) = (tmp_path / "logs").glob("2*")
        for child in log_dir.iterdir():
            if child.is_dir():
                for f in child.iterdir():
                    f.unlink()
                child.rmdir()
            else:
                child.unlink()
        log_dir.rmdir()
        log_dir.write_text("")  # a file where the log directory was: nothing can be written in it
        with pytest.raises(
            slurmrun.NodeUnhealthyError, match=r"the log directory .* is not writable here"
        ):
            launcher.run(lambda: 1)


def test_gpu_check_must_be_auto_on_or_off() -> None:
    with pytest.raises(slurmrun.OptionsError, match="gpu_check must be 'auto', 'on' or 'off'"):
        slurmrun.launch(lambda: 1, workers_per_host=1, gpu_check=True)  # type: ignore[arg-type]
