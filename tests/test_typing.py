"""The public API type-checks for users, and `import slurmrun` stays light."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


def test_import_slurmrun_does_not_import_torch():
    code = "import sys, slurmrun; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False"


def test_launcher_is_a_dataclass_with_the_launch_keywords():
    import dataclasses
    import inspect

    fields = {f.name for f in dataclasses.fields(slurmrun.Launcher)}
    params = set(inspect.signature(slurmrun.launch).parameters) - {
        "func",
        "func_args",
        "func_kwargs",
    }
    assert fields == params
