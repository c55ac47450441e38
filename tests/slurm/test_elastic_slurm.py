"""Node loss on the real 3-node cluster (`Launcher.min_hosts`, spares): in an sbatch job of 3
nodes (``--no-kill``), node2's slurmd and every process of the job on it are killed mid-run;
the launch restarts on node1 and node3 with the new world size and the restart count, the
job goes on RUNNING, and a second launch in the same job (the launcher's next run) runs on the
survivors. With `min_hosts=3` the same loss fails the launch, as before."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import slurmrun
from tests.slurm.conftest import JOB_NAME, wait_job
from tests.slurm.test_faults_slurm import (  # the fixture checks node2 is back after each test
    LOST_NODE,
    lost_node_restorer,  # noqa: F401
    restore_node,
)

# Every test here changes the whole cluster (node2 lost, or marked down):
# the other cluster tests wait meanwhile.
pytestmark = pytest.mark.cluster_exclusive

REPO = str(Path(slurmrun.__file__).parents[1])

SCRIPT = r"""
import contextlib, json, os, signal, subprocess, sys, time
import slurmrun

WORK = @WORK@
MIN_HOSTS = @MIN_HOSTS@
HOSTS = @HOSTS@
LOST = @LOST@


def lose_a_node_then_report():
    import torch.distributed as dist

    dist.barrier()
    if os.environ["SLURMRUN_RESTART_COUNT"] == "0":
        if dist.get_rank() == 0:  # node1 kills node2's slurmd and every process of its netns
            with open(os.path.join(WORK, "fault_at"), "w") as f:
                f.write(repr(time.time()))
            for _ in range(100):
                pids = subprocess.run(
                    ["ip", "netns", "pids", f"{os.environ['SLURMRUN_TEST_NETNS_PREFIX']}{LOST}"],
                    capture_output=True, text=True, check=False,
                ).stdout.split()
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
                time.sleep(0.05)
        time.sleep(300)
    if dist.get_rank() == 0:
        print(f"RESTARTED {time.time()!r}", flush=True)
    return [os.environ["SLURMD_NODENAME"], int(os.environ["RANK"]),
            int(os.environ["WORLD_SIZE"]), os.environ["SLURMRUN_RESTART_COUNT"]]


def where():
    return [os.environ["SLURMD_NODENAME"], int(os.environ["WORLD_SIZE"])]


options = dict(workers_per_host=2, backend="gloo", timeout=60, heartbeat_timeout=5,
               max_restarts=1 if MIN_HOSTS != 3 else 0, min_hosts=MIN_HOSTS, hosts=HOSTS)
out = {}
try:
    with slurmrun.Launcher(**options) as launcher:  # a warm launcher: the second run plans again
        result = launcher.run(lose_a_node_then_report)
        out["values"] = result.values()
        out["hosts"] = result.hostnames
        out["lost"] = dict(result.lost_hosts)
        again = launcher.run(where)
        out["again"] = again.values()
        out["again_lost"] = sorted(again.lost_hosts)
except Exception as e:
    out["error"] = type(e).__name__
    out["message"] = str(e)
    out["hostname"] = getattr(e, "hostname", None)
state = subprocess.run(["scontrol", "show", "job", os.environ["SLURM_JOB_ID"]],
                       capture_output=True, text=True, check=False).stdout
