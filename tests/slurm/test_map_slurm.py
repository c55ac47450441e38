"""`Launcher.map` on the real 3-node SLURM test cluster with fake GPUs (2 per node): 12 items
on the 6 slots, each item in its own world (RANK 0 of WORLD_SIZE 1, its own MASTER_PORT), bound
to one GPU that no item overlapping it in time on its node saw, every slot used, the values in
the items' order; an item that raises once is retried on another slot, and one whose worker
dies is recorded while the others run to the end; items of 2 workers run in worlds of 2 with
both GPUs of their node. A node lost mid-map (node2's slurmd and every process on it killed):
its items run on node1 and node3, and the map ends with every value (`min_hosts=2`)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import slurmrun
from slurmrun.errors import RemoteTraceback
from tests.slurm.slurm_helpers import cancelled_on_failure, wait_for
from tests.slurm.test_elastic_slurm import _batch_job, _result
from tests.slurm.test_faults_slurm import (  # the fixture checks node2 is back after each test
    LOST_NODE,
    lost_node_restorer,  # noqa: F401
)
from tests.slurm.test_reserve_slurm import _reserve, config  # noqa: F401 - a fixture

REPO = str(Path(slurmrun.__file__).parents[1])

SCRIPT = """
import json, os, time
import slurmrun

MARKERS = {markers!r}

def item(k):
    start = time.time()
    # the first item of each slot waits (bounded) until every slot holds one: a slot that
    # started late on a busy machine still gets an item
    open(os.path.join(MARKERS, f"slot-{os.getpid()}"), "w").close()
    deadline = time.time() + 20
    while len([m for m in os.listdir(MARKERS) if m.startswith("slot-")]) < 6:
        if time.time() > deadline:
            break
        time.sleep(0.05)
    time.sleep(0.3)
    env = os.environ
    return dict(k=k, node=env["SLURMD_NODENAME"], pid=os.getpid(), rank=env["RANK"],
                world=env["WORLD_SIZE"], local=env["LOCAL_RANK"], port=env["MASTER_PORT"],
                gpus=env.get("CUDA_VISIBLE_DEVICES"), start=start, end=time.time())

def flaky(k):
    marker = os.path.join(MARKERS, str(k))
    if k == 3 and not os.path.exists(marker):
        open(marker, "w").write(str(os.getpid()))
        raise ValueError("first try of item 3")
    if k == 5:
        os._exit(9)
    time.sleep(0.1)
    return os.getpid()

def pair(k):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    env = os.environ
    return [env["SLURMD_NODENAME"], env["RANK"], env["WORLD_SIZE"], env["CUDA_VISIBLE_DEVICES"],
            int(t.item())]

with slurmrun.Launcher(backend="gloo", timeout=60) as launcher:
    print("MAP " + json.dumps(launcher.map(item, range(12))), flush=True)
    print("PAIRS " + json.dumps(launcher.map(pair, range(6), workers_per_item=2)), flush=True)
    try:
        launcher.map(flaky, range(10), retries=1)
    except slurmrun.MapFailedError as e:
        print("FAILED " + json.dumps([e.failed, [r if isinstance(r, int) else type(r).__name__
                                                  for r in e.results]]), flush=True)
"""


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_items_run_on_every_slot_each_in_its_own_world_and_gpu(
    run_in_allocation, tmp_path: Path
) -> None:
    markers = tmp_path / "markers"  # every node sees this machine's filesystem
    markers.mkdir()
    script = SCRIPT.replace("{markers!r}", repr(str(markers)))
    cp = run_in_allocation(
        ["-N3", "--gpus-per-node=2"], script, timeout=120, env={"PYTHONPATH": REPO}
    )
    lines = {
        x.split(" ", 1)[0]: json.loads(x.split(" ", 1)[1])
        for x in cp.stdout.splitlines()
        if x.startswith(("MAP ", "PAIRS ", "FAILED "))
    }
    assert set(lines) == {"MAP", "PAIRS", "FAILED"}, cp.stdout + cp.stderr
    values = lines["MAP"]
    assert [v["k"] for v in values] == list(range(12))
    assert {(v["rank"], v["world"], v["local"]) for v in values} == {("0", "1", "0")}
    slots = {(v["node"], v["pid"]) for v in values}
    assert len(slots) == 6, "every slot of the allocation ran items"
    assert {n for n, _ in slots} == {"node1", "node2", "node3"}
    ports = {v["pid"]: v["port"] for v in values}
    assert len(set(ports.values())) == 6 or len({(v["node"], v["port"]) for v in values}) == 6
    assert all(v["gpus"] in ("0", "1") for v in values), "one GPU per item"
    for a in values:
        for b in values:
            overlap = a["k"] < b["k"] and a["start"] < b["end"] and b["start"] < a["end"]
            if overlap and a["node"] == b["node"]:
                assert a["gpus"] != b["gpus"], f"items {a['k']} and {b['k']} shared a GPU"
    pairs = lines["PAIRS"]  # slots of 2 workers: one a node, with both of its GPUs
    assert [p[1:] for p in pairs] == [["0", "2", "0,1", 3]] * 6
    assert {p[0] for p in pairs} <= {"node1", "node2", "node3"}
    failed, results = lines["FAILED"]
    assert failed == [5]
    assert results[5] == "WorkerFailedError"
    retried_on = int(Path(markers, "3").read_text())
    assert isinstance(results[3], int) and results[3] != retried_on, "retried on another slot"
    assert all(isinstance(r, int) for i, r in enumerate(results) if i != 5)


LOST_SCRIPT = r"""
import contextlib, json, os, signal, subprocess, time
import slurmrun

