"""Fixtures for the tests that run on the real SLURM test cluster.

The cluster is tests/cluster/slurm-cluster.sh: slurmctld in the root namespace (10.199.0.1,
hostname alias ``slurmctl``; this is also where pytest, ``salloc`` and ``sbatch`` run) and
node1..node3, each a slurmd in its own network + UTS namespace on a bridge. All nodes share
this machine's filesystem and PID namespace, so tmp_path and sys.executable work on them.
``bash tests/run.sh`` brings the cluster up and exports SLURMRUN_TEST_CLUSTER=1.

The same tests run on another SLURM version: with SLURM_CLUSTER_RELEASE=bookworm|trixie|sid
the cluster's daemons and commands are a Debian release's (22.05, 24.11, 26.05), in a rootfs
(tests/cluster/slurm-rootfs.sh), and pytest itself runs there, on its login side, through
``slurm-cluster.sh exec`` (the host's Python, /tmp and this checkout are bound in at their own
paths): every ``salloc``/``srun``/``scontrol`` a test or slurmrun runs is then that release's.
Its subnet (10.199.K), netns prefix (slurmK-) and ports differ from the host cluster's; tests
read them from ``slurm_cluster`` (job-side code: ``$SLURMRUN_TEST_NETNS_PREFIX``).

Every test in this directory gets the ``slurm`` marker and, through the autouse fixture
``_slurm_clean_state``, the ``slurm_cluster`` fixture; after each test no job may be left
in squeue and no process may be left on the nodes (both are cleaned up, and the test fails).

Under pytest-xdist (``--dist loadgroup``, as tests/run.sh runs) the files are dealt to
``CLUSTER_GROUPS`` xdist groups that run at once, each on a worker of its own; a worker's
tests run one after the other. Each worker has a basetemp of its own, so the clean-state
check of one worker's test sees only that test's jobs and processes (below). A test that
changes the whole cluster (a node lost or marked down, preemption, a partition's GraceTime,
the firewall) is marked ``cluster_exclusive``: it waits for the cluster to itself and the
other workers, and other pytest sessions on the cluster, wait for it (cluster_turn.py); the
helpers that make such changes refuse to run without it. So is a test whose jobs take more
than 2 of a node's 4 CPUs, or a whole node: two shared tests then always fit side by side
where they expect to run (SLURM gives a job the first nodes that fit: node1, node2...).

Several pytest sessions may share one cluster (developers on one machine): a job or node
process counts as this session's when its working directory (the job's submit dir) lies in
this session's pytest basetemp. The helpers run everything from tmp_path, so jobs started
through them, and processes started by those jobs, are this session's; the clean-state
check and ``node_processes`` look only at those and never touch another session's.

Helpers (all are fixtures returning callables; every call has a timeout):

- ``run_cmd(argv, timeout=30)``: run a command in tmp_path
  (e.g. ``["salloc", "-N3", "srun", "hostname"]``).
- ``run_in_allocation(salloc_args, script, timeout=60)``: write ``script`` (Python) to tmp_path
  and run ``salloc <salloc_args> <python> script.py``: the script runs on the login side with
  the allocation's SLURM_* variables set, the way a user runs slurmrun inside ``salloc``.
- ``sbatch(script, args=(), timeout=60)``: submit a batch script (it runs on node1, the batch
  host), wait for its end (``wait_job``: polled, where ``sbatch --wait`` sleeps up to 32 s
  between looks) and return its exit code and output file.
- ``node_processes(wait=5.0)``: this session's processes on the nodes (slurmd excluded), polled
  until none are left or ``wait`` runs out (slurmstepd takes a moment to exit); ``{}`` when
  clean. A process started outside the helpers can be made visible by starting its job
  with ``cwd=tmp_path``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from tests.slurm.cluster_turn import ClusterTurns, ClusterTurnTimeout, require_exclusive
from tests.slurm.session_jobs import _cancel, _jobs, _ours, _session, _shared_jobs, _wait_no_jobs

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SH = REPO / "tests" / "cluster" / "slurm-cluster.sh"
SLURM_DIR = Path(__file__).resolve().parent
JOB_NAME = "slurmrun-test"  # name of the jobs run_in_allocation and sbatch submit
CLUSTER_GROUP = "slurm-cluster"  # the xdist groups of the tests here: slurm-cluster-1...
# How many groups of cluster tests run at once (a worker each; tests/run.sh gives pytest-xdist
# one more worker for the tests that need no cluster). More than 2 breaks the rule that shared
# tests fit side by side (2 CPUs of a node each, of 4); and the cluster tests keep this
# machine's 2 cores busy already (1.7 of them for test_launch_slurm.py alone).
CLUSTER_GROUPS = int(os.environ.get("SLURMRUN_TEST_CLUSTER_GROUPS", "1"))
EXCLUSIVE = "cluster_exclusive"  # the marker of a test that has the cluster to itself
CONTAINER_TESTS = "test_containers_slurm.py"  # they need the image tests/run.sh builds
# The files of the SLURM version leg (`-m slurm_version_leg`): what `tests/run.sh` also runs on
# sid's SLURM in every run. They read SLURM's output (scontrol, squeue, sacct, the job's
# variables, PreemptType, array elements) or build its commands (salloc/sbatch/srun lines,
# submitit's sbatch): about 4 minutes; `tests/run.sh --slurm-versions all` runs every file.
VERSION_LEG_FILES = frozenset(
    {
        "test_cluster.py",
        "test_info_slurm.py",
        "test_driver_in_step.py",
        "test_launch_slurm.py",
        "test_jobs_slurm.py",
        "test_jobs_cli_slurm.py",
        "test_job_end_slurm.py",
        "test_submit_slurm.py",
        "test_stacks_cli_slurm.py",
        "test_worker_env_slurm.py",
        "test_cli_slurm.py",
        "test_preemption_slurm.py",
        "test_requeue_slurm.py",
    }
)
NOT_UP_HELP = (
    "The SLURM test cluster is not up. Run the test suite with `bash tests/run.sh` (as root; "
    "it starts and stops the cluster), or bring it up yourself with "
    "`sudo bash tests/cluster/slurm-cluster.sh up 3` (a Debian release's SLURM: "
    "SLURM_CLUSTER_RELEASE=sid, and pytest run through `slurm-cluster.sh exec`). "
    "To run without the SLURM tests set SLURMRUN_SKIP_SLURM=1."
)


# --------------------------------------------------------------------------- marker
@pytest.hookimpl(tryfirst=True)  # before `-m "not slurm"` deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    group_of = cluster_groups({item.path.name for item in items if SLURM_DIR in item.path.parents})
    for item in items:
        if SLURM_DIR in item.path.parents:
            item.add_marker(pytest.mark.slurm)
            # Under pytest-xdist (`--dist loadgroup`, as tests/run.sh runs), a file's tests go
            # to its group's worker, one after the other (module fixtures hold jobs across a
            # file's tests); the groups run at once, the other workers run the tests that
            # need no cluster.
            item.add_marker(pytest.mark.xdist_group(group_of[item.path.name]))
            if item.path.name in VERSION_LEG_FILES:
                item.add_marker(pytest.mark.slurm_version_leg)
    # The container tests last: tests/run.sh builds their image in the background meanwhile.
    items.sort(key=lambda item: item.path.name == CONTAINER_TESTS)


# Seconds each file's tests took on one worker, but those of its `cluster_exclusive` tests
# (during those every group waits): the weights by which `cluster_groups` deals the files.
# Measured on this 2-core machine (all of tests/slurm/ on one worker: 1010 s, of which the
# exclusive tests 228 s); a file missing here counts as DEFAULT_SECONDS.
FILE_SECONDS = {
    "test_chaos_slurm.py": 12,
    "test_cli_slurm.py": 9,
    "test_cluster.py": 16,
    "test_containers_slurm.py": 16,
    "test_debugging_slurm.py": 19,
    "test_driver_in_step.py": 19,
    "test_examples_slurm.py": 87,
    "test_faults_slurm.py": 101,
    "test_frameworks_hf_slurm.py": 33,
    "test_frameworks_lightning_slurm.py": 52,
    "test_info_slurm.py": 5,
    "test_job_end_slurm.py": 7,
    "test_job_folder_slurm.py": 5,
    "test_jobs_cli_slurm.py": 38,
    "test_jobs_slurm.py": 19,
    "test_kept_workers_slurm.py": 3,
    "test_launch_slurm.py": 58,
    "test_long_jobs_slurm.py": 7,
    "test_map_slurm.py": 30,
    "test_notebook_slurm.py": 6,
    "test_preloads_slurm.py": 8,
    "test_queue_slurm.py": 0,
    "test_requeue_slurm.py": 28,
    "test_reserve_chaos_slurm.py": 46,
    "test_reserve_parity_slurm.py": 17,
    "test_reserve_slurm.py": 62,
    "test_scale_slurm.py": 5,
    "test_sealed_jobs_slurm.py": 20,
    "test_ssh_slurm.py": 9,
    "test_stacks_cli_slurm.py": 0,
    "test_stuck_slurm.py": 29,
    "test_submit_slurm.py": 5,
    "test_warm_slurm.py": 10,
    "test_worker_env_slurm.py": 3,
}
DEFAULT_SECONDS = 10.0
# The files whose jobs ask for GPUs (2 a node, every one of a node's): all in the first group,
# so that no two of them run at once. Two at once would not both fit where they expect to run:
# one would wait for the other's GPUs, or get other nodes. (tests/test_suite.py checks the list
# against the files' text.)
GPU_FILES = frozenset(
    {
        "test_cluster.py",
        "test_driver_in_step.py",
        "test_info_slurm.py",
        "test_jobs_cli_slurm.py",
        "test_launch_slurm.py",
        "test_map_slurm.py",
        "test_stacks_cli_slurm.py",
        "test_stuck_slurm.py",
    }
)


def cluster_groups(files: set[str]) -> dict[str, str]:
    """Each cluster test file's xdist group: the GPU files to the first, then the others, the
    longest first, each to the least loaded.

    The same on every xdist worker (the files sorted, ties broken by name), as xdist needs.
    """
    load = {f"{CLUSTER_GROUP}-{i}": 0.0 for i in range(1, max(CLUSTER_GROUPS, 1) + 1)}
    group_of = {}
    first = f"{CLUSTER_GROUP}-1"
    for name in sorted(files, key=lambda f: (f not in GPU_FILES, -_seconds(f), f)):
        group = first if name in GPU_FILES else min(load, key=lambda g: (load[g], g))
        load[group] += _seconds(name)
        group_of[name] = group
    return group_of


def _seconds(name: str) -> float:
    return FILE_SECONDS.get(name, DEFAULT_SECONDS)


# --------------------------------------------------------------------------- cluster facts
@dataclasses.dataclass(frozen=True)
class SlurmCluster:
    """What tests/cluster/slurm-cluster.sh brought up (from its ``env`` command)."""

    nodes: tuple[str, ...]  # ("node1", "node2", "node3")
    node_addrs: tuple[str, ...]  # ("10.199.0.11", ...), same order as nodes
    launcher_addr: str  # root-namespace address every node can reach: 10.199.0.1
    controller: str  # hostname alias of launcher_addr: "slurmctl"
    cpus_per_node: int
    gpus_per_node: int  # fake GPUs (gres/gpu on /dev/null clones)
    mode: str  # "netns" (default) or "multi"
    state_dir: Path
    logs_dir: Path
    netns_prefix: str  # node i lives in network namespace f"{netns_prefix}node{i}"
    release: str  # "host" (the host's packages) or the Debian release of a rootfs: "sid"...
    slurm_version: str  # "22.05.8", "26.05.5"...

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def addr(self, node: str) -> str:
        return self.node_addrs[self.nodes.index(node)]


def _cluster_sh(command: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(CLUSTER_SH), command],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _turns_folder(netns_prefix: str) -> Path:
    """Where every pytest process on the cluster of `netns_prefix` takes its turns."""
    return Path(tempfile.gettempdir()) / f"slurmrun-test-turns-{netns_prefix}"


def _read_cluster() -> SlurmCluster | str:
    """The running cluster's facts, or why it is not up and healthy.

    A node that is down may be another worker's exclusive test (a lost node, restored after
    it): the status is then read again in a turn of this process's own, once that test ended.
    """
    try:
        env = _cluster_sh("env", 30)
        if env.returncode != 0:
            return env.stderr.strip()
        status = _cluster_sh("status", 60)
        prefix = re.search(r"SLURM_CLUSTER_NETNS_PREFIX=(\S+)", env.stdout)
        if status.returncode != 0 and prefix is not None:
            folder = _turns_folder(shlex.split(prefix.group(1))[0])
            folder.mkdir(exist_ok=True)
            with ClusterTurns(folder).hold("shared", "a first look at the cluster's health"):
                status = _cluster_sh("status", 60)
    except (OSError, subprocess.TimeoutExpired, ClusterTurnTimeout) as e:
        return repr(e)
    if status.returncode != 0:
        return status.stdout.strip() + "\n" + status.stderr.strip()
    facts: dict[str, str] = {}
    for line in env.stdout.splitlines():
        words = shlex.split(line)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            key, value = words[1].split("=", 1)
            facts[key] = value
    n = int(facts["SLURM_CLUSTER_NODES"])
    state = Path(facts.get("SLURM_CLUSTER_STATE", "/var/lib/slurm-cluster"))
    return SlurmCluster(
        nodes=tuple(f"node{i}" for i in range(1, n + 1)),
        node_addrs=tuple(facts["SLURM_CLUSTER_NODE_ADDRS"].split()),
        launcher_addr=facts["SLURM_CLUSTER_LAUNCHER_ADDR"],
        controller=facts["SLURM_CLUSTER_CONTROLLER"],
        cpus_per_node=int(facts["SLURM_CLUSTER_CPUS"]),
        gpus_per_node=int(facts["SLURM_CLUSTER_GPUS"]),
        mode=facts["SLURM_CLUSTER_MODE"],
        state_dir=state,
        logs_dir=Path(facts["SLURM_CLUSTER_LOGS"]),
        netns_prefix=facts.get("SLURM_CLUSTER_NETNS_PREFIX", "slurmc-"),
        release=facts.get("SLURM_CLUSTER_RELEASE", "host"),
        slurm_version=facts.get("SLURM_CLUSTER_SLURM_VERSION", ""),
    )


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> SlurmCluster:
    """The running SLURM test cluster; skips (SLURMRUN_SKIP_SLURM=1) or fails when it is down."""
    cluster = _read_cluster()
    if isinstance(cluster, str):
        if os.environ.get("SLURMRUN_SKIP_SLURM") == "1":
            pytest.skip("SLURMRUN_SKIP_SLURM=1 and the SLURM test cluster is not up")
        pytest.fail(f"{NOT_UP_HELP}\n\n{CLUSTER_SH.name} says:\n{cluster}", pytrace=False)
    _session["dir"] = str(tmp_path_factory.getbasetemp().resolve())
    # for code that runs in the jobs (a node's namespace by name), inherited through salloc
    os.environ["SLURMRUN_TEST_NETNS_PREFIX"] = cluster.netns_prefix
    return cluster


# --------------------------------------------------------------------------- running commands
def _clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """os.environ without SLURM_* job variables (pytest itself may run inside a job)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}
    if "SLURM_CONF" in os.environ:
        env["SLURM_CONF"] = os.environ["SLURM_CONF"]
    env.update(extra or {})
    return env