out["job_state"] = state.split("JobState=")[1].split()[0] if "JobState=" in state else state
print("RESULT " + json.dumps(out), flush=True)
"""


def _script(work: Path, min_hosts: int | None, hosts: int | None = None) -> str:
    return (
        SCRIPT.replace("@WORK@", repr(str(work)))
        .replace("@MIN_HOSTS@", repr(min_hosts))
        .replace("@HOSTS@", repr(hosts))
        .replace("@LOST@", repr(LOST_NODE))
    )


def _batch_job(run_cmd: Any, cluster: Any, tmp_path: Path, script: str) -> str:
    """Runs `script` as the launcher of an sbatch job of 3 nodes that a node failure does not
    end (it runs on node1, the batch host); returns the job's output once it ended.

    The job's end needs node2's slurmd (SLURM would otherwise wait until it marks node2 down,
    over a minute): node2 is brought back as soon as the launcher printed its result.
    """
    path, out = tmp_path / "elastic.py", tmp_path / "elastic.out"
    path.write_text(script)
    batch = tmp_path / "elastic.sh"
    batch.write_text(f"#!/bin/bash\nexport PYTHONPATH={REPO}\n{sys.executable} {path}\n")
    argv = ["sbatch", "--parsable", f"--job-name={JOB_NAME}", "--time=5", f"--output={out}"]
    job = run_cmd([*argv, "-N3", "--no-kill", str(batch)]).stdout.strip().split(";")[0]
    deadline = time.monotonic() + 240
    while "RESULT " not in (out.read_text() if out.exists() else ""):
        assert time.monotonic() < deadline, out.read_text() if out.exists() else "no output"
        time.sleep(0.2)
    problem = restore_node(cluster, LOST_NODE)
    assert not problem, problem
    wait_job(job, 120, out)
    return out.read_text()


def _result(stdout: str) -> dict[str, Any]:
    lines = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, stdout
    found: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return found


@pytest.mark.usefixtures("lost_node_restorer")
@pytest.mark.parametrize(
    ("min_hosts", "hosts"),
    [
        pytest.param(
            2, None, id="min_hosts=2", marks=pytest.mark.quick
        ),  # quick: this file's smoke test
        pytest.param(None, 2, id="hosts=2 (a spare)"),
    ],
)
def test_a_lost_node_restarts_the_run_on_the_survivors(
    run_cmd: Any,
    slurm_cluster: Any,
    tmp_path: Path,
    min_hosts: int | None,
    hosts: int | None,
) -> None:
    # min_hosts=2: node1 and node3 go on (world 6 -> 4); hosts=2: node3, the spare, takes the
    # place of node2 (world 4 -> 4). Either way the restart runs on node1 and node3.
    output = _batch_job(run_cmd, slurm_cluster, tmp_path, _script(tmp_path, min_hosts, hosts))
    out = _result(output)
    assert "error" not in out, json.dumps(out, indent=1) + output[-3000:]
    assert out["hosts"] == ["node1", "node3"], out
    assert out["lost"].keys() == {LOST_NODE}, out
    assert out["values"] == [
        ["node1", 0, 4, "1"],
        ["node1", 1, 4, "1"],
        ["node3", 2, 4, "1"],
        ["node3", 3, 4, "1"],
    ], out
    assert out["job_state"] == "RUNNING", out
    # The next run plans from the allocation again: node2, still dead, is lost again.
    assert sorted(host for host, _ in out["again"]) == ["node1", "node1", "node3", "node3"], out
    assert out["again_lost"] == [LOST_NODE], out
    fault_at = float((tmp_path / "fault_at").read_text())
    marks = [x.split("RESTARTED ", 1)[1] for x in output.splitlines() if "RESTARTED " in x]
    restarted = [float(x) for x in marks]
    assert restarted, output
    took = restarted[0] - fault_at
    print(f"from the node's loss to the restarted run's first output: {took:.1f} s")
    assert took < 5 + 30, "within heartbeat_timeout + a restart"


@pytest.mark.usefixtures("lost_node_restorer")
def test_min_hosts_of_every_host_fails_on_a_lost_node_as_before(
    run_cmd: Any, slurm_cluster: Any, tmp_path: Path
) -> None:
    out = _result(_batch_job(run_cmd, slurm_cluster, tmp_path, _script(tmp_path, 3)))
    assert out.get("error") == "AgentFailedError", out
    assert out["hostname"] == LOST_NODE, out


# A node that SLURM marks DOWN (a failed health check, an admin, or SLURM itself when a slurmd
# stops answering) while its agent runs: node2 hangs (its slurmd stopped), SLURM marks it
# DOWN, srun says "Node failure on node2" and ends the tasks of node1 and node3, whose
# connections then close first; node2's agent is killed a moment later. The node lost is the
# one SLURM says is down, and the restart does not ask for it (SLURM would refuse the step).
DOWN_SCRIPT = r"""
import json, os, signal, subprocess, time
import psutil
import slurmrun

