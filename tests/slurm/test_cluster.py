"""Smoke tests of the SLURM test cluster itself (tests/cluster/slurm-cluster.sh).

Besides proving that the cluster works, they pin down the SLURM behaviour that slurmrun's
launcher relies on (details: tests/cluster/observed-env.md).
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NODES = ["node1", "node2", "node3"]
JOB = "--job-name=slurmrun-test"

AGENT_STEP = ["-N3", "-n3", "--ntasks-per-node=1"]  # one task per node, whatever salloc said

# Runs inside salloc: prints the allocation's SLURM_* variables, then for each srun step in
# STEPS (lists of srun arguments after `srun --overlap`) one JSON line with every task's
# environment. Tasks write files, not stdout: srun cuts lines longer than 1 KiB and
# interleaves them.
STEP_ENV_SCRIPT = """
import glob, json, os, subprocess, sys

STEPS = {steps!r}
TASK = (
    "import json, os, socket; env = {{k: v for k, v in os.environ.items()"
    " if k.startswith(('SLURM', 'CUDA_'))}}; env['host'] = socket.gethostname();"
    " open('task_%s_%s.json' % (env['SLURM_STEP_ID'], env['SLURM_PROCID']), 'w')"
    ".write(json.dumps(env))"
)
print(json.dumps({{k: v for k, v in os.environ.items() if k.startswith(('SLURM_', 'CUDA_'))}}))
for args in STEPS:
    for f in glob.glob("task_*.json"):
        os.remove(f)
    cmd = ["srun", "--overlap", *args, sys.executable, "-c", TASK]
    cp = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    tasks = [json.load(open(f)) for f in glob.glob("task_*.json")]
    tasks.sort(key=lambda t: int(t["SLURM_PROCID"]))
    print(json.dumps({{"args": args, "rc": cp.returncode, "stderr": cp.stderr, "tasks": tasks}}))
show = subprocess.run(["scontrol", "show", "job", "-d", os.environ["SLURM_JOB_ID"]],
                      capture_output=True, text=True, timeout=10, check=True).stdout
print(json.dumps({{"scontrol": show}}))
"""


def since(cluster, version: str) -> bool:
    """Whether the cluster's SLURM is `version` ("24.11") or newer: the facts here differ."""
    return tuple(map(int, cluster.slurm_version.split(".")[:2])) >= tuple(
        map(int, version.split("."))
    )


def run_steps(run_in_allocation, salloc_args, steps):
    """(salloc shell env, [step results], scontrol show job -d text)."""
    cp = run_in_allocation(salloc_args, STEP_ENV_SCRIPT.format(steps=steps))
    lines = [json.loads(line) for line in cp.stdout.splitlines()]
    return lines[0], lines[1:-1], lines[-1]["scontrol"]


def test_cluster_facts(slurm_cluster, run_cmd):
    assert list(slurm_cluster.nodes) == NODES
    # 10.199.0 for the host's SLURM, 10.199.K for a Debian release's (tests/cluster/)
    subnet = slurm_cluster.launcher_addr.rsplit(".", 1)[0]
    assert subnet.startswith("10.199.") and slurm_cluster.launcher_addr == f"{subnet}.1"
    assert slurm_cluster.node_addrs == (f"{subnet}.11", f"{subnet}.12", f"{subnet}.13")
    assert (slurm_cluster.cpus_per_node, slurm_cluster.gpus_per_node) == (4, 2)
    sinfo = run_cmd(["sinfo", "-h", "-N", "-o", "%N %c %G"]).stdout.splitlines()
    assert sorted(set(sinfo)) == [f"{n} 4 gpu:2" for n in NODES]


