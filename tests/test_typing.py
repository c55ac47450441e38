"""The public API type-checks for users, and `import slurmrun` stays light."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import slurmrun

HERE = Path(__file__).parent


def test_public_api_infers_result_types_under_mypy_strict():
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", str(HERE / "typing" / "check_public_api.py")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_public_names_are_exported():
    assert set(slurmrun.__all__) >= {
        "launch",
        "Launcher",
        "LaunchResult",
        "slurm_allocation",
        "WorkerFailedError",
        "AgentFailedError",
    }


def test_every_public_name_imports_in_a_fresh_interpreter():
    """`slurmrun` imports its names on first use: each must resolve, also through `import *`."""
    code = (
        "import slurmrun\n"
        "import types\n"
        "for name in slurmrun.__all__:\n"
        "    obj = getattr(slurmrun, name)\n"
        "    assert not isinstance(obj, types.ModuleType), name\n"
        "namespace = {}\n"
        "exec('from slurmrun import *', namespace)\n"
        "assert set(slurmrun.__all__) <= set(namespace), set(slurmrun.__all__) - set(namespace)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("name", slurmrun.__all__)
def test_every_public_name_is_documented(name):
    obj = getattr(slurmrun, name)
    assert obj.__module__.startswith("slurmrun."), obj.__module__
    doc = inspect.getdoc(obj)
    assert doc and doc.strip(), f"slurmrun.{name} has no docstring"
    if inspect.isfunction(obj) and "Args:" in doc:  # launch's arguments are Launcher's fields
        args = doc.split("Args:", 1)[1]
        params = [p for p in inspect.signature(obj).parameters if p not in ("self", "cls")]
        missing = [p for p in params if f"{p}:" not in args and f"{p} (" not in args]
        assert not missing, f"slurmrun.{name}'s Args: section does not document {missing}"


def test_the_mypy_check_uses_every_public_name():
    """So that mypy sees each lazily imported name with its real type (TYPE_CHECKING imports)."""
    text = (HERE / "typing" / "check_public_api.py").read_text()
    unchecked = [name for name in slurmrun.__all__ if f"slurmrun.{name}" not in text]
    assert not unchecked, f"tests/typing/check_public_api.py never uses {unchecked}"


def test_import_slurmrun_does_not_import_torch():
    code = "import sys, slurmrun; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False"


def test_launcher_is_a_dataclass_with_the_launch_keywords():
    import dataclasses
    import typing

    from slurmrun.launcher import LaunchOptions

    # keep_workers is a warm launcher's (`with Launcher(...)`): launch() makes one run.
    fields = {f.name for f in dataclasses.fields(slurmrun.Launcher)} - {"keep_workers"}
    assert fields == set(LaunchOptions.__annotations__)
    params = inspect.signature(slurmrun.launch).parameters
    assert list(params) == ["func", "func_args", "func_kwargs", "options"]
    assert params["options"].kind is inspect.Parameter.VAR_KEYWORD
    # The same types, but tyro's Suppress markers (mypy checks `Launcher(**options)` too).
    hints = typing.get_type_hints(slurmrun.Launcher, include_extras=False)
    assert {name: hints[name] for name in fields} == typing.get_type_hints(LaunchOptions)
