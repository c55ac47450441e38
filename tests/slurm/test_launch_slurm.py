"""slurmrun.launch on the real 3-node SLURM test cluster: salloc, sbatch and srun for real.

Each test writes a small launcher script, runs it inside a real allocation, and reads the JSON
it prints. The autouse fixture of tests/slurm/conftest.py fails any test that leaves a job in
the queue or a process on a node.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

COMMON = """
import json, os, socket, sys, time
import slurmrun

def where():
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {
        "node": os.environ.get("SLURMD_NODENAME"),
        "hostname": socket.gethostname(),
        "rank": int(os.environ["RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "group_rank": int(os.environ["GROUP_RANK"]),
        "world": int(os.environ["WORLD_SIZE"]),
        "master": os.environ["MASTER_ADDR"],
        "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "sum": t.item(),
    }

def emit(result):
    print("RESULT " + json.dumps({"hosts": result.hostnames, "values": result.return_values}))
"""


def results(cp: subprocess.CompletedProcess[str]) -> dict:
    for line in cp.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise AssertionError(f"no RESULT line\n--- stdout\n{cp.stdout}\n--- stderr\n{cp.stderr}")


def script(body: str) -> str:
    return COMMON + textwrap.dedent(body)


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_salloc_three_nodes_runs_every_rank_on_its_own_node(run_in_allocation, slurm_cluster):
    cp = run_in_allocation(["-N3"], script("emit(slurmrun.launch(where, timeout=60))"))
    out = results(cp)
    assert out["hosts"] == ["node1", "node2", "node3"]
    values = [v for host in out["values"] for v in host]
    assert [v["node"] for v in values] == ["node1", "node2", "node3"]
    assert [v["hostname"] for v in values] == ["node1", "node2", "node3"]
    assert [v["rank"] for v in values] == [0, 1, 2]
    assert [v["group_rank"] for v in values] == [0, 1, 2]
    assert {v["sum"] for v in values} == {6.0}  # gloo all_reduce across the three nodes
    assert {v["master"] for v in values} == {slurm_cluster.addr("node1")}


@pytest.mark.parametrize("gpu_flag", ["--gpus-per-node=2", "--gres=gpu:2", "--gpus=6"])
def test_gpu_allocations_give_one_worker_per_gpu_bound_to_distinct_devices(
    run_in_allocation, gpu_flag
):
    cp = run_in_allocation(["-N3", gpu_flag], script("emit(slurmrun.launch(where, timeout=60))"))
    out = results(cp)
    assert [len(host) for host in out["values"]] == [2, 2, 2]
    for host in out["values"]:
        assert {v["cuda"] for v in host} == {"0,1"}  # the step sees the node's two GPUs
        devices = [v["cuda"].split(",")[v["local_rank"]] for v in host]
        assert sorted(devices) == ["0", "1"]  # LOCAL_RANK picks a distinct one of them
    assert {v["sum"] for host in out["values"] for v in host} == {21.0}


def test_cpu_job_runs_the_jobs_tasks_per_node(run_in_allocation):
    cp = run_in_allocation(
        ["-N3", "--ntasks-per-node=2"], script("emit(slurmrun.launch(where, timeout=60))")
    )
    assert [len(host) for host in results(cp)["values"]] == [2, 2, 2]


def test_sbatch_job_launches_from_the_first_node_and_writes_results(sbatch, tmp_path):
    launcher = tmp_path / "batch_launch.py"
    launcher.write_text(
        script(
            f"""
            result = slurmrun.launch(where, timeout=60)
            with open({str(tmp_path / "results.json")!r}, "w") as f:
                json.dump({{"hosts": result.hostnames, "values": result.return_values,
                           "launcher": socket.gethostname()}}, f)
            """
        )
    )
    job = sbatch(f"#SBATCH -N2\n{sys.executable} {launcher}\n", timeout=90)
    assert job.returncode == 0, job.output
    out = json.loads((tmp_path / "results.json").read_text())
    assert out["launcher"] == "node1"
    assert out["hosts"] == ["node1", "node2"]
    assert [v["node"] for host in out["values"] for v in host] == ["node1", "node2"]
    assert {v["sum"] for host in out["values"] for v in host} == {3.0}


def test_explicit_subset_of_nodes_in_the_given_order(run_in_allocation):
    cp = run_in_allocation(
        ["-N3"], script("emit(slurmrun.launch(where, hostnames=['node3', 'node1'], timeout=60))")
    )
    out = results(cp)
    assert out["hosts"] == ["node3", "node1"]
    assert [(v["node"], v["rank"]) for host in out["values"] for v in host] == [
        ("node3", 0),
        ("node1", 1),
    ]


def test_host_outside_the_job_is_rejected_before_anything_starts(run_in_allocation):
    cp = run_in_allocation(
        ["-N2"],
        script(
            """
            try:
                slurmrun.launch(where, hostnames=["node1", "node3"])
            except ValueError as e:
                print("ERROR", e)
            """
        ),
    )
    assert "ERROR hostnames ['node3'] are not nodes of SLURM job" in cp.stdout, (
        cp.stdout + cp.stderr
    )


def test_heterogeneous_workers_per_host(run_in_allocation):
    cp = run_in_allocation(
        ["-N3"], script("emit(slurmrun.launch(where, workers_per_host=[1, 2, 1], timeout=60))")
    )
    out = results(cp)
    assert [[(v["node"], v["rank"], v["local_rank"]) for v in host] for host in out["values"]] == [
        [("node1", 0, 0)],
        [("node2", 1, 0), ("node2", 2, 1)],
        [("node3", 3, 0)],
    ]
    assert {v["world"] for host in out["values"] for v in host} == {4}
    assert {v["sum"] for host in out["values"] for v in host} == {10.0}


LARGE_RESULTS = """
from slurmrun.launcher.run import Run

streamed = []
real = Run.on_streamed

def spy(self, conn, result, frame):
    streamed.append((result.node_rank, result.local_rank))
    return real(self, conn, result, frame)

Run.on_streamed = spy

def large(n_bytes):
    import torch
    return torch.full((n_bytes // 4,), float(os.environ["RANK"]))

result = slurmrun.launch(large, (24 << 20,), workers_per_host=[1, 2, 1], timeout=60)
print("RESULT " + json.dumps({
    "ok": [bool((v == r).all()) and v.numel() == 6 << 20 for r, v in enumerate(result.values())],
    "streamed": sorted(streamed),
}))
"""


def test_large_results_come_back_from_every_node_over_their_own_connections(run_in_allocation):
    out = results(run_in_allocation(["-N3"], script(LARGE_RESULTS), timeout=90))
    assert out["ok"] == [True] * 4
    assert out["streamed"] == [[0, 0], [1, 0], [1, 1], [2, 0]]


def test_two_launches_in_one_allocation_back_to_back(run_in_allocation):
    cp = run_in_allocation(
        ["-N3"],
        script(
            """
            emit(slurmrun.launch(where, timeout=60))
            emit(slurmrun.launch(where, timeout=60))
            """
        ),
        timeout=90,
    )
    lines = [line for line in cp.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 2
    for line in lines:
        assert json.loads(line[7:])["hosts"] == ["node1", "node2", "node3"]


KILL_AGENT = """
import psutil, signal

def kill_agent_on_node2():
    if os.environ["SLURMD_NODENAME"] == "node2" and os.environ["LOCAL_RANK"] == "0":
        agent = psutil.Process().parent().parent()
        assert " ".join(agent.cmdline()).startswith("slurmrun agent (")
        agent.send_signal(signal.SIGKILL)
    time.sleep(120)

start = time.monotonic()
try:
    slurmrun.launch(kill_agent_on_node2, timeout=60)
except slurmrun.AgentFailedError as e:
    print(f"AGENT_FAILED after {time.monotonic() - start:.1f}s: {e}")
"""


def test_agent_killed_on_node2_raises_agent_failed_and_leaves_nothing(
    run_in_allocation, node_processes
):
    cp = run_in_allocation(["-N3"], script(KILL_AGENT), timeout=90)
    assert "AGENT_FAILED" in cp.stdout, cp.stdout + cp.stderr
    assert "node2" in cp.stdout
    assert node_processes() == {}


SCANCEL = """
import subprocess

def cancel(what):
    if os.environ["RANK"] == "1":
        time.sleep(1)
        job = os.environ["SLURM_JOB_ID"]
        target = job if what == "job" else f"{job}.{os.environ['SLURM_STEP_ID']}"
        subprocess.run(["scancel", target], check=True)
    time.sleep(120)

start = time.monotonic()
try:
    slurmrun.launch(cancel, (sys.argv[1] if len(sys.argv) > 1 else "{what}",), timeout=60)
except slurmrun.AgentFailedError as e:
    print(f"AGENT_FAILED after {time.monotonic() - start:.1f}s: {e}", flush=True)
"""


@pytest.mark.parametrize("what", ["step", "job"])
def test_scancel_during_a_launch_raises_agent_failed(run_in_allocation, node_processes, what):
    cp = run_in_allocation(
        ["-N3"], script(SCANCEL.replace("{what}", what)), timeout=90, check=False
    )
    assert "AGENT_FAILED" in cp.stdout, cp.stdout + cp.stderr
    assert node_processes() == {}


def test_srun_that_cannot_start_the_step_raises_agent_failed_with_srun_message(run_in_allocation):
    cp = run_in_allocation(
        ["-N3"],
        script(
            """
            # A site's srun that asks for GRES the job lacks (srun no longer inherits
            # SLURM_GRES from the launcher's environment, so it goes on srun's command line).
            import shutil, tempfile
            wrapper = os.path.join(tempfile.mkdtemp(dir=os.getcwd()), "srun")
            with open(wrapper, "w") as f:
                f.write(f"#!/bin/sh\\nexec {shutil.which('srun')} --gres=gpu:7 \\"$@\\"\\n")
            os.chmod(wrapper, 0o755)
            os.environ["PATH"] = os.path.dirname(wrapper) + os.pathsep + os.environ["PATH"]
            try:
                slurmrun.launch(where, timeout=60)
            except slurmrun.AgentFailedError as e:
                print("AGENT_FAILED", e)
            """
        ),
    )
    assert "AGENT_FAILED" in cp.stdout, cp.stdout + cp.stderr
    assert "Unable to create step" in cp.stdout


INTERRUPTED = """
def sleep_forever(path):
    open(f"{path}.{os.environ['RANK']}", "w").write(str(os.getpid()))
    time.sleep(300)

open(sys.argv[1] + ".launcher", "w").write(str(os.getpid()))
try:
    slurmrun.launch(sleep_forever, (sys.argv[1],), timeout=60)
except KeyboardInterrupt:
    print("KEYBOARD_INTERRUPT", flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_the_launcher_ends_the_step(tmp_path, slurm_cluster, node_processes, sig):
    path = tmp_path / "launcher.py"
    path.write_text(script(INTERRUPTED))
    marker = tmp_path / "pid"
    proc = subprocess.Popen(
        [
            "salloc",
            "-N3",
            "--job-name=slurmrun-test",
            "--time=3",
            sys.executable,
            str(path),
            str(marker),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not all(os.path.exists(f"{marker}.{r}") for r in range(3)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "workers never started"
            time.sleep(0.2)
        launcher_pid = int((tmp_path / "pid.launcher").read_text())
        start = time.monotonic()
        os.kill(launcher_pid, sig)
        out, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if sig == signal.SIGINT:
        assert "KEYBOARD_INTERRUPT" in out, out + err
    assert elapsed < 30
    assert node_processes() == {}


# ---------------------------------------------------------------- logs and environment


LOGS_ENV = """
import subprocess

def chatty(names):
    print(f"print from rank {os.environ['RANK']} on {os.environ['SLURMD_NODENAME']}", flush=True)
    subprocess.run(["echo", f"echo from rank {os.environ['RANK']}"], check=True)
    import logging
    logging.getLogger("user").warning("record from rank %s", os.environ["RANK"])
    return {name: os.environ.get(name) for name in names}

os.environ["NCCL_SOCKET_IFNAME"] = "eth0"
os.environ["MY_PRIVATE_TOKEN"] = "hunter2"
os.environ["EXTRA_ONE"] = "1"
names = ["NCCL_SOCKET_IFNAME", "MY_PRIVATE_TOKEN", "EXTRA_ONE", "FROM_ENV_FILE"]
kwargs = dict(workers_per_host=2, timeout=60, extra_env_vars=("EXTRA_*",))
if len(sys.argv) > 1:
    kwargs["env_file"] = sys.argv[1]
emit(slurmrun.launch(chatty, (names,), **kwargs))
"""


def test_logs_and_environment_behave_as_on_localhost(run_in_allocation, tmp_path):
    env_file = tmp_path / "env.sh"
    env_file.write_text("export FROM_ENV_FILE=sourced-on-$(hostname)\n")
    logs = tmp_path / "logs"
    cp = run_in_allocation(
        ["-N3"],
        script(LOGS_ENV)
        .replace("len(sys.argv) > 1", "True")
        .replace("sys.argv[1]", repr(str(env_file))),
        env={"SLURMRUN_LOG_DIR": str(logs)},
    )
    out = results(cp)
    for node, host in zip(["node1", "node2", "node3"], out["values"], strict=True):
        for value in host:
            assert value == {
                "NCCL_SOCKET_IFNAME": "eth0",
                "MY_PRIVATE_TOKEN": None,  # not a default pattern: srun must not pass it on
                "EXTRA_ONE": "1",
                "FROM_ENV_FILE": f"sourced-on-{node}",
            }
    assert "[node1:0] print from rank 0 on node1" in cp.stdout
    assert "[node1:0] echo from rank 0" in cp.stdout
    assert "[node1:0] WARNING:user: record from rank 0" in cp.stderr
    assert "rank 3" not in cp.stdout + cp.stderr
    (launch_dir,) = logs.glob("20*")
    for rank, (node, local) in enumerate(
        (n, lr) for n in ("node1", "node2", "node3") for lr in (0, 1)
    ):
        text = (launch_dir / f"{node}.{local}.log").read_text()
        # written by the agent on that node, from the run's header line (`logs.run_header`) on
        assert text.startswith("=== slurmrun run 1, ") and ", func chatty ===\n" in text
        assert f"print from rank {rank} on {node}" in text
        assert f"echo from rank {rank}" in text
        assert f"WARNING:user: record from rank {rank}" in text
    assert {p.name for p in launch_dir.glob("*.agent.log")} == {
        "node1.agent.log",
        "node2.agent.log",
        "node3.agent.log",
    }


def test_broken_env_file_on_the_cluster_fails_with_bashs_message(run_in_allocation, tmp_path):
    env_file = tmp_path / "broken.sh"
    env_file.write_text("if then fi\n")
    cp = run_in_allocation(
        ["-N3"],
        script(
            f"""
            try:
                slurmrun.launch(where, env_file={str(env_file)!r}, timeout=60)
            except slurmrun.AgentFailedError as e:
                print("AGENT_FAILED", e)
            """
        ),
    )
    assert "AGENT_FAILED" in cp.stdout, cp.stdout + cp.stderr
    assert "syntax error" in cp.stdout


NAMES = """
def names():
    def of(pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f, open(f"/proc/{pid}/comm") as c:
            return f.read().decode(), c.read().strip()

    def parent(pid):
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])

    spawner = parent(os.getpid())
    return [of(os.getpid()), of(spawner), of(parent(spawner))]

emit(slurmrun.launch(names, workers_per_host=2, backend=None, timeout=60))
"""


def test_ps_names_every_worker_by_rank_node_and_local_rank(run_in_allocation):
    """What ps shows on the nodes (slurmrun.node.proctitle): rank 3 is node2's second worker."""
    out = results(run_in_allocation(["-N2"], script(NAMES)))
    assert out["hosts"] == ["node1", "node2"]
    values = [v for host in out["values"] for v in host]
    for rank, (worker, spawner, agent) in enumerate(values):
        node, local_rank = f"node{rank // 2 + 1}", rank % 2
        title = f"slurmrun: names rank {rank} ({node}:{local_rank})\0"
        assert worker == [title, f"slurmrun-r{rank}"]
        assert spawner == [f"slurmrun spawner ({node})\0", "slurmrun-spawn"]
        assert agent == [f"slurmrun agent ({node})\0", "slurmrun-agent"]
    assert values[3][0][0] == "slurmrun: names rank 3 (node2:1)\0"
