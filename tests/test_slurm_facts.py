"""Tests for slurmrun.slurm: the job from SLURM's variables, scontrol's output, preemption."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurmrun.devices import usable_cpu_count
from slurmrun.slurm import job as slurm_job
from slurmrun.slurm import job_end as slurm_end
from slurmrun.slurm import scontrol as slurm_scontrol
from slurmrun.slurm.job import SlurmAllocation, auto_workers_per_host, slurm_allocation
from slurmrun.slurm.scontrol import parse_scontrol_gpus, scontrol_gpus
from slurmrun.slurm.step import step_id
from slurmrun.worker_env import expand_counts


def job_env(**overrides: str) -> dict[str, str]:
    """A two-node job as sbatch would describe it, with overrides."""
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_JOB_CPUS_PER_NODE": "8(x2)",
    }
    env.update(overrides)
    return env


def single_node_env(**overrides: str) -> dict[str, str]:
    return job_env(SLURM_JOB_NODELIST="node1", SLURM_JOB_CPUS_PER_NODE="8", **overrides)


# --- expand_counts -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("36(x2),72", [36, 36, 72]),
        ("4", [4]),
        ("2(x3)", [2, 2, 2]),
        ("1,2,3", [1, 2, 3]),
        ("72,36(x2),8", [72, 36, 36, 8]),
        ("0", [0]),
        ("128(x16)", [128] * 16),
    ],
)
def test_expand_counts_reads_compressed_repeats(value, expected):
    assert expand_counts(value, "SLURM_JOB_CPUS_PER_NODE") == expected


@pytest.mark.parametrize("value", ["", "x", "4(x)", "4(2)", "4(x0)", "-1", "4,,4", "4(x2", "2.5"])
def test_expand_counts_rejects_malformed_values_naming_the_variable(value):
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE") as info:
        expand_counts(value, "SLURM_TASKS_PER_NODE")
    assert repr(value) in str(info.value)
    assert "expected" in str(info.value)


# --- slurm_allocation: nodes and counts -----------------------------------------------------


def test_slurm_allocation_is_none_outside_a_job():
    assert slurm_allocation({}) is None
    assert slurm_allocation({"SLURM_JOB_NODELIST": "node1", "PATH": "/bin"}) is None


def test_slurm_allocation_reads_a_typical_batch_job():
    env = job_env(
        SLURM_JOB_NODELIST="gpu[01-02]",
        SLURM_JOB_CPUS_PER_NODE="36(x2)",
        SLURM_TASKS_PER_NODE="4(x2)",
        SLURM_GPUS_PER_NODE="4",
    )
    assert slurm_allocation(env) == SlurmAllocation(
        job_id="4242",
        hostnames=["gpu01", "gpu02"],
        cpus_per_node=[36, 36],
        tasks_per_node=[4, 4],
        gpus_per_node=[4, 4],
    )


def test_slurm_allocation_accepts_old_slurm_jobid_alias():
    env = job_env()
    del env["SLURM_JOB_ID"]
    env["SLURM_JOBID"] = "77"
    result = slurm_allocation(env)
    assert result is not None
    assert result.job_id == "77"


def test_slurm_allocation_prefers_job_nodelist_over_step_nodelist():
    # srun rewrites SLURM_NODELIST to the step's nodes; the job's list is SLURM_JOB_NODELIST.
    result = slurm_allocation(job_env(SLURM_NODELIST="node2"))
    assert result is not None
    assert result.hostnames == ["node1", "node2"]


def test_slurm_allocation_falls_back_to_slurm_nodelist():
    env = job_env()
    env["SLURM_NODELIST"] = env.pop("SLURM_JOB_NODELIST")
    result = slurm_allocation(env)
    assert result is not None
    assert result.hostnames == ["node1", "node2"]


@pytest.mark.parametrize(
    ("nodelist", "expected"),
    [
        ("gpu-a[01-03,07],login5", ["gpu-a01", "gpu-a02", "gpu-a03", "gpu-a07", "login5"]),
        ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("node7", ["node7"]),
        ("node[098-101]", ["node098", "node099", "node100", "node101"]),
        ("c[1-2]n[01-02]", ["c1n01", "c1n02", "c2n01", "c2n02"]),
        ("node10,node2", ["node10", "node2"]),
    ],
)
def test_slurm_allocation_expands_odd_nodelists_in_slurm_order(nodelist, expected):
    env = job_env(SLURM_JOB_NODELIST=nodelist, SLURM_JOB_CPUS_PER_NODE=f"4(x{len(expected)})")
    result = slurm_allocation(env)
    assert result is not None
    assert result.hostnames == expected
    assert result.cpus_per_node == [4] * len(expected)


@pytest.mark.parametrize("nodelist", ["node[1-", "node[3-1]", "node]1[", ""])
def test_slurm_allocation_rejects_malformed_nodelist_naming_the_variable(nodelist):
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST"):
        slurm_allocation(job_env(SLURM_JOB_NODELIST=nodelist))


def test_slurm_allocation_without_nodelist_names_both_variables():
    env = job_env()
    del env["SLURM_JOB_NODELIST"]
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST nor SLURM_NODELIST"):
        slurm_allocation(env)


def test_slurm_allocation_without_cpus_per_node_names_the_variable():
    env = job_env()
    del env["SLURM_JOB_CPUS_PER_NODE"]
    with pytest.raises(ValueError, match="SLURM_JOB_CPUS_PER_NODE"):
        slurm_allocation(env)


@pytest.mark.parametrize(
    ("variable", "value"),
    [("SLURM_JOB_CPUS_PER_NODE", "8(x3)"), ("SLURM_TASKS_PER_NODE", "1")],
)
def test_slurm_allocation_rejects_count_lists_of_the_wrong_length(variable, value):
    with pytest.raises(ValueError, match=rf"{variable}=.*SLURM_JOB_NODELIST has 2"):
        slurm_allocation(job_env(**{variable: value}))


@pytest.mark.parametrize("variable", ["SLURM_JOB_CPUS_PER_NODE", "SLURM_TASKS_PER_NODE"])
def test_slurm_allocation_rejects_malformed_counts_naming_the_variable(variable):
    with pytest.raises(ValueError, match=variable):
        slurm_allocation(job_env(**{variable: "eight"}))


def test_slurm_allocation_reads_uneven_tasks_per_node():
    env = job_env(
        SLURM_JOB_NODELIST="node[1-3]",
        SLURM_JOB_CPUS_PER_NODE="36(x2),72",
        SLURM_TASKS_PER_NODE="2(x2),1",
    )
    result = slurm_allocation(env)
    assert result is not None
    assert result.cpus_per_node == [36, 36, 72]
    assert result.tasks_per_node == [2, 2, 1]


def test_slurm_allocation_leaves_tasks_and_gpus_unknown_when_unset():
    result = slurm_allocation(job_env())
    assert result is not None
    assert result.tasks_per_node is None
    assert result.gpus_per_node is None


# --- slurm_allocation: GPUs per node --------------------------------------------------------


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({"SLURM_GPUS_PER_NODE": "2"}, [2, 2]),
        ({"SLURM_GPUS_PER_NODE": "a100:2"}, [2, 2]),
        ({"SLURM_GPUS_PER_NODE": "a100:2,v100:1"}, [3, 3]),
        ({"SLURM_GPUS_PER_NODE": "1g.10gb:1"}, [1, 1]),
        ({"SLURM_TRES_PER_NODE": "gres/gpu:2"}, [2, 2]),
        ({"SLURM_TRES_PER_NODE": "gres/gpu:a100:4"}, [4, 4]),
        ({"SLURM_TRES_PER_NODE": "gres:gpu:2"}, [2, 2]),
        ({"SLURM_TRES_PER_NODE": "gres/gpu=3"}, [3, 3]),
        ({"SLURM_TRES_PER_NODE": "gres/gpu"}, [1, 1]),
        ({"SLURM_TRES_PER_NODE": "gres/gpu:a100:2,gres/gpu:v100:1"}, [3, 3]),
        ({"SLURM_TRES_PER_NODE": "gres/shard:2,gres/gpu:4"}, [4, 4]),
        ({"SLURM_JOB_GRES": "gpu:2"}, [2, 2]),
        ({"SLURM_JOB_GRES": "gpu:tesla"}, [1, 1]),
        ({"SLURM_GPUS": "6"}, [3, 3]),
        ({"SLURM_GPUS": "a100:8"}, [4, 4]),
        ({"SLURM_GPUS": "5"}, None),
        ({"SLURM_TRES_PER_NODE": "gres/shard:2"}, None),
        ({}, None),
    ],
)
def test_slurm_allocation_reads_gpus_per_node_from_request_variables(variables, expected):
    result = slurm_allocation(job_env(**variables))
    assert result is not None
    assert result.gpus_per_node == expected


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({"SLURM_GPUS_ON_NODE": "4"}, [4]),
        ({"SLURM_JOB_GPUS": "0,1,2"}, [3]),
        ({"SLURM_JOB_GPUS": "0-3"}, [4]),
        ({"SLURM_JOB_GPUS": "5"}, [1]),
        ({"SLURM_GPUS": "3"}, [3]),
        ({"SLURM_GPUS_ON_NODE": "2", "SLURM_GPUS_PER_NODE": "8"}, [2]),
    ],
)
def test_slurm_allocation_trusts_this_node_gpu_variables_in_single_node_jobs(variables, expected):
    result = slurm_allocation(single_node_env(**variables))
    assert result is not None
    assert result.gpus_per_node == expected


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({"SLURM_GPUS_ON_NODE": "4"}, None),
        ({"SLURM_JOB_GPUS": "0,1"}, None),
        ({"SLURM_GPUS_ON_NODE": "4", "SLURM_GPUS_PER_NODE": "2"}, [2, 2]),
    ],
)
def test_slurm_allocation_ignores_batch_node_gpu_variables_in_multi_node_jobs(variables, expected):
    result = slurm_allocation(job_env(**variables))
    assert result is not None
    assert result.gpus_per_node == expected


def test_slurm_allocation_prefers_per_node_requests_over_job_total():
    result = slurm_allocation(job_env(SLURM_GPUS_PER_NODE="4", SLURM_GPUS="2"))
    assert result is not None
    assert result.gpus_per_node == [4, 4]


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("SLURM_GPUS_PER_NODE", "a100:two"),
        ("SLURM_GPUS_PER_NODE", "2,"),
        ("SLURM_TRES_PER_NODE", "gres/gpu:a100:x:y"),
        ("SLURM_JOB_GRES", "gpu:a100:"),
        ("SLURM_GPUS", "many"),
    ],
)
def test_slurm_allocation_rejects_malformed_gpu_variables_naming_them(variable, value):
    with pytest.raises(ValueError, match=variable) as info:
        slurm_allocation(job_env(**{variable: value}))
    assert repr(value) in str(info.value)


@pytest.mark.parametrize(
    ("variable", "value"),
    [("SLURM_GPUS_ON_NODE", "four"), ("SLURM_JOB_GPUS", "0,a")],
)
def test_slurm_allocation_rejects_malformed_node_gpu_variables_naming_them(variable, value):
    with pytest.raises(ValueError, match=variable):
        slurm_allocation(single_node_env(**{variable: value}))


# --- node_index ----------------------------------------------------------------------------


def make_allocation(hostnames: list[str]) -> SlurmAllocation:
    return SlurmAllocation("9", hostnames, [1] * len(hostnames), None, None)


def test_node_index_finds_host_in_slurm_order():
    job = make_allocation(["node10", "node2", "node3"])
    assert [job.node_index(h) for h in ("node10", "node2", "node3")] == [0, 1, 2]


def test_node_index_matches_fully_qualified_hostname_to_short_node_name():
    job = make_allocation(["node1", "node2"])
    assert job.node_index("node2.cluster.example.org") == 1


def test_node_index_rejects_host_outside_the_job_with_its_nodes_listed():
    job = make_allocation(["node1", "node2"])
    with pytest.raises(ValueError, match=r"'login1' is not part of SLURM job 9.*node1, node2"):
        job.node_index("login1")


# --- scontrol ------------------------------------------------------------------------------

SCONTROL_TWO_GROUPS = """\
JobId=1234 JobName=train
   UserId=alice(1000) GroupId=alice(1000) MCS_label=N/A
   Priority=1 Nice=0 Account=ml QOS=normal
   JobState=RUNNING Reason=None Dependency=(null)
   NodeList=node[1-3]
   BatchHost=node1
   NumNodes=3 NumCPUs=10 NumTasks=3 CPUs/Task=1 ReqB:S:C:T=0:0:*:*
   TRES=cpu=10,mem=40G,node=3,billing=10,gres/gpu=5
   Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=*
   JOB_GRES=gpu:5
     Nodes=node[1-2] CPU_IDs=0-3 Mem=0 GRES=gpu:2(IDX:0-1)
     Nodes=node3 CPU_IDs=0-1 Mem=0 GRES=gpu:1(IDX:0)
   MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0
   Features=(null) DelayBoot=00:00:00
   TresPerNode=gres:gpu:2
   Command=/home/alice/train.sh