def test_docs_list_this_slurm_version(slurm_cluster, run_cmd):
    """docs/slurm.md's table of the versions tested names this cluster's release and SLURM."""
    version = run_cmd(["sinfo", "--version"]).stdout.split()[-1]  # "slurm-wlm 26.05.5"
    assert slurm_cluster.slurm_version == version
    major_minor = ".".join(version.split(".")[:2])
    table = (REPO / "docs" / "slurm.md").read_text().split("### SLURM versions tested")[1]
    rows = [line.split("|")[1:3] for line in table.splitlines() if line.startswith("| ")]
    tested = {(release.split()[0], slurm.strip()) for release, slurm in rows}
    if slurm_cluster.release == "host":
        assert major_minor in {slurm for _, slurm in tested}, (version, tested)
    else:
        assert (slurm_cluster.release, major_minor) in tested, (version, tested)


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_salloc_srun_hostname(run_cmd):
    cp = run_cmd(["salloc", JOB, "-N3", "srun", "hostname"])
    assert sorted(cp.stdout.split()) == NODES


def test_srun_from_python_in_salloc(run_in_allocation):
    shell, [step], scontrol = run_steps(run_in_allocation, ["-N3"], [AGENT_STEP])
    # the salloc command runs on the login side (root namespace) with the job's variables
    assert shell["SLURM_JOB_NODELIST"] == "node[1-3]"
    assert shell["SLURM_JOB_NUM_NODES"] == "3"
    assert shell["SLURM_JOB_CPUS_PER_NODE"] == "1(x3)"  # -N3 alone: one CPU per node
    assert shell["SLURM_TASKS_PER_NODE"] == "1(x3)"
    assert "SLURMD_NODENAME" not in shell
    assert not any(k.startswith(("CUDA_", "SLURM_GPUS")) for k in shell)
    assert step["rc"] == 0, step["stderr"]
    tasks = step["tasks"]
    assert [t["host"] for t in tasks] == NODES
    assert [t["SLURMD_NODENAME"] for t in tasks] == NODES
    assert [t["SLURM_PROCID"] for t in tasks] == ["0", "1", "2"]
    assert all("CUDA_VISIBLE_DEVICES" not in t for t in tasks)  # job has no GPUs
    assert "JOB_GRES=(null)" in scontrol


@pytest.mark.parametrize(
    "salloc_tasks",
    [
        ["--ntasks-per-node=2"],
        ["-n5"],
        # node1's 4 CPUs: another group's test would not fit there meanwhile
        pytest.param(["-n4", "-c2"], marks=pytest.mark.cluster_exclusive),
    ],
)
def test_one_task_per_node_needs_explicit_ntasks(run_in_allocation, salloc_tasks, slurm_cluster):
    """22.05's srun inherits SLURM_NTASKS from salloc: -N3 --ntasks-per-node=1 alone is not
    enough (24.11 and 26.05 start one task per node); -n3 as well gives one on every version."""
    _, [inherited, explicit], _ = run_steps(
        run_in_allocation, ["-N3", *salloc_tasks], [["-N3", "--ntasks-per-node=1"], AGENT_STEP]
    )
    if since(slurm_cluster, "24.11"):
        assert [t["host"] for t in inherited["tasks"]] == NODES
    else:
        assert len(inherited["tasks"]) > 3  # the allocation's task count, not one per node
    assert [t["host"] for t in explicit["tasks"]] == NODES


# salloc GPU request -> {srun args after AGENT_STEP: CUDA_VISIBLE_DEVICES per node, or an error}
GPU_CASES = {
    "--gpus-per-node=2": {"": "0,1", "--gres=gpu:2": "0,1", "--gpus-per-node=2": "0,1"},
    "--gres=gpu:2": {"": "0,1", "--gres=gpu:2": "0,1", "--gpus-per-node=2": "0,1"},
    "--exclusive": {"": None, "--gres=gpu:2": "0,1"},  # whole nodes, GPUs only on request
    "--gpus=6": {"": "fewer", "--gres=gpu:2": "0,1"},  # plain steps get a subset (22.05)
    "--gpus-per-node=1": {"": "0", "--gres=gpu:2": "ERROR more than the job's gres"},
    "": {"": None, "--gres=gpu:2": "ERROR Step requested GRES but job doesn't have GRES"},
}


