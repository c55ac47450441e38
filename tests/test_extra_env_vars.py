"""extra_env_vars as torchrunx's newer form, a mapping of names to values, and NAME=value words."""

from __future__ import annotations

import os

import pytest

import slurmrun
from slurmrun.environment import env_words


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


def test_name_equals_value_words_set_variables_and_the_others_pass_the_launchers(monkeypatch):
    monkeypatch.setenv("SLURMRUN_LOG_DIR", "")
    monkeypatch.setenv("MY_PASSED", "from launcher")
    monkeypatch.setenv("SET_HERE", "overridden")
    result = slurmrun.launch(
        _seen,
        (("SET_HERE", "WITH_EQUALS", "EMPTY", "MY_PASSED"),),
        hostnames=["localhost"],
        workers_per_host=1,
        backend=None,
        extra_env_vars=("SET_HERE=a b", "MY_*", "WITH_EQUALS=x=y,z", "EMPTY="),
    )
    assert result.values() == [
        {"SET_HERE": "a b", "WITH_EQUALS": "x=y,z", "EMPTY": "", "MY_PASSED": "from launcher"}
    ]
    assert env_words(("A=1", "B*", "C=")) == (["B*"], {"A": "1", "C": ""})
    assert env_words({"A": "1"}) == ([], {"A": "1"})


def test_a_bad_word_or_a_value_in_default_env_vars_is_refused():
    with pytest.raises(ValueError, match="'' is not a valid environment variable name"):
        slurmrun.launch(int, hostnames=["localhost"], extra_env_vars=("WANDB_*", "=INFO"))
    with pytest.raises(ValueError, match="default_env_vars: 'A=1' sets a value"):
        slurmrun.launch(int, hostnames=["localhost"], default_env_vars=("PATH", "A=1"))