"""

SCONTROL_TYPED = """\
JobId=88 JobName=big
   NodeList=gpu-a[01-02],gpu-b07
   JOB_GRES=gpu:a100:8,gpu:v100:2
     Nodes=gpu-a[01-02] CPU_IDs=0-63 Mem=512000 GRES=gpu:a100:4(IDX:0-3)
     Nodes=gpu-b07 CPU_IDs=0-7 Mem=64000 GRES=gpu:a100:1(IDX:0),gpu:v100:2(IDX:1-2)
"""

SCONTROL_OLD_GRES_IDX = """\
JobId=17 JobName=old
   NodeList=node-06
   TRES=cpu=4,mem=80G,node=1,billing=4,gres/gpu=4
     Nodes=node-06 CPU_IDs=10-11,15,21 Mem=81920 GRES_IDX=gpu(IDX:0,2-3,5)
   MinCPUsNode=4 MinMemoryNode=80G MinTmpDiskNode=0
   Gres=gpu:4 Reservation=(null)
"""

SCONTROL_CPU_ONLY = """\
JobId=5 JobName=cpu
   NodeList=cpu[1-2]
     Nodes=cpu[1-2] CPU_IDs=0-31 Mem=0 GRES=
   MinCPUsNode=1
"""

# Typed GPUs over node groups of several sizes (what `scontrol -o` once gave in one line: slurmrun
# reads the layout of lines, where free-text values end at their line's end).
SCONTROL_TYPED_GROUPS = """\
JobId=10 JobName=a b
   JobState=RUNNING
   NodeList=n[1-3]
   JOB_GRES=gpu:h200:5
     Nodes=n[1-2] CPU_IDs=0-7 Mem=0 GRES=gpu:h200:2(IDX:0-1)
     Nodes=n3 CPU_IDs=0-3 Mem=0 GRES=gpu:h200:1(IDX:6)
   MinCPUsNode=1