# What 24.11 and 26.05 answer instead (the same steps, other errors)
NO_GRES_24 = "ERROR Invalid generic resource (gres) specification"
EXCLUSIVE_26 = "ERROR --gpus-per-node and --gres=gpu are mutually exclusive"
GPU_CASES_SINCE = {
    "24.11": {
        ("--gpus-per-node=1", "--gres=gpu:2"): NO_GRES_24,
        ("", "--gres=gpu:2"): NO_GRES_24,
    },
    # srun reads the job's SLURM_GPUS_PER_NODE as its own --gpus-per-node (slurmrun's agents'
    # srun drops it from its environment: tests/test_srun.py)
    "26.05": {
        ("--gpus-per-node=2", "--gres=gpu:2"): EXCLUSIVE_26,
        ("--gpus-per-node=1", "--gres=gpu:2"): EXCLUSIVE_26,
    },
}


@pytest.mark.parametrize(
    "salloc_gpus",
    [  # whole nodes wait for every other job (a reservation of another xdist group): alone
        pytest.param(c, marks=pytest.mark.cluster_exclusive if c == "--exclusive" else ())
        for c in GPU_CASES
    ],
)
def test_which_steps_see_the_jobs_gpus(run_in_allocation, salloc_gpus, slurm_cluster):
    cases = dict(GPU_CASES[salloc_gpus])
    for version, changed in GPU_CASES_SINCE.items():
        if since(slurm_cluster, version):
            cases.update(
                {extra: want for (job, extra), want in changed.items() if job == salloc_gpus}
            )
    steps = [AGENT_STEP + ([extra] if extra else []) for extra in cases]
    shell, results, scontrol = run_steps(
        run_in_allocation, ["-N3", *([salloc_gpus] if salloc_gpus else [])], steps
    )
    assert "CUDA_VISIBLE_DEVICES" not in shell  # never in the salloc shell (login side)
    assert shell.get("SLURM_GPUS_PER_NODE") == (
        salloc_gpus.partition("--gpus-per-node=")[2] or None
    )
    assert shell.get("SLURM_GPUS") == ("6" if salloc_gpus == "--gpus=6" else None)
    if salloc_gpus in ("--gpus-per-node=2", "--gres=gpu:2", "--exclusive", "--gpus=6"):
        # the per-node truth for every one of them (one line per group of nodes)
        assert set(re.findall(r"^ +Nodes=\S+ CPU_IDs=\S+ Mem=\d+ GRES=(\S*)", scontrol, re.M)) == {
            "gpu:2(IDX:0-1)"
        }
    for (extra, want), step in zip(cases.items(), results, strict=True):
        if want and want.startswith("ERROR"):
            assert step["rc"] != 0
            assert want.removeprefix("ERROR ") in step["stderr"], step["stderr"]
            continue
        assert step["rc"] == 0, (extra, step["stderr"])
        assert [t["host"] for t in step["tasks"]] == NODES
        seen = [t.get("CUDA_VISIBLE_DEVICES") for t in step["tasks"]]
        if want == "fewer":
            assert sum(len(v.split(",")) for v in seen) < 6, seen
        else:
            assert seen == [want] * 3, (extra, seen)
        for task in step["tasks"]:
            assert task.get("SLURM_STEP_GPUS") == task.get("CUDA_VISIBLE_DEVICES"), task
            ngpus = str(len(task["CUDA_VISIBLE_DEVICES"].split(","))) if want else None
            assert task.get("SLURM_GPUS_ON_NODE") == ngpus, task


def test_sbatch_wait(sbatch, tmp_path):
    result = sbatch(f"""
        #SBATCH -N3
        echo "batch script on $(hostname)"
        srun --ntasks-per-node=1 bash -c 'echo $SLURMD_NODENAME > {tmp_path}/from_$SLURMD_NODENAME'
        """)
    assert "batch script on node1" in result.output
    for node in NODES:
        assert (tmp_path / f"from_{node}").read_text().strip() == node
    assert sbatch("exit 3", check=False).returncode == 3  # --wait returns the job's exit code


