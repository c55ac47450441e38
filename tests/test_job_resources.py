"""`JobResources`: what a submitted job asks for, checked when made; `JobOptions` agrees."""

from __future__ import annotations

import dataclasses

import pytest

import slurmrun
from slurmrun.batch import JobResources
from slurmrun.batch.job_resources import JobOptions


def test_the_keywords_are_the_fields():
    """Each field is a keyword of `submit` and `submit_array`, of the same type."""
    fields = {f.name: f.type for f in dataclasses.fields(JobResources)}
    keywords = {k: getattr(v, "__forward_arg__", v) for k, v in JobOptions.__annotations__.items()}
    assert fields == keywords  # the annotations' text (postponed annotations)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"nodes": 0}, ValueError, "nodes must be a positive int, got 0"),
        ({"nodes": True}, ValueError, "nodes must be a positive int, got True"),
        ({"workers_per_node": 0}, ValueError, "workers_per_node must be a positive int"),
        ({"cpus_per_worker": "2"}, ValueError, "cpus_per_worker must be a positive int"),
        ({"time_min": 0}, ValueError, "time_min must be a positive int, got 0"),
        ({"gpus_per_node": -1}, ValueError, "gpus_per_node must be an int >= 0 or None"),
        ({"slurm_parameters": ["mem"]}, TypeError, "slurm_parameters must be a dict"),
        ({"requeue": "yes"}, TypeError, "requeue must be a bool or a Requeue"),
        ({"resources": 8}, TypeError, "resources must be a preset's name"),
    ],
)
def test_a_bad_field_is_refused_with_its_name(options, error, message):
    with pytest.raises(error, match=message):
        JobResources(**options)


def test_resolved_fills_the_defaults_and_keeps_what_was_given():
    job = JobResources(gpus_per_node=0, slurm_parameters={"mem": "8G"})
    assert job.resolved() == dataclasses.replace(job, nodes=1, cpus_per_worker=1)
    assert JobResources().requeue_policy == slurmrun.Requeue()
    assert JobResources(requeue=False).requeue_policy is None
    with pytest.raises(ValueError, match="not a named resource of any installed package"):
        JobResources(resources="no_such_preset_here").resolved()