"""

SCONTROL_SHARDS = """\
JobId=31 JobName=shared
     Nodes=node4 CPU_IDs=0-1 Mem=0 GRES=gpu:1(IDX:3),shard:2(3/8,0/8)
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (SCONTROL_TWO_GROUPS, {"node1": 2, "node2": 2, "node3": 1}),
        (SCONTROL_TYPED, {"gpu-a01": 4, "gpu-a02": 4, "gpu-b07": 3}),
        (SCONTROL_OLD_GRES_IDX, {"node-06": 4}),
        (SCONTROL_CPU_ONLY, {"cpu1": 0, "cpu2": 0}),
        (SCONTROL_TYPED_GROUPS, {"n1": 2, "n2": 2, "n3": 1}),
        (SCONTROL_SHARDS, {"node4": 1}),
        ("     Nodes=gpu[04-05] CPU_IDs=0-47 Mem=0 GRES=gpu(IDX:0-7)\n", {"gpu04": 8, "gpu05": 8}),
        ("     Nodes=gpu1 CPU_IDs=0 Mem=0 GRES_IDX=gpu:K2(IDX:0-1)\n", {"gpu1": 2}),
        ("     Nodes=gpu1 CPU_IDs=0 Mem=0 GRES=gpu:2(IDX:N/A)\n", {"gpu1": 2}),
        ("     Nodes=node1 CPU_IDs=0-3 Mem=0\n", {"node1": 0}),
        ("JobId=3 JobName=pending\n   JobState=PENDING Reason=Resources\n", {}),
    ],
)
def test_parse_scontrol_gpus_reads_per_node_gres_lines(text, expected):
    assert parse_scontrol_gpus(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "     Nodes=node[1- CPU_IDs=0 Mem=0 GRES=gpu:1(IDX:0)\n",
        "     Nodes=node1 CPU_IDs=0 Mem=0 GRES=gpu(IDX:zero)\n",
    ],
)
def test_parse_scontrol_gpus_rejects_malformed_lines(text):
    with pytest.raises(ValueError, match="scontrol output"):
        parse_scontrol_gpus(text)