def _minutes(timeout: float) -> str:
    """A SLURM --time that outlives our own timeout (SLURM then reaps what we missed)."""
    return str(math.ceil(timeout / 60) + 1)


def _report(cp: subprocess.CompletedProcess[str], what: str) -> str:
    return f"{what}: {shlex.join(cp.args)}\n--- stdout\n{cp.stdout}\n--- stderr\n{cp.stderr}"


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _run(
    argv: Sequence[str],
    *,
    timeout: float,
    check: bool,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run argv with a hard timeout: on expiry kill its whole process group and fail."""
    argv = [str(a) for a in argv]
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=_clean_env(env),
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    if timed_out:  # salloc/sbatch cancel their job on SIGTERM; then kill what is left
        _signal_group(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        _signal_group(proc.pid, signal.SIGKILL)
        _cancel(_jobs())  # sbatch --wait leaves its job running when killed
        try:
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # a grandchild outside the group holds the pipes
            out, err = "", ""
        cp = subprocess.CompletedProcess(argv, proc.returncode, out, err)
        pytest.fail(_report(cp, f"timed out after {timeout}s"), pytrace=False)
    cp = subprocess.CompletedProcess(argv, proc.returncode, out, err)
    if check and cp.returncode != 0:
        pytest.fail(_report(cp, f"exit code {cp.returncode}"), pytrace=False)
    return cp


RunCmd = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def run_cmd(tmp_path: Path, slurm_cluster: SlurmCluster) -> RunCmd:
    """``run_cmd(argv, timeout=30, check=True, env=None)`` -> CompletedProcess (text).

    Runs in tmp_path, so jobs it submits count as this session's.
    """

    def run(
        argv: Sequence[str],
        timeout: float = 30.0,
        *,
        check: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        return _run(argv, timeout=timeout, check=check, cwd=tmp_path, env=env)

    return run


@pytest.fixture
def run_in_allocation(tmp_path: Path, slurm_cluster: SlurmCluster) -> RunCmd:
    """``run_in_allocation(salloc_args, script, timeout=60, check=True, env=None)``.

    Writes the Python ``script`` (dedented) to tmp_path and runs
    ``salloc --job-name=slurmrun-test --time=.. <salloc_args> <sys.executable> script.py``
    in tmp_path. Returns the CompletedProcess (stdout/stderr as text); with check=True a
    non-zero exit fails the test and shows both streams.
    """
    counter = itertools.count()

    def run(
        salloc_args: Sequence[str],
        script: str,
        timeout: float = 60.0,
        *,
        check: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        path = tmp_path / f"in_allocation_{next(counter)}.py"
        path.write_text(textwrap.dedent(script))
        argv = [
            "salloc",
            f"--job-name={JOB_NAME}",
            f"--time={_minutes(timeout)}",
            *salloc_args,
            sys.executable,
            str(path),
        ]
        return _run(argv, timeout=timeout, check=check, cwd=tmp_path, env=env)

    return run


@dataclasses.dataclass(frozen=True)
class BatchResult:
    """A finished ``sbatch --wait`` job."""

    job_id: str
    returncode: int  # sbatch --wait exits with the job's exit code
    output: str  # the job's output file (stdout and stderr together)
    sbatch_stderr: str


@pytest.fixture
def sbatch(tmp_path: Path, slurm_cluster: SlurmCluster) -> Callable[..., BatchResult]:
    """``sbatch(script, args=(), timeout=60, check=True)`` -> BatchResult.

    ``script`` is a batch script (``#!/bin/bash`` is prepended when it has no shebang, so
    ``#SBATCH`` lines may follow); it is submitted from tmp_path with
    ``sbatch --output=<tmp_path>/batch_N.out <args>``, runs on node1, and is polled until it
    ended (`wait_job`); the returncode is the batch script's, as ``sbatch --wait`` gives it
    (sbatch's own where the submission failed).
    """
    counter = itertools.count()

    def submit(
        script: str,
        args: Sequence[str] = (),
        timeout: float = 60.0,
        *,
        check: bool = True,
    ) -> BatchResult:
        n = next(counter)
        path, out = tmp_path / f"batch_{n}.sh", tmp_path / f"batch_{n}.out"
        text = textwrap.dedent(script).lstrip("\n")
        if not text.startswith("#!"):
            text = "#!/bin/bash\n" + text
        path.write_text(text)
        argv = [
            "sbatch",
            "--parsable",
            f"--job-name={JOB_NAME}",
            f"--time={_minutes(timeout)}",
            f"--output={out}",
            *args,
            str(path),
        ]
        cp = _run(argv, timeout=30, check=False, cwd=tmp_path)
        job_id = cp.stdout.strip().split(";")[0]
        fields = wait_job(job_id, timeout, out) if cp.returncode == 0 else {}
        result = BatchResult(
            job_id=job_id,
            returncode=_exit_status(fields["ExitCode"]) if fields else cp.returncode,
            output=out.read_text() if out.exists() else "",
            sbatch_stderr=cp.stderr,
        )
        if check and result.returncode != 0:
            pytest.fail(
                f"sbatch job {result.job_id} exit code {result.returncode}\n"
                f"--- output\n{result.output}\n--- sbatch stderr\n{result.sbatch_stderr}",
                pytrace=False,
            )
        return result

    return submit


# --------------------------------------------------------------------------- node processes
@dataclasses.dataclass(frozen=True)
class NodeProcess:
    node: str
    pid: int
    cmdline: str


def _job_dirs() -> dict[str, str]:
    """Job id -> working directory, for running and recently finished (MinJobAge) jobs."""
    cp = subprocess.run(
        ["squeue", "-h", "-t", "all", "-o", "%A %Z"],
        check=False,
        capture_output=True,
        text=True,
        timeout=10,
    )
    return dict(line.split(" ", 1) for line in cp.stdout.splitlines() if " " in line)


def _process_is_ours(proc: Path, cmdline: str, job_dirs: dict[str, str]) -> bool:
    """A job's task (SLURM_SUBMIT_DIR in its environment) or slurmstepd ([jobid.step])."""
    if m := re.match(r"slurmstepd: \[(\d+)", cmdline):
        return m.group(1) not in _shared_jobs and _ours(job_dirs.get(m.group(1), ""))
    try:
        environ = (proc / "environ").read_bytes().split(b"\0")
    except OSError:
        return False
    worker = cmdline.startswith("slurmrun: ") and " rank " in cmdline
    if not worker and any(f"SLURM_JOB_ID={job}".encode() in environ for job in _shared_jobs):
        return False
    for var in environ:
        if var.startswith(b"SLURM_SUBMIT_DIR="):
            return _ours(var.split(b"=", 1)[1].decode(errors="replace"))
    return False


def _snapshot(cluster: SlurmCluster) -> dict[str, list[NodeProcess]]:
    """This session's processes in the nodes' namespaces (net: netns mode, UTS: multi mode)."""
    kind = "net" if cluster.mode == "netns" else "uts"
    node_of: dict[str, str] = {}
    for node in cluster.nodes:
        if kind == "net":
            ino = os.stat(f"/run/netns/{cluster.netns_prefix}{node}").st_ino
            node_of[f"net:[{ino}]"] = node
        else:
            node_of[(cluster.state_dir / f"uts.{node}").read_text().strip()] = node
    found: dict[str, list[NodeProcess]] = {}
    job_dirs = _job_dirs()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            node = node_of.get(os.readlink(entry / "ns" / kind))
            if node is None:
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone, or a zombie
            continue
        if not argv[0] or Path(argv[0].decode(errors="replace")).name == "slurmd":
            continue
        cmdline = b" ".join(a for a in argv if a).decode(errors="replace").strip()
        if not _process_is_ours(entry, cmdline, job_dirs):
            continue
        found.setdefault(node, []).append(NodeProcess(node, int(entry.name), cmdline))
    return found


def _wait_node_processes(cluster: SlurmCluster, wait: float) -> dict[str, list[NodeProcess]]:
    deadline = time.monotonic() + wait
    while True:
        found = _snapshot(cluster)
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)


@pytest.fixture
def node_processes(slurm_cluster: SlurmCluster) -> Callable[..., dict[str, list[NodeProcess]]]:
    """``node_processes(wait=5.0)``: {node: [NodeProcess]} of this session's jobs.

    Polls until no such process is left or ``wait`` seconds pass (``wait=0``: one snapshot),
    so ``assert node_processes() == {}`` checks that a launch left nothing behind.
    """

    def get(wait: float = 5.0) -> dict[str, list[NodeProcess]]:
        return _wait_node_processes(slurm_cluster, wait)

    return get


@pytest.fixture(scope="session")
def share_job(
    slurm_cluster: SlurmCluster,
) -> Callable[[str], contextlib.AbstractContextManager[None]]:
    """``with share_job(job_id): ...``: the job outlives each test of the block.

    For a module's fixture that keeps a job (a reservation) for its tests: the clean-state
    check after each test leaves the job and its processes alone, but its workers (a test's
    own). At the end of the block (the job ended in it) no process of this session may be
    left on the nodes.
    """

    @contextlib.contextmanager
    def share(job_id: str) -> Iterator[None]:
        _shared_jobs.add(job_id)
        try:
            yield
        finally:
            _shared_jobs.discard(job_id)
        left = _wait_node_processes(slurm_cluster, 10)
        assert not left, f"job {job_id} left processes on the nodes: {left}"

    return share


@pytest.fixture(scope="session")
def cluster_turns(slurm_cluster: SlurmCluster) -> ClusterTurns:
    """This process's turns on the cluster, taken beside every pytest process that uses it.

    The xdist run's other workers, and other pytest sessions on this cluster (developers on
    one machine): another session's lost node kills this one's jobs on it as well. The lock
    files are in /tmp, which a release's rootfs shares (its cluster's netns prefix names them).
    """
    folder = _turns_folder(slurm_cluster.netns_prefix)
    folder.mkdir(exist_ok=True)
    return ClusterTurns(folder)


@pytest.fixture(scope="module")
def module_turn(cluster_turns: ClusterTurns, request: pytest.FixtureRequest) -> Iterator[None]:
    """A shared turn for the whole module, for the module fixture that requests it.

    A module fixture that keeps a job or daemons on the nodes for its tests asks for it: no
    exclusive test of another worker (a lost node, preemption) comes in between its tests.
    """
    with cluster_turns.hold("shared", request.node.nodeid):
        yield


@pytest.fixture(autouse=True)
def _cluster_turn(
    slurm_cluster: SlurmCluster, cluster_turns: ClusterTurns, request: pytest.FixtureRequest
) -> Iterator[None]:
    """Each SLURM test's turn: the cluster to itself when marked `cluster_exclusive`."""
    exclusive = request.node.get_closest_marker(EXCLUSIVE) is not None
    with cluster_turns.hold("exclusive" if exclusive else "shared", request.node.nodeid):
        yield


@pytest.fixture(autouse=True)
def _slurm_clean_state(slurm_cluster: SlurmCluster, _cluster_turn: None) -> Iterator[None]:
    """After each SLURM test: no job in squeue, no process left on the nodes."""
    yield
    problems = []
    jobs = _wait_no_jobs(10)  # a finished job shows as COMPLETING for a moment
    if jobs:
        problems.append("jobs left in squeue after the test:\n  " + "\n  ".join(jobs))
        _cancel(jobs)
        if still := _wait_no_jobs(20):
            problems.append("and still there after scancel:\n  " + "\n  ".join(still))
    leftovers = _wait_node_processes(slurm_cluster, 10)
    if leftovers:
        procs = [p for ps in leftovers.values() for p in ps]
        problems.append(
            "processes left on the nodes after the test (killed now):\n  "
            + "\n  ".join(f"{p.node} pid {p.pid}: {p.cmdline}" for p in procs)
        )
        for p in procs:  # all of them belong to this session's jobs
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


# --------------------------------------------------------------------------- preemption
@contextlib.contextmanager
def preemption_grace(seconds: int) -> Iterator[None]:
    """The default partition's preemption GraceTime, as on clusters that give one."""

    def update(value: int) -> None:
        _run(
            ["scontrol", "update", "partition=debug", f"GraceTime={value}"], timeout=30, check=True
        )

    require_exclusive("a partition's GraceTime")
    update(seconds)
    try:
        yield
    finally:
        update(0)


def preempt_debug_jobs(tmp_path: Path, cluster: SlurmCluster) -> None:
    """Submits a job of the `urgent` partition that needs every node: SLURM preempts (with
    PreemptMode=REQUEUE) the jobs of `debug` that run there. It sleeps 1 s and ends."""
    require_exclusive("preempting every job of `debug`")
    _run(
        ["sbatch", "--partition=urgent", f"--nodes={cluster.num_nodes}", "--exclusive", "--time=1",
         f"--job-name={JOB_NAME}", f"--output={tmp_path / 'urgent.out'}", "--wrap", "sleep 1"],
        timeout=30, check=True, cwd=tmp_path,
    )  # fmt: skip


ENDED_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}
    | {"DEADLINE", "PREEMPTED"}
)


