"""slurmrun's SLURM parsers against what SLURM 22.05, 24.11 and 26.05 really print.

The golden files (tests/golden/slurm/<version>/, README there) were captured on live clusters of
each version. Every parser reads every version's output the same way; a job's command line
(``Command=``: 22.05 prints a batch script's arguments there) and submit line (``SubmitLine=``,
26.05) hold words that look like fields (``NumTasks=5 Nodes=<node> GRES=gpu:8``, and a line of a
wrapped script indented like one), and none of them is read.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
from pathlib import Path

import pytest

from slurmrun.slurm import queue
from slurmrun.slurm.job_end import Preemption, job_end, preemption, requeued_when_batch_ends
from slurmrun.slurm.queue import parse_squeue
from slurmrun.slurm.scontrol import job_tasks_per_node, parse_node_states, parse_scontrol_gpus
from slurmrun.slurm.scontrol import parse_scontrol_tasks as tasks_of

GOLDEN = Path(__file__).parent / "golden" / "slurm"
# Each cluster's two first nodes.
NODES = {"22.05": ("node1", "node2"), "24.11": ("sv1", "sv2"), "26.05": ("sv1", "sv2")}
VERSIONS = sorted(NODES)
# The versions that print `PreemptType = (null)` for a cluster without preemption.
NULL_PREEMPT_TYPE = ["24.11", "26.05"]


def golden(version: str, name: str) -> str:
    return (GOLDEN / version / name).read_text()


def test_every_captured_version_is_tested_and_named_in_the_docs():
    assert sorted(p.name for p in GOLDEN.iterdir() if p.is_dir()) == VERSIONS
    docs = (Path(__file__).parents[1] / "docs" / "slurm.md").read_text()
    assert f"SLURM versions tested: {', '.join(VERSIONS)}." in docs


@pytest.mark.parametrize("version", VERSIONS)
def test_a_jobs_tasks_are_read_from_its_fields_never_from_its_command_or_submit_line(version):
    # job_cpu: sbatch -N2 -n3 job.sh NumTasks=5 ...; job_wrap: -N1 -n1 --wrap with a line
    # "   NumTasks=7 srun true" and a line "NumNodes=9" (26.05 prints both in SubmitLine).
    assert tasks_of(golden(version, "job_cpu.txt")) == (2, 3, 1, 0)
    assert tasks_of(golden(version, "job_wrap.txt")) == (1, 1, 1, 0)
    assert job_tasks_per_node(golden(version, "job_cpu.txt"), [2, 1]) == [2, 1]
    assert tasks_of(golden(version, "job_gpu.txt")) == (2, 2, 1, 1)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_jobs_gpus_are_read_from_its_node_lines_never_from_its_command_or_submit_line(version):
    n1, n2 = NODES[version]
    assert parse_scontrol_gpus(golden(version, "job_cpu.txt")) == {n1: 0, n2: 0}
    assert parse_scontrol_gpus(golden(version, "job_wrap.txt")) == {n1: 0}
    assert parse_scontrol_gpus(golden(version, "job_gpu.txt")) == {n1: 2, n2: 2}
    assert parse_scontrol_gpus(golden(version, "job_gres.txt")) == {n1: 1}
    assert parse_scontrol_gpus(golden(version, "job_het.txt")) == {n1: 0, n2: 0}
    assert parse_scontrol_gpus(golden(version, "job_array_pending.txt")) == {}


@pytest.mark.parametrize("version", VERSIONS)
def test_records_hold_each_job_of_an_array_or_heterogeneous_job(version):
    from slurmrun.slurm.fields import first_record, parse_records

    array = parse_records(golden(version, "job_array.txt"))
    assert sorted(r.fields["ArrayTaskId"] for r in array) == ["0", "1", "2"]
    assert {r.fields["ArrayJobId"] for r in array} == {array[0].fields["JobId"]}
    het = parse_records(golden(version, "job_het.txt"))
    assert [r.fields["HetJobOffset"] for r in het] == ["0", "1"]
    assert [r.fields["NumTasks"] for r in het] == ["1", "2"]
    pending = first_record(golden(version, "job_array_pending.txt"))
    assert (pending.fields["JobState"], pending.fields["ArrayTaskId"]) == ("PENDING", "0-2")
    assert pending.node_lines == []


@pytest.mark.parametrize("version", VERSIONS)
def test_free_text_fields_are_whole_and_command_lines_hold_their_own_lines(version):
    from slurmrun.slurm.fields import first_record

    n1, _ = NODES[version]
    cpu = first_record(golden(version, "job_cpu.txt")).fields
    assert cpu["JobName"] == "cpu job"
    assert cpu["Partition"] == "debug" and cpu["BatchHost"] == n1
    assert cpu["Command"].endswith(
        "/job.sh" + (f" NumTasks=5 Nodes={n1} GRES=gpu:8" * (version == "22.05"))
    )
    wrap = first_record(golden(version, "job_wrap.txt")).fields
    assert wrap["Comment"] == "two words"
    assert wrap["WorkDir"].startswith("/tmp/")
    assert "GRES" not in cpu and "srun" not in wrap
    if version == "26.05":
        assert cpu["SubmitLine"].endswith(f"job.sh NumTasks=5 Nodes={n1} GRES=gpu:8")
        assert wrap["SubmitLine"].endswith("--wrap=sleep 90\nNumTasks=7 srun true\nNumNodes=9")
    else:
        assert "SubmitLine" not in cpu


@pytest.mark.parametrize("version", VERSIONS)
def test_a_nodes_state_and_the_config_are_read_by_fields(version):
    from slurmrun.slurm.fields import config_fields, parse_records

    n1, _ = NODES[version]
    (node,) = parse_node_states(golden(version, "node.txt")).values()
    assert (node.name, node.words, node.usable, node.reason) == (n1, ("IDLE",), True, "")
    (debug, urgent) = parse_records(golden(version, "partition.txt"))
    assert (debug.fields["PartitionName"], debug.fields["Nodes"], debug.node_lines) == (
        "debug",
        f"{n1[:-1]}[1-{3 if version == '22.05' else 2}]",
        [],
    )
    assert urgent.fields["PreemptMode"] == "OFF"
    config = config_fields(golden(version, "config.txt"))
    assert config["SLURM_VERSION"] == golden(version, "version.txt").split()[-1]
    assert config["SLURM_VERSION"].startswith(f"{version}.")
    assert config["PreemptType"] == "preempt/partition_prio"
    assert config["KillWait"] == "5 sec"


def _scontrol(version: str, config: str = "config.txt", partition: str = "partition.txt"):
    files = {"job": "job_cpu.txt", "partition": partition, "config": config}
    return lambda args: golden(version, files[args[1]])


@pytest.mark.parametrize("version", VERSIONS)
def test_job_end_reads_each_versions_job_partition_and_config(version):
    end = job_end("1", _scontrol(version))
    assert end is not None
    assert (end.partition, end.kill_wait, end.preempt_mode) == ("debug", 5, "REQUEUE")
    assert end.preempt_type == "preempt/partition_prio" and end.preemptible


# The releases whose controller requeues a preempted job itself when its batch script ends
# in the grace (slurmctld's GRACE_PREEMPT, 24.05+): there slurmrun must not requeue it too.
REQUEUES_AT_BATCH_END = {"22.05": False, "24.11": True, "26.05": True}


@pytest.mark.parametrize("version", VERSIONS)
def test_slurm_requeues_a_preempted_job_whose_batch_script_ends_from_24_05_on(version):
    now = datetime.datetime(2026, 11, 27, 16, 10)
    job = golden(version, "job_cpu.txt").replace("PreemptTime=None", f"PreemptTime={now:%FT%T}")
    preempted = preemption("1", scontrol=lambda _: job, now=now)
    assert preempted == Preemption("1", f"{now:%FT%T}", requeueable=True, partition="debug")
    ask = _scontrol(version)
    assert requeued_when_batch_ends(preempted, ask) is REQUEUES_AT_BATCH_END[version]
    # SLURM requeues it only with PreemptMode=REQUEUE (the partition's, else the cluster's)...
    cancel = golden(version, "partition.txt").replace("PreemptMode=REQUEUE", "PreemptMode=CANCEL")
    assert not requeued_when_batch_ends(
        preempted, lambda a: cancel if a[1] == "partition" else ask(a)
    )
    # ...a requeueable job only; and where scontrol does not answer, slurmrun requeues it.
    assert not requeued_when_batch_ends(dataclasses.replace(preempted, requeueable=False), ask)
    assert not requeued_when_batch_ends(preempted, lambda _: None)


@pytest.mark.parametrize("version", NULL_PREEMPT_TYPE)
def test_a_null_preempt_type_is_no_preemption_even_with_a_partitions_preempt_mode(version):
    end = job_end(
        "1", _scontrol(version, "config_no_preemption.txt", "partition_no_preemption.txt")
    )
    assert end is not None
    assert (end.preempt_type, end.preempt_mode) == ("(null)", "REQUEUE")
    assert not end.preemptible


@pytest.mark.parametrize("version", VERSIONS)
def test_squeue_names_a_pending_arrays_elements_only_with_array(version):
    array = golden(version, "array_pending_id.txt").strip()
    elements = {f"{array}_{i}": "PENDING" for i in range(3)}
    assert parse_squeue(golden(version, "squeue_array_pending_array.txt")) == elements
    # Without --array squeue folds them into one line ("53_[0-2]|PENDING"): no element there.
    assert parse_squeue(golden(version, "squeue_array_pending.txt")) == {
        f"{array}_[0-2]": "PENDING"
    }


@pytest.mark.skipif(sys.platform == "win32", reason="uses a shell script as a fake sacct")
@pytest.mark.parametrize("version", VERSIONS)
def test_sacct_without_accounting_is_asked_once(version, tmp_path, monkeypatch):
    said, _, status = golden(version, "sacct.txt").rpartition("rc=")
    calls = tmp_path / "calls"
    sacct = tmp_path / "sacct"
    sacct.write_text(
        f"#!/bin/sh\necho x >>'{calls}'\nprintf '%s' '{said}' >&2\nexit {status.strip()}\n"
    )
    sacct.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setitem(queue._SACCT, "usable", True)
    assert queue._sacct(["1"]) == {}
    assert queue._sacct(["2"]) == {}
    assert calls.read_text() == "x\n"


def test_a_command_line_of_several_lines_holds_every_line_until_workdir():
    # Hand-made from job_wrap.txt's layout: a user's bash -c script whose lines look like a
    # record's start, a per-node line and fields; none of them is the job's.
    from slurmrun.slurm.fields import parse_records

    text = (
        "JobId=7 JobName=x\n   JobState=PENDING Reason=None Dependency=(null)\n"
        "   NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:*\n"
        "   Command=bash\n   SubmitLine=salloc bash -c '\nJobId=9 JobName=y\n"
        "     Nodes=node1 CPU_IDs=0 Mem=0 GRES=gpu:8\n   NumTasks=3'\n"
        "   WorkDir=/home/u\n   Comment=a\n   b\n"
    )
    (record,) = parse_records(text)
    assert record.fields["NumTasks"] == "1" and record.node_lines == []
    assert record.fields["SubmitLine"].splitlines()[1:] == [
        "JobId=9 JobName=y",
        "Nodes=node1 CPU_IDs=0 Mem=0 GRES=gpu:8",
        "NumTasks=3'",
    ]
    assert (record.fields["WorkDir"], record.fields["Comment"]) == ("/home/u", "a\nb")


def test_a_nodes_reason_of_several_lines_is_read_whole():
    text = (
        "NodeName=n1 Arch=x86_64\n   State=IDLE+DRAIN ThreadsPerCore=1\n"
        "   Reason=gpu 3 fell off State=IDLE [root@2026-01-02T03:04:05]\n"
        "          then came back\n   Comment=x\n"
    )
    (node,) = parse_node_states(text).values()
    assert node.words == ("IDLE", "DRAIN") and not node.usable
    assert node.reason == "gpu 3 fell off State=IDLE; then came back"