def fake_scontrol(directory: Path, script: str) -> None:
    """Put an executable `scontrol` in `directory` that runs `script` (a shell body)."""
    path = directory / "scontrol"
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)


@pytest.fixture
def scontrol_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    return tmp_path


@pytest.mark.skipif(sys.platform == "win32", reason="uses a shell script as a fake scontrol")
def test_scontrol_gpus_runs_scontrol_show_job_detailed(scontrol_dir):
    (scontrol_dir / "out.txt").write_text(SCONTROL_TWO_GROUPS)
    fake_scontrol(
        scontrol_dir,
        f'[ "$*" = "show job -d 1234" ] && cat "{scontrol_dir}/out.txt" || exit 1',
    )
    assert scontrol_gpus("1234") == {"node1": 2, "node2": 2, "node3": 1}


@pytest.mark.skipif(sys.platform == "win32", reason="uses a shell script as a fake scontrol")
@pytest.mark.parametrize(
    "script",
    [
        'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1',
        "echo JobId=1 JobState=PENDING",
        "echo '     Nodes=node[1- GRES=gpu:1'",
    ],
)
def test_scontrol_gpus_is_none_when_scontrol_fails_or_says_nothing(scontrol_dir, script):
    fake_scontrol(scontrol_dir, script)
    assert scontrol_gpus("1") is None


@pytest.mark.skipif(sys.platform == "win32", reason="uses a shell script as a fake scontrol")
def test_scontrol_gpus_gives_up_after_timeout(scontrol_dir):
    fake_scontrol(scontrol_dir, "exec sleep 5")
    assert scontrol_gpus("1", timeout=0.2) is None


def test_scontrol_gpus_is_none_without_scontrol(monkeypatch):
    def missing(*args, **kwargs):
        raise FileNotFoundError("scontrol")

    monkeypatch.setattr(slurm_scontrol.subprocess, "run", missing)
    assert scontrol_gpus("1") is None


# --- node states (scontrol show node) ------------------------------------------------------

