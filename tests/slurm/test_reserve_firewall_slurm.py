"""A reservation from behind a site's firewall, and the way to its keeper named beforehand.

The firewalled variant of the test cluster (``slurm-cluster.sh firewall on``): in every node's
network namespace nft drops each new TCP connection to the login side but to slurmctld's port
and ``SrunPortRange``, and each new one from the login side but to slurmd's port, as sites
firewall their login nodes. It is on for one test at a time, and the fixture takes it off
again however the test ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import slurmrun
from slurmrun.reservations import ReservationRecord
from tests.slurm.cluster_turn import require_exclusive
from tests.slurm.conftest import CLUSTER_SH, REPO

JOB_NAME = "slurmrun-test"  # the conftest's: its clean-state check knows it
# Every test here changes the whole cluster (the firewall of every node):
# the other cluster tests wait meanwhile.
pytestmark = pytest.mark.cluster_exclusive


def _firewall(state: str) -> None:
    subprocess.run(["bash", str(CLUSTER_SH), "firewall", state], check=True, timeout=60)


@contextlib.contextmanager
def firewalled(cluster) -> Iterator[None]:
    """The cluster's firewall, on until the block ends (however it ends)."""
    if cluster.mode != "netns":
        pytest.skip("the firewall needs the nodes in network namespaces of their own")
    require_exclusive("the firewall of every node")
    try:
        _firewall("on")
        yield
    finally:
        _firewall("off")


@pytest.fixture
def firewall(slurm_cluster) -> Iterator[None]:
    """The firewall on for the test."""
    with firewalled(slurm_cluster):
        yield


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Reservation records in the test's own config folder; the test runs in tmp_path."""
    path = tmp_path / "config"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(path))
    monkeypatch.delenv("SLURMRUN_RESERVE_VIA", raising=False)  # the launcher chooses
    monkeypatch.chdir(tmp_path)
    return path


def _reserve(tmp_path: Path, nodes: int = 2) -> slurmrun.Reservation:
    params = {"job_name": JOB_NAME}
    return slurmrun.reserve(
        nodes=nodes, time_min=5, idle_timeout=120, folder=tmp_path / "jobs", slurm_parameters=params
    )


def where(n: int) -> tuple[str, bytes]:
    return os.environ["SLURMD_NODENAME"], b"x" * n


# From a node: a connection to a port the login side listens on (a launcher's).
_KNOCK = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()
    print("connected")
except OSError as e:
    print("blocked:", e)
"""


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
@pytest.mark.usefixtures("firewall", "config")
def test_behind_the_firewall_the_launcher_goes_through_srun_by_itself(
    slurm_cluster, tmp_path, run_cmd, capfd, node_processes
):
    reservation = _reserve(tmp_path)
    with reservation:
        reservation.wait(60)
        job = reservation.job_id
        record = ReservationRecord.read(job)
        assert record is not None
        # The firewall is real: this side cannot reach the keeper's port, nor a node this side.
        with pytest.raises(OSError):
            socket.create_connection((record.host, record.port), timeout=2).close()
        with socket.create_server(("", 0)) as server:
            knock = [sys.executable, "-c", _KNOCK, slurm_cluster.launcher_addr]
            srun = ["srun", f"--jobid={job}", "--overlap", "-N1", "-n1", "-w", "node2", *knock]
            out = run_cmd([*srun, str(server.getsockname()[1])], timeout=60).stdout
        assert out.startswith("blocked: timed out"), out
        result = slurmrun.launch(where, (5 << 20,), job=job, timeout=60)  # a result's stream too
        assert result.values() == [("node1", b"x" * (5 << 20)), ("node2", b"x" * (5 << 20))]
        with slurmrun.Launcher(job=job, timeout=60) as launcher:
            assert launcher.run(where, (1,)).values() == [("node1", b"x"), ("node2", b"x")]
            steps = run_cmd(["squeue", "-h", "-s", "-j", job, "-o", "%j"]).stdout.split()
        assert steps.count("slurmrun-relay") == 2, steps  # two outputs carry the channels
    err = capfd.readouterr().err
    said = f"slurmrun: reservation {job}: through `srun --jobid {job} --overlap` on node1"
    assert said in err and "does not answer from here within 3 s" in err, err
    assert node_processes() == {}  # the relays' steps too


_IN_THE_JOB = """
import socket, slurmrun
print(slurmrun.launch(socket.gethostname, timeout=60).values())
"""


@pytest.mark.usefixtures("firewall")
def test_a_launch_inside_a_batch_job_works_behind_the_firewall(sbatch, node_processes):
    # Its launcher runs on the job's first node: the agents reach it node to node. (One in
    # an salloc shell on the login side cannot be reached: docs/reserve.md says so.)
    script = f"export PYTHONPATH={REPO}\n{sys.executable} -c '{_IN_THE_JOB}'\n"
    done = sbatch(script, ["-N2"], timeout=120)
    assert "['node1', 'node2']" in done.output, done.output
    assert node_processes() == {}


@pytest.mark.usefixtures("config")
def test_info_and_the_dry_run_name_the_way_to_the_keeper_and_why(
    slurm_cluster, tmp_path, run_cmd, node_processes
):
    reservation = _reserve(tmp_path, nodes=1)
    with reservation:
        reservation.wait(60)
        job = reservation.job_id
        record = ReservationRecord.read(job)
        assert record is not None
        env = {"XDG_CONFIG_HOME": str(tmp_path / "config"), "PYTHONPATH": str(REPO)}
        info = [sys.executable, "-m", "slurmrun", "info", "--job", job]
        dry = [sys.executable, "-m", "slurmrun", "--dry-run", "--job", job, "train.py"]
        (tmp_path / "train.py").write_text("print('not run')\n")
        port = f"the keeper's port {record.host}:{record.port}"

        out = run_cmd(info, timeout=60, env=env).stdout
        assert f"reached:          straight to {port}, which answers from here" in out, out
        out = run_cmd(dry, timeout=60, env=env).stdout
        assert f"straight to {port}, which answers from here" in out, out
        assert f"attach 'job {job}' {record.host}:{record.port}" in out, out

        with firewalled(slurm_cluster):
            out = run_cmd([*info, "--json"], timeout=60, env=env).stdout
            launch = json.loads(out)["launch"]
            assert launch["job_id"] == job
            assert launch["route"].startswith(
                f"through `srun --jobid {job} --overlap` on node1 (a relay to the keeper on its "
                f"stdin and stdout): {port} does not answer from here within 3 s"
            ), launch
            assert launch["commands"][0][:3] == ["srun", f"--jobid={job}", "--overlap"], launch
            out = run_cmd(dry, timeout=60, env=env).stdout
            assert f"through `srun --jobid {job} --overlap` on node1" in out, out
            assert "not run" not in out
        forced = {**env, "SLURMRUN_RESERVE_VIA": "srun"}
        out = run_cmd(info, timeout=60, env=forced).stdout
        assert "its stdin and stdout): SLURMRUN_RESERVE_VIA=srun" in out, out
        log = reservation.log.read_text()
    assert "attached (session" not in log, log  # nothing was started
    assert node_processes() == {}