LOST = @LOST@


def item(k):
    start = time.time()
    time.sleep(0.5)
    return [k, os.environ["SLURMD_NODENAME"], start, time.time()]


def lose(node):  # node1 (the batch host) kills node2's slurmd and every process of its netns
    for _ in range(100):
        pids = subprocess.run(
            ["ip", "netns", "pids", f"{os.environ['SLURMRUN_TEST_NETNS_PREFIX']}{node}"],
            capture_output=True, text=True, check=False,
        ).stdout.split()
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.05)


out = {"values": {}}
options = dict(workers_per_host=2, backend=None, timeout=60, heartbeat_timeout=5,
               min_hosts=2, max_restarts=1)
try:
    for index, value in slurmrun.Launcher(**options).imap(item, range(24)):
        out["values"][index] = value
        if value[1] == LOST and "lost_at" not in out:
            lose(LOST)
            out["lost_at"] = time.time()
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.cluster_exclusive
@pytest.mark.usefixtures("lost_node_restorer")
def test_a_lost_nodes_items_run_on_the_other_nodes_and_the_map_ends_whole(
    run_cmd: Any, slurm_cluster: Any, tmp_path: Path
) -> None:
    output = _batch_job(
        run_cmd, slurm_cluster, tmp_path, LOST_SCRIPT.replace("@LOST@", repr(LOST_NODE))
    )
    out = _result(output)
    assert "error" not in out, output[-3000:]
    values = out["values"]
    assert sorted(int(i) for i in values) == list(range(24)), output[-3000:]
    lost_at = out["lost_at"]
    after = [v for v in values.values() if v[2] > lost_at]
    assert after, "items ran after the loss"
    assert {v[1] for v in after} <= {"node1", "node3"}, after
    assert f"the map lost node {LOST_NODE}" in output, output[-3000:]


CLI_SCRIPT = """
import os, subprocess, sys

with open("args.txt", "w") as f:
    f.write("".join(f"--n {n}\\n" for n in range(12)))
with open("train.py", "w") as f:
    f.write(
        "import os, sys, time\\n"
        "time.sleep(0.5)\\n"
        "n = sys.argv[sys.argv.index('--n') + 1]\\n"
        "with open(f'run{n}.txt', 'w') as f:\\n"
        "    f.write(os.environ['SLURMD_NODENAME'] + ' ' + os.environ['CUDA_VISIBLE_DEVICES'])\\n"
    )
sys.exit(subprocess.call([sys.executable, "-m", "slurmrun", "--map", "args.txt", "train.py"]))
"""


def test_the_command_runs_a_script_once_per_line_on_every_gpu(
    run_in_allocation, tmp_path: Path
) -> None:
    cp = run_in_allocation(
        ["-N3", "--gpus-per-node=2"], CLI_SCRIPT, timeout=120, env={"PYTHONPATH": REPO}
    )
    runs = [(tmp_path / f"run{n}.txt").read_text().split() for n in range(12)]
    assert {node for node, _ in runs} == {"node1", "node2", "node3"}, runs
    assert {gpus for _, gpus in runs} == {"0", "1"}, "one GPU a run"
    assert "slurmrun: 12 items, 12 done, 0 failed:" in cp.stderr, cp.stderr


def on_a_gpu(k: int) -> list[object]:
    import os
    import time

    time.sleep(0.3)
    print(f"item {k}")
    env = os.environ
    return [k, env["SLURMD_NODENAME"], env["WORLD_SIZE"], env["CUDA_VISIBLE_DEVICES"]]