# `scontrol show node node2` on Slurm 22.05 (the test cluster), node2 set down by an admin.
NODE_DOWN = """\
NodeName=node2 Arch=x86_64 CoresPerSocket=4
   CPUAlloc=0 CPUEfctv=4 CPUTot=4 CPULoad=1.56
   OS=Linux 6.18.44 #1 SMP PREEMPT_DYNAMIC @0
   RealMemory=4096 AllocMem=0 FreeMem=21535 Sockets=1 Boards=1
   State=DOWN ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A
   Partitions=debug,urgent
   LastBusyTime=2026-11-27T12:55:54
   CfgTRES=cpu=4,mem=4G,billing=4
   AllocTRES=
   Reason=slurmrun test State=IDLE [root@2026-11-27T12:57:53]
"""
# `scontrol show node` (records of several lines), as 24.11 prints them.
NODES_BLOCKS = """NodeName=gpu01 Arch=x86_64 CoresPerSocket=32
   State=MIXED+DRAIN+NOT_RESPONDING ThreadsPerCore=1 TmpDisk=0 Weight=1
   Partitions=gpu
   Reason=Kill task failed [slurm@2026-01-02T03:04:05]

NodeName=gpu02 Arch=x86_64 CoresPerSocket=32
   State=ALLOCATED ThreadsPerCore=1 TmpDisk=0 Weight=1
   ResumeAfterTime=None

NodeName=gpu03 Arch=x86_64 CoresPerSocket=32
   State=IDLE+DRAIN ThreadsPerCore=1 TmpDisk=0 Weight=1
   Reason=health check: gpu 3 fell off the bus [root@2026-01-02T03:04:05]
"""


def test_node_states_are_read_from_fields_of_each_record():
    (node2,) = slurm_scontrol.parse_node_states(NODE_DOWN).values()
    assert node2.words == ("DOWN",) and not node2.usable
    assert node2.reason == "slurmrun test State=IDLE"  # free text: its words are no fields
    assert str(node2) == "DOWN (reason: slurmrun test State=IDLE)"
    states = slurm_scontrol.parse_node_states(NODES_BLOCKS)
    assert [(n, s.words, s.usable) for n, s in states.items()] == [
        ("gpu01", ("MIXED", "DRAIN", "NOT_RESPONDING"), False),
        ("gpu02", ("ALLOCATED",), True),
        ("gpu03", ("IDLE", "DRAIN"), False),
    ]
    assert states["gpu03"].reason == "health check: gpu 3 fell off the bus"
    assert states["gpu02"].reason == ""


@pytest.mark.parametrize(
    ("state", "usable"),
    [
        ("IDLE", True),
        ("MIXED", True),
        ("ALLOCATED+COMPLETING", True),
        ("MIXED+PLANNED", True),
        ("ALLOCATED+POWER_DOWN", True),  # powered off once idle: it still runs the job
        ("DOWN+NOT_RESPONDING", False),
        ("DOWN+DRAIN+DYNAMIC_NORM+INVALID_REG", False),
        ("IDLE+NOT_RESPONDING", False),
        ("ALLOCATED+FAIL", False),
        ("MIXED+DRAIN", False),
        ("DRAINED", False),
        ("down*", False),  # sinfo's short form
        ("IDLE+CLOUD+POWERED_DOWN", False),
        ("ALLOCATED+REBOOT_ISSUED", False),
    ],
)
def test_a_node_is_unusable_when_a_word_of_its_state_says_so(state, usable):
    (node,) = slurm_scontrol.parse_node_states(f"NodeName=n1 State={state} Weight=1").values()
    assert node.usable is usable


@pytest.mark.skipif(sys.platform == "win32", reason="uses a shell script as a fake scontrol")
def test_unusable_nodes_asks_scontrol_show_node_for_the_nodes_and_keeps_the_bad_ones(scontrol_dir):
    from slurmrun.launcher.agents.srun import unusable_nodes

    (scontrol_dir / "out.txt").write_text(NODES_BLOCKS)
    fake_scontrol(
        scontrol_dir,
        f'[ "$*" = "show node gpu01,gpu02,gpu03" ] && cat "{scontrol_dir}/out.txt" || exit 1',
    )
    assert sorted(unusable_nodes(["gpu01", "gpu02", "gpu03"])) == ["gpu01", "gpu03"]
    fake_scontrol(scontrol_dir, "exit 1")  # scontrol cannot tell: no node is blamed
    assert unusable_nodes(["gpu01"]) == {}


# --- job_gpus_per_node: what the agents' step asks for -------------------------------------


def _job(gpus: list[int] | None, step: slurm_job.DriverStep | None = None) -> SlurmAllocation:
    return SlurmAllocation("1234", ["node1", "node2", "node3"], [4, 4, 2], None, gpus, step)