def wait_job(job_id: str, timeout: float, output: Path | None = None) -> dict[str, str]:
    """Polls `job_id` every 0.2 s until it ended; returns its `scontrol_job` fields.

    ``sbatch --wait`` looks at the job after 2, 10, 42, 74 s...: a job of 15 s costs 42 s.
    A job not ended after `timeout` is cancelled and the test fails with its `output`.
    """
    deadline = time.monotonic() + timeout
    fields: dict[str, str] = {}
    while time.monotonic() < deadline:
        fields = scontrol_job(job_id)
        if fields.get("JobState") in ENDED_STATES:
            return fields
        time.sleep(0.2)
    subprocess.run(["scancel", job_id], timeout=10, check=False)
    shown = output.read_text() if output is not None and output.exists() else ""
    pytest.fail(
        f"job {job_id} still {fields.get('JobState')} after {timeout} s (cancelled)\n{shown}",
        pytrace=False,
    )


def _exit_status(exit_code: str) -> int:
    """A shell's status of the batch script from scontrol's ``ExitCode=N:S``, as sbatch --wait."""
    code, _, sig = exit_code.partition(":")
    if code.isdigit() and int(code):
        return int(code)
    return 128 + int(sig) if sig.isdigit() and int(sig) else 0


def scontrol_job(job_id: str) -> dict[str, str]:
    """``scontrol show job``'s fields of `job_id` (``JobState``, ``Restarts``...)."""
    text = _run(["scontrol", "show", "job", "--oneliner", job_id], timeout=30, check=True).stdout
    return dict(word.partition("=")[::2] for word in text.split() if "=" in word)