@pytest.mark.usefixtures("config")
def test_a_warm_launcher_maps_on_a_reservations_agents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, node_processes: Any
) -> None:
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path / "logs"))
    reservation = _reserve(tmp_path, nodes=2, gpus_per_node=2, time_min=3, idle_timeout=120)
    with reservation:
        reservation.wait(60)
        with slurmrun.Launcher(job=reservation.job_id, timeout=60, backend=None) as launcher:
            values = launcher.map(on_a_gpu, range(8))
            again = launcher.map(on_a_gpu, range(4))  # on the same agents
    assert [v[0] for v in values] == list(range(8))
    # every GPU of the reservation's 2 nodes (which nodes: whatever SLURM had free)
    nodes = {v[1] for v in values}
    assert len(nodes) == 2 and nodes <= {"node1", "node2", "node3"}, nodes
    assert {(v[1], v[3]) for v in values} == {(n, g) for n in nodes for g in "01"}
    assert {v[2] for v in values} == {"1"}
    assert [v[0] for v in again] == list(range(4))
    (first,) = (tmp_path / "logs").glob("20*")
    assert (first / "items" / "7.log").read_text() == "item 7\n"
    assert node_processes() == {}


def on_a_gpu_but_5(k: int) -> list[object]:
    if k == 5:
        raise ValueError("item 5 fails")
    return on_a_gpu(k)


def test_a_submitted_map_runs_on_every_gpu_of_the_job(tmp_path: Path) -> None:
    """`slurmrun.submit_map`: one job, its batch step maps; a failed item keeps its traceback."""
    job = slurmrun.submit_map(
        on_a_gpu_but_5,
        range(12),
        launcher=slurmrun.Launcher(backend=None, timeout=60),
        nodes=3,
        gpus_per_node=2,
        folder=tmp_path / "%j",
        time_min=3,
        slurm_parameters={"job_name": "slurmrun-test"},
    )
    assert isinstance(slurmrun.attach(job.job_id, tmp_path), slurmrun.SubmittedMap)
    try:
        with pytest.raises(slurmrun.MapFailedError) as info:
            job.result(timeout=120, poll=0.5)
    except TimeoutError:
        job.cancel()
        pytest.fail(f"{job.job_id} did not finish within 120 s:\n{job.logs(0)}")
    results = info.value.results
    assert info.value.failed == [5]
    failed = results[5]
    assert isinstance(failed, ValueError), results
    assert isinstance(failed.__cause__, RemoteTraceback)
    assert 'raise ValueError("item 5 fails")' in failed.__cause__.text
    values = [v for k, v in enumerate(results) if k != 5]
    assert [v[0] for v in values] == [k for k in range(12) if k != 5]
    gpus = {(v[1], v[3]) for v in values}
    assert gpus == {(n, g) for n in ("node1", "node2", "node3") for g in "01"}, values
    assert {v[2] for v in values} == {"1"}, "each item a world of its own"


def until_requeued(k: int, folder: str) -> int:
    """Items 0 and 1 end at once; the others, in the job's first run, wait to be requeued."""
    import os
    import pathlib
    import time

    run = os.environ["SLURMRUN_REQUEUE_COUNT"]
    pathlib.Path(folder, f"{k}.{run}").touch()
    if run == "0" and k >= 2:
        time.sleep(120)  # stopped by the requeue
    return k * 10 + int(run)


def test_a_requeued_map_runs_only_the_items_its_first_run_did_not_finish(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    job = slurmrun.submit_map(
        functools.partial(until_requeued, folder=str(runs)),
        range(6),
        launcher=slurmrun.Launcher(backend=None, timeout=60),
        nodes=1,
        gpus_per_node=2,
        folder=tmp_path / "jobs",
        time_min=5,
        requeue=slurmrun.Requeue(grace_seconds=1),
    )
    with cancelled_on_failure(job):
        wait_for(lambda: {"2.0", "3.0"} <= {p.name for p in runs.iterdir()}, 90, "items 2, 3")
        wait_for(lambda: job.progress() == (2, 6), 10, "items 0 and 1 kept")
        status = subprocess.run(
            [sys.executable, "-m", "slurmrun", "status", job.job_id, "--folder", "jobs"],
            capture_output=True, text=True, timeout=30, cwd=tmp_path, check=True,
            env={**os.environ, "PYTHONPATH": REPO},
        )  # fmt: skip
        assert status.stdout == f"{job.job_id} RUNNING\n2 of 6 items finished\n", status.stdout
        subprocess.run(["scancel", "--signal=USR2", job.job_id], check=True, timeout=30)
        values = job.result(timeout=150, poll=0.5)
    assert values == [0, 10, 21, 31, 41, 51]
    assert {p.name for p in runs.iterdir()} == {
        "0.0",
        "1.0",
        "2.0",
        "3.0",
        *(f"{k}.1" for k in range(2, 6)),
    }
    err = (tmp_path / "jobs" / job.job_id / f"{job.job_id}_0_log.err").read_text()
    assert "2 of the map's 6 items were finished by an earlier run of this job: 4 left" in err