LOST = @LOST@
SLURMD_PID = @SLURMD_PID@
MIN_HOSTS = @MIN_HOSTS@


def mark_the_node_down_then_report():
    import torch.distributed as dist

    dist.barrier()
    if os.environ["SLURMRUN_RESTART_COUNT"] == "0":
        if os.environ["SLURMD_NODENAME"] == LOST:
            agent = next(p for p in psutil.Process().parents() if p.name() == "slurmrun-agent")
            os.kill(SLURMD_PID, signal.SIGSTOP)  # the node hangs: its slurmd answers no one
            subprocess.run(
                ["scontrol", "update", f"nodename={LOST}", "state=down", "reason=slurmrun-test"],
                check=True, timeout=10,
            )
            time.sleep(1)
            agent.kill()
        time.sleep(300)
    return [os.environ["SLURMD_NODENAME"], int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])]


options = dict(min_hosts=MIN_HOSTS, max_restarts=1, workers_per_host=1, backend="gloo",
               heartbeat_timeout=6, timeout=60)
out = {}
try:
    with slurmrun.Launcher(**options) as launcher:
        result = launcher.run(mark_the_node_down_then_report)
        out["values"] = result.values()
        out["hosts"] = result.hostnames
        out["lost"] = dict(result.lost_hosts)
except Exception as e:
    out["error"] = type(e).__name__
    out["message"] = str(e)
    out["notes"] = getattr(e, "__notes__", [])
os.kill(SLURMD_PID, signal.SIGCONT)
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.fixture
def slurmd_continued(slurm_cluster: Any) -> Iterator[int]:
    """The lost node's slurmd pid; it runs again after the test (before its node is resumed)."""
    pid = int((slurm_cluster.state_dir / "pids" / f"slurmd-{LOST_NODE}.pid").read_text())
    yield pid
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def _node_marked_down(
    run_cmd: Any, cluster: Any, tmp_path: Path, slurmd_pid: int, min_hosts: int
) -> tuple[dict[str, Any], str]:
    """Runs DOWN_SCRIPT in a job of 3 nodes; returns its result and output (in under 60 s)."""
    started = time.monotonic()
    script = DOWN_SCRIPT.replace("@LOST@", repr(LOST_NODE)).replace("@MIN_HOSTS@", repr(min_hosts))
    output = _batch_job(
        run_cmd, cluster, tmp_path, script.replace("@SLURMD_PID@", repr(slurmd_pid))
    )
    assert time.monotonic() - started < 60
    return _result(output), output


@pytest.mark.usefixtures("lost_node_restorer")  # node2 is resumed even when the test fails
def test_a_node_slurm_marks_down_is_the_one_lost_and_the_restart_leaves_it_out(
    run_cmd: Any, slurm_cluster: Any, tmp_path: Path, slurmd_continued: int
) -> None:
    out, output = _node_marked_down(run_cmd, slurm_cluster, tmp_path, slurmd_continued, 2)
    assert "error" not in out, json.dumps(out, indent=1) + output[-3000:]
    assert out["hosts"] == ["node1", "node3"], out
    assert out["lost"].keys() == {LOST_NODE}, out
    assert "DOWN" in out["lost"][LOST_NODE], out
    assert out["values"] == [["node1", 0, 2], ["node3", 1, 2]], out


@pytest.mark.usefixtures("lost_node_restorer")
def test_a_node_slurm_marks_down_that_min_hosts_keeps_ends_the_launch_without_a_restart(
    run_cmd: Any, slurm_cluster: Any, tmp_path: Path, slurmd_continued: int
) -> None:
    # min_hosts=3: node2 cannot be left out, and a restart would ask SLURM for it in vain
    out, output = _node_marked_down(run_cmd, slurm_cluster, tmp_path, slurmd_continued, 3)
    assert out.get("error"), out
    assert "not restarted: SLURM marks node2 DOWN" in "".join(out["notes"]), out
    assert "restarting the workers" not in output, output