def _counting(outputs: list[str | None]):
    """A stand-in for scontrol that answers `outputs` in turn and records its job ids."""
    calls: list[str] = []

    def scontrol(job_id: str) -> str | None:
        calls.append(job_id)
        return outputs[len(calls) - 1]

    return scontrol, calls


def test_job_gpus_per_node_asks_scontrol_once_where_no_variable_tells():
    scontrol, calls = _counting([SCONTROL_TWO_GROUPS])
    assert slurm_job.job_gpus_per_node(_job(None), scontrol) == [2, 2, 1]
    assert calls == ["1234"]


@pytest.mark.parametrize(
    "output", [None, "JobId=1234 JobState=PENDING", "     Nodes=node[1- GRES=gpu:1"]
)
def test_job_gpus_per_node_counts_0_where_scontrol_does_not_tell(output):
    scontrol, calls = _counting([output])
    assert slurm_job.job_gpus_per_node(_job(None), scontrol) == [0, 0, 0]
    assert len(calls) == 1


def test_job_gpus_per_node_counts_0_on_a_node_scontrol_does_not_list():
    scontrol, _ = _counting(["     Nodes=node[1-2] CPU_IDs=0-3 Mem=0 GRES=gpu:2(IDX:0-1)"])
    assert slurm_job.job_gpus_per_node(_job(None), scontrol) == [2, 2, 0]


def test_job_gpus_per_node_asks_nothing_when_a_variable_or_the_step_did():
    scontrol, calls = _counting([])
    assert slurm_job.job_gpus_per_node(_job([4, 4, 2]), scontrol) == [4, 4, 2]
    # Inside a step slurm_allocation asked scontrol already; its silence is not asked again.
    step = slurm_job.DriverStep("1234.0", num_tasks=1, proc_id=0)
    assert slurm_job.job_gpus_per_node(_job(None, step), scontrol) == [0, 0, 0]
    assert calls == []


def test_job_hostnames_reads_the_node_list_alone():
    assert slurm_job.job_hostnames(job_env(SLURM_JOB_CPUS_PER_NODE="bad")) == ["node1", "node2"]
    assert slurm_job.job_hostnames({"SLURM_JOB_NODELIST": "node1"}) is None
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST"):
        slurm_job.job_hostnames(job_env(SLURM_JOB_NODELIST="node[1-"))


def test_importing_slurm_facts_does_not_import_torch():
    code = "import sys, slurmrun.slurm.job, slurmrun.slurm.job_end, slurmrun.slurm.queue; "
    code += "sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# --- auto_workers_per_host -------------------------------------------------------------------


def test_auto_workers_per_host_uses_visible_gpus_first(tmp_path):
    env = job_env(CUDA_VISIBLE_DEVICES="0,1,2", SLURM_TASKS_PER_NODE="8(x2)")
    assert auto_workers_per_host(env, 0, dev_dir=tmp_path) == 3


def test_auto_workers_per_host_counts_gpu_device_files_outside_slurm(tmp_path):
    (tmp_path / "nvidia0").touch()
    (tmp_path / "nvidia1").touch()
    assert auto_workers_per_host({}, None, dev_dir=tmp_path) == 2


@pytest.mark.parametrize(("node_index", "expected"), [(0, 2), (1, 2), (2, 1)])
def test_auto_workers_per_host_uses_job_tasks_for_this_node_without_gpus(
    node_index, expected, tmp_path
):
    env = job_env(SLURM_JOB_NODELIST="node[1-3]", SLURM_TASKS_PER_NODE="2(x2),1")
    assert auto_workers_per_host(env, node_index, dev_dir=tmp_path) == expected


@pytest.mark.parametrize(
    ("env", "node_index"),
    [
        (job_env(), 0),
        (job_env(SLURM_TASKS_PER_NODE="4(x2)"), None),
        (job_env(SLURM_TASKS_PER_NODE="4(x2)", CUDA_VISIBLE_DEVICES=""), None),
    ],
)
def test_auto_workers_per_host_is_one_inside_slurm_when_tasks_unknown(env, node_index, tmp_path):
    assert auto_workers_per_host(env, node_index, dev_dir=tmp_path) == 1


def test_auto_workers_per_host_ignores_device_files_hidden_by_slurm(tmp_path):
    # A step without GPUs gets an empty CUDA_VISIBLE_DEVICES even on a GPU node.
    (tmp_path / "nvidia0").touch()
    env = job_env(SLURM_TASKS_PER_NODE="3(x2)", CUDA_VISIBLE_DEVICES="")
    assert auto_workers_per_host(env, 1, dev_dir=tmp_path) == 3


def test_auto_workers_per_host_uses_usable_cpus_outside_slurm(tmp_path):
    assert auto_workers_per_host({}, None, dev_dir=tmp_path) == usable_cpu_count()


