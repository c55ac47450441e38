"""extra_env_vars as torchrunx's newer form, a mapping of names to values."""

from __future__ import annotations

import os

import pytest

import slurmrun


def _seen(names: tuple[str, ...]) -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in names}


def test_a_mapping_sets_its_variables_for_every_worker(monkeypatch):
    monkeypatch.setenv("SLURMRUN_LOG_DIR", "")
    monkeypatch.setenv("HOME", "/home/from-launcher")
    result = slurmrun.launch(
        _seen,
        (("FROM_MAPPING", "WITH_COMMA", "HOME"),),
        hostnames=["localhost"],
        workers_per_host=2,
        backend=None,
        extra_env_vars={"FROM_MAPPING": "given", "WITH_COMMA": "a=b,c"},
    )
    assert (
        result.values()
        == [{"FROM_MAPPING": "given", "WITH_COMMA": "a=b,c", "HOME": "/home/from-launcher"}] * 2
    )


@pytest.mark.parametrize(
    ("mapping", "error", "match"),
    [
        ({"N": 1}, TypeError, "str values"),
        ({1: "v"}, TypeError, "str values"),
        ({"A,B": "v"}, ValueError, "not a valid environment variable name"),
        ({"": "v"}, ValueError, "not a valid environment variable name"),
    ],
)
def test_a_bad_mapping_is_refused_before_anything_starts(mapping, error, match):
    with pytest.raises(error, match=match):
        slurmrun.launch(int, hostnames=["localhost"], extra_env_vars=mapping)


def test_a_pattern_that_sets_a_value_is_refused_with_the_mapping_to_pass():
    # fnmatch would match no variable with it, and the user asked for a value.
    with pytest.raises(ValueError, match=r"pass extra_env_vars=\{'NCCL_DEBUG': 'INFO'\}"):
        slurmrun.launch(int, hostnames=["localhost"], extra_env_vars=("WANDB_*", "NCCL_DEBUG=INFO"))
    with pytest.raises(ValueError, match="default_env_vars: 'A=1' sets a value"):
        slurmrun.launch(int, hostnames=["localhost"], default_env_vars=("PATH", "A=1"))
