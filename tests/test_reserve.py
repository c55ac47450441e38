"""slurmrun.reserve and job=: what is refused before anything is submitted or attached.

The cluster tests (tests/slurm/test_reserve_slurm.py) run reservations; these need no SLURM.
"""

from __future__ import annotations

import pytest

import slurmrun
from slurmrun.launcher.options import Options
from slurmrun.launcher.plan import make_plan
from slurmrun.reservations import ReservationError, ReservationRecord, record_path


@pytest.fixture(autouse=True)
def config(tmp_path, monkeypatch):
    """Reservation records of the test's own."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path / "config"


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"hostnames": ["node1"]}, "hostnames"),
        ({"hosts": 1, "max_restarts": 1}, "hosts"),
    ],
)
def test_a_launch_on_a_reservation_refuses_choosing_its_hosts(options, named):
    with pytest.raises(slurmrun.OptionsValueError, match=f"leave {named} unset"):
        slurmrun.Launcher(job="123", **options).dry_run(print)


def _record(**more: object) -> None:
    ReservationRecord(
        job_id="123", host="127.0.0.1", port=9, secret=ReservationRecord.new_secret(),
        hostnames=["node1", "node2", "node3"], folder="/nowhere", pid=1, **more,  # type: ignore[arg-type]
    ).write()  # fmt: skip


def test_min_hosts_on_a_reservation_needs_a_restart_as_a_launchs_does():
    _record()
    with pytest.raises(slurmrun.OptionsValueError, match="set max_restarts >= 1"):
        slurmrun.Launcher(job="123", min_hosts=2).dry_run(print)


def test_a_reservation_that_lost_a_node_says_so_unless_min_hosts_allows_the_others():
    _record(lost={"node2": "the agent on node2 is gone: it closed its connection"})
    for min_hosts in (None, 3):
        with pytest.raises(ReservationError, match=r"reservation 123 lost node2 \(the agent on"):
            slurmrun.Launcher(job="123", min_hosts=min_hosts, max_restarts=1).dry_run(print)
    plan = make_plan(Options(job="123", min_hosts=2, max_restarts=1), wait=False)
    assert plan.hostnames == ["node1", "node3"]


def test_a_job_that_is_no_reservation_of_this_user_is_refused_at_once():
    with pytest.raises(ReservationError, match="no reservation 99999999 of yours is running"):
        slurmrun.launch(print, job="99999999", timeout=5)
    with pytest.raises(slurmrun.OptionsValueError, match="job must be a SLURM job id"):
        slurmrun.launch(print, job=" ")


def test_a_record_others_could_read_is_refused(config):
    record = ReservationRecord("7", "127.0.0.1", 1, "00" * 32, ["n1"], "/tmp", 1, "n1")
    path = record.write()
    assert path == record_path("7") and oct(path.stat().st_mode)[-3:] == "600"
    assert ReservationRecord.read("7") == record
    path.chmod(0o644)
    with pytest.raises(ReservationError, match=r"has mode 0644: others may read or change it"):
        ReservationRecord.read("7")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"requeue": True}, ValueError, "a reservation takes no requeue options"),
        ({"idle_timeout": 0}, ValueError, "idle_timeout must be a positive number"),
        ({"nodes": 0}, ValueError, "nodes must be a positive int"),
        ({"node": 2}, TypeError, "did you mean nodes"),
    ],
)
def test_reserve_refuses_bad_arguments_before_submitting(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        slurmrun.reserve(folder=tmp_path / "jobs", **kwargs)
    assert not (tmp_path / "jobs").exists()