@pytest.mark.parametrize(
    ("tasks", "node_index", "message"),
    [("2(x2)", 2, "no entry for node index 2"), ("two", 0, "SLURM_TASKS_PER_NODE")],
)
def test_auto_workers_per_host_rejects_bad_tasks_per_node(tasks, node_index, message, tmp_path):
    env = job_env(SLURM_TASKS_PER_NODE=tasks)
    with pytest.raises(ValueError, match=message):
        auto_workers_per_host(env, node_index, dev_dir=tmp_path)


# --- inside a job step ---------------------------------------------------------------------

SCONTROL_IN_STEP = """\
JobId=55 JobName=interactive
   NodeList=node[1-3]
   NumNodes=3 NumCPUs=5 NumTasks=5 CPUs/Task=1 ReqB:S:C:T=0:0:*:*
   Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=*
   JOB_GRES=gpu:6
     Nodes=node1 CPU_IDs=0-2 Mem=0 GRES=gpu:2(IDX:0-1)
     Nodes=node[2-3] CPU_IDs=0 Mem=0 GRES=gpu:2(IDX:0-1)
"""


def step_env(**overrides: str) -> dict[str, str]:
    """What `srun -N1 -n1 python train.py` inside `salloc -N3 -n5` sees (observed-env.md)."""
    env = {
        "SLURM_JOB_ID": "55",
        "SLURM_JOB_NODELIST": "node[1-3]",
        "SLURM_JOB_NUM_NODES": "3",
        "SLURM_JOB_CPUS_PER_NODE": "3,1(x2)",
        "SLURM_NODELIST": "node[1-3]",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": "1",
        "SLURM_PROCID": "0",
        # These describe the step, not the job:
        "SLURM_TASKS_PER_NODE": "1",
        "SLURM_NTASKS": "1",
        "SLURM_NNODES": "1",
        "SLURM_GPUS_ON_NODE": "1",
        "SLURM_GPUS_PER_NODE": "1",
    }
    env.update(overrides)
    return env


def test_slurm_allocation_inside_a_step_reads_the_job_not_the_step():
    asked = []

    def scontrol(job_id: str) -> str:
        asked.append(job_id)
        return SCONTROL_IN_STEP

    result = slurm_allocation(step_env(), scontrol=scontrol)
    assert asked == ["55"]
    assert result == SlurmAllocation(
        job_id="55",
        hostnames=["node1", "node2", "node3"],
        cpus_per_node=[3, 1, 1],
        tasks_per_node=[3, 1, 1],
        gpus_per_node=[2, 2, 2],
        driver_step=slurm_job.DriverStep("55.0", num_tasks=1, proc_id=0),
    )


def test_slurm_allocation_in_the_job_shell_never_asks_scontrol():
    def scontrol(job_id: str) -> str:
        raise AssertionError("scontrol asked outside a step")

    env = job_env(SLURM_TASKS_PER_NODE="2(x2)")
    result = slurm_allocation(env, scontrol=scontrol)
    assert result is not None
    assert result.tasks_per_node == [2, 2]
    assert result.driver_step is None


@pytest.mark.parametrize("answer", [None, "", "JobId=55 JobState=PENDING\n"])
def test_slurm_allocation_inside_a_step_without_scontrol_leaves_counts_unknown(answer):
    result = slurm_allocation(step_env(), scontrol=lambda job_id: answer)
    assert result is not None
    assert result.hostnames == ["node1", "node2", "node3"]
    assert result.tasks_per_node is None
    assert result.gpus_per_node is None


def test_slurm_allocation_names_the_step_and_its_tasks():
    env = step_env(SLURM_STEP_ID="3", SLURM_STEP_NUM_TASKS="2", SLURM_PROCID="1")
    result = slurm_allocation(env, scontrol=lambda job_id: None)
    assert result is not None
    assert result.driver_step == slurm_job.DriverStep("55.3", num_tasks=2, proc_id=1)


@pytest.mark.parametrize("special", ["-5", "4294967291", "-4", "-6", "4294967293", "", "batch"])
def test_a_batch_script_or_other_special_step_is_the_job_shell_not_a_step(special):
    # Issue 50: 26.05 sets SLURM_STEP_ID=-5 (SLURM_BATCH_SCRIPT) in a batch script.
    env = job_env(SLURM_TASKS_PER_NODE="2(x2)", SLURM_STEP_ID=special, SLURM_STEPID=special)
    assert step_id(env) is None
    result = slurm_allocation(env, scontrol=lambda job_id: "unused")
    assert result is not None
    assert result.driver_step is None
    assert result.tasks_per_node == [2, 2]


@pytest.mark.parametrize(("value", "expected"), [("0", 0), ("7", 7), ("4294967279", 4294967279)])
def test_a_regular_step_id_is_a_step(value, expected):
    assert step_id({"SLURM_STEPID": value}) == expected
    assert step_id({"SLURM_STEP_ID": value}) == expected