STEP_TIMING_SCRIPT = """
import glob, subprocess, sys, time

def timed(*srun_args):
    t0 = time.monotonic()
    subprocess.run(["srun", *srun_args], check=True, timeout=30)
    return time.monotonic() - t0

def concurrent(flag):
    # a 2 s step is running on all nodes; how long does a second, empty step take?
    for f in glob.glob("started_*"):
        subprocess.run(["rm", "-f", f], check=True)
    first = subprocess.Popen(
        ["srun", *flag, "-N3", "bash", "-c", "touch started_$SLURMD_NODENAME; sleep 2"])
    deadline = time.monotonic() + 20
    while len(glob.glob("started_*")) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    took = timed(*flag, "-N3", "true")
    first.wait(timeout=30)
    return took

print("plain", min(timed("-N3", "true") for _ in range(3)))
print("overlap", concurrent(["--overlap"]))
print("exclusive", concurrent([]))
"""


def test_step_timing_and_overlap(run_in_allocation, slurm_cluster):
    cp = run_in_allocation(["-N3"], STEP_TIMING_SCRIPT)
    took = {k: float(v) for k, v in (line.split() for line in cp.stdout.splitlines())}
    assert took["plain"] < 2.0  # srun -N3 true: ~0.04 s here
    assert took["overlap"] < 1.0  # --overlap steps run side by side
    assert took["exclusive"] > 0.5  # without --overlap the second step waits for CPUs
    if since(slurm_cluster, "24.11"):  # it says so only once the step starts
        assert re.search(r"srun: Step created for StepId=\d+\.\d+", cp.stderr), cp.stderr
    else:
        assert "step creation temporarily disabled" in cp.stderr


def test_launcher_address_reachable_from_node(slurm_cluster, run_cmd):
    """A server in the root namespace on 10.199.0.1 (not on 127.0.0.1) is how nodes reach us."""
    server = socket.create_server((slurm_cluster.launcher_addr, 0))
    loopback = socket.create_server(("127.0.0.1", 0))
    server.settimeout(30)
    got = {}

    def serve():
        try:
            conn, peer = server.accept()
            with conn:
                got["peer"], got["data"] = peer[0], conn.recv(100).decode()
        except OSError as e:
            got["error"] = repr(e)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = (
        "import socket\n"
        f"s = socket.create_connection(('{slurm_cluster.controller}', {server.getsockname()[1]}),"
        " timeout=10)\n"
        "s.sendall(socket.gethostname().encode()); s.close()\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {loopback.getsockname()[1]}), timeout=3)\n"
        "    print('loopback reachable')\n"
        "except OSError:\n"
        "    print('loopback unreachable')\n"
    )
    try:
        cp = run_cmd(["salloc", JOB, "-N1", "-w", "node2", "srun", sys.executable, "-c", client])
        thread.join(timeout=30)
    finally:
        server.close()
        loopback.close()
    assert got == {"peer": slurm_cluster.addr("node2"), "data": "node2"}
    assert cp.stdout.strip() == "loopback unreachable"  # 127.0.0.1 on a node is the node's own


def test_node_processes_sees_steps_and_their_end(node_processes, tmp_path):
    assert node_processes(wait=0) == {}
    proc = subprocess.Popen(  # cwd=tmp_path: a job of this session, so node_processes sees it
        ["salloc", JOB, "--time=2", "-N3", "srun", "--ntasks-per-node=1", "sleep", "4"],
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline, seen = time.monotonic() + 20, {}
        while time.monotonic() < deadline:
            seen = node_processes(wait=0)
            if all(any(p.cmdline.endswith("sleep 4") for p in seen.get(n, [])) for n in NODES):
                break
            time.sleep(0.1)
        assert sorted(seen) == NODES, seen
        for node in NODES:
            assert any(p.cmdline.startswith("slurmstepd") for p in seen[node]), seen[node]
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert node_processes(wait=5) == {}
