"""A misspelt option of `launch`, `Launcher` or `submit` names the call and the closest option."""

from __future__ import annotations

from typing import Any

import pytest

import slurmrun
from slurmrun.errors import OptionsTypeError


def _never() -> None:
    raise AssertionError("must not run")


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda **kw: slurmrun.launch(_never, **kw), "launch"),
        (slurmrun.Launcher, "Launcher"),
    ],
)
def test_a_misspelt_launch_option_names_the_call_and_suggests_the_option(
    call: Any, name: str
) -> None:
    with pytest.raises(OptionsTypeError) as info:
        call(worker_per_host=2)
    message = str(info.value)
    assert message.startswith(f"{name}() got an unexpected keyword argument 'worker_per_host'")
    assert "did you mean workers_per_host?" in message
    assert "Options" not in message
    with pytest.raises(OptionsTypeError, match=r"'colour'.*options are: hostnames, "):
        call(colour="red")  # nothing close: the options are listed


def test_launch_refuses_keep_workers_and_says_where_it_belongs() -> None:
    with pytest.raises(OptionsTypeError, match=r"keep_workers.*Launcher\(keep_workers=True\)"):
        slurmrun.launch(_never, keep_workers=True)  # type: ignore[call-arg]


def test_a_misspelt_submit_keyword_suggests_the_job_field_or_the_launcher(tmp_path: Any) -> None:
    from slurmrun.batch import submit

    with pytest.raises(OptionsTypeError) as info:
        submit(_never, folder=tmp_path, dry_run=True, node=2)  # type: ignore[call-overload]
    assert str(info.value).startswith("submit() got an unexpected keyword argument 'node'")
    assert "did you mean nodes?" in str(info.value)
    with pytest.raises(OptionsTypeError, match=r"launcher=slurmrun.Launcher\(workers_per_host="):
        submit(_never, folder=tmp_path, dry_run=True, workers_per_host=2)  # type: ignore[call-overload]
    assert not list(tmp_path.iterdir())  # refused before anything was written