def test_slurm_allocation_rejects_a_node_count_that_contradicts_the_node_list():
    with pytest.raises(ValueError, match=r"SLURM_JOB_NUM_NODES='2'.*has 3 nodes"):
        slurm_allocation(step_env(SLURM_JOB_NUM_NODES="2"), scontrol=lambda job_id: None)


def scontrol_tasks(nodes: int, tasks: int, cpus_per_task: int = 1, per_node: int = 0) -> str:
    return (
        f"   NumNodes={nodes} NumCPUs=9 NumTasks={tasks} CPUs/Task={cpus_per_task} "
        f"ReqB:S:C:T=0:0:*:*\n   Socks/Node=* NtasksPerN:B:S:C={per_node}:0:*:* CoreSpec=*\n"
    )


# The SLURM_TASKS_PER_NODE that salloc gave these jobs on the test cluster (observed-env.md).
@pytest.mark.parametrize(
    ("salloc", "text", "cpus", "expected"),
    [
        ("-N3", scontrol_tasks(3, 3), [1, 1, 1], [1, 1, 1]),
        ("-N3 --exclusive", scontrol_tasks(3, 3), [4, 4, 4], [4, 4, 4]),
        ("-N3 --ntasks-per-node=2", scontrol_tasks(3, 6, 1, 2), [2, 2, 2], [2, 2, 2]),
        ("-N3 -n5", scontrol_tasks(3, 5), [3, 1, 1], [3, 1, 1]),
        ("-N3 -n4 -c2", scontrol_tasks(3, 4, 2), [4, 2, 2], [2, 1, 1]),
        ("-N2 -n5 (4 CPUs each)", scontrol_tasks(2, 5), [4, 4], [3, 2]),
        ("-N2 -n3 --exclusive", scontrol_tasks(2, 3), [4, 4], [2, 1]),
    ],
)
def test_job_tasks_per_node_matches_what_salloc_sets(salloc, text, cpus, expected):
    assert slurm_scontrol.job_tasks_per_node(text, cpus) == expected


@pytest.mark.parametrize(
    "text", ["JobId=1 JobState=PENDING", scontrol_tasks(2, 2), scontrol_tasks(3, 3, 0)]
)
def test_job_tasks_per_node_is_none_when_scontrol_does_not_say(text):
    assert slurm_scontrol.job_tasks_per_node(text, [4, 4, 4]) is None


def test_job_node_index_reads_only_the_job_node_list():
    env = step_env()
    assert slurm_job.job_node_index(env, "node2") == 1
    assert slurm_job.job_node_index(env, "node3.cluster.example.org") == 2
    assert slurm_job.job_node_index(env, "login1") is None
    assert slurm_job.job_node_index({}, "node1") is None


def test_preemption_reads_a_recent_preempt_time_and_requeue_from_scontrol():
    now = datetime.datetime(2026, 11, 25, 6, 47)
    running = (
        "JobId=7 JobName=x\n   JobState=RUNNING Reason=None Dependency=(null)\n"
        "   Requeue=1 Restarts=0\n"
        "   PreemptEligibleTime=2026-11-25T06:46:39 PreemptTime=None"
    )
    preempted = running.replace("PreemptTime=None", "PreemptTime=2026-11-25T06:46:46")

    def ask(text: str | None, at: datetime.datetime = now) -> slurm_end.Preemption | None:
        return slurm_end.preemption("7", scontrol=lambda _: text, now=at)

    assert ask(running) is None
    assert ask(None) is None  # no scontrol, or no such job
    assert ask(preempted) == slurm_end.Preemption("7", "2026-11-25T06:46:46", requeueable=True)
    assert ask(preempted.replace("Requeue=1", "Requeue=0")).requeueable is False  # type: ignore[union-attr]
    # Left from a suspension long ago (SLURM never clears it): not this failure's cause.
    assert ask(preempted, now + datetime.timedelta(hours=1)) is None


def test_preemption_of_an_array_task_reads_its_own_record_only():
    # `scontrol show job <array id>` shows the task that has that id, then every other task.
    mine = "JobId=480 ArrayJobId=480 ArrayTaskId=1 Requeue=1 PreemptTime=None"
    other = "JobId=481 ArrayJobId=480 ArrayTaskId=0 Requeue=1 PreemptTime=2026-11-25T06:46:46"
    now = datetime.datetime(2026, 11, 25, 6, 47)
    text = f"{mine}\n\n{other}\n"
    assert slurm_end.preemption("480", scontrol=lambda _: text, now=now) is None
    env = {"SLURM_JOB_ID": "480", "SLURM_ARRAY_JOB_ID": "480", "SLURM_ARRAY_TASK_ID": "1"}
    assert slurm_job.own_job_id(env) == "480_1"
    assert slurm_job.own_job_id({"SLURM_JOB_ID": "7"}) == "7"
    assert slurm_job.own_job_id({}) is None
