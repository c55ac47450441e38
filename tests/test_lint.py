"""The code stays as the project asks: ruff clean and formatted, mypy strict on the package, and
the two sides of a launch (slurmrun/launcher, slurmrun/node) importing nothing of each other."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "slurmrun"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,  # the tests read the exit status and show the output
    )


def test_ruff_finds_nothing() -> None:
    result = _run("ruff", "check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_code_is_formatted_by_ruff() -> None:
    result = _run("ruff", "format", "--no-cache", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_passes_on_the_package() -> None:
    result = _run("mypy", "--no-incremental")  # [tool.mypy] in pyproject.toml: strict, slurmrun
    assert result.returncode == 0, result.stdout + result.stderr


def _imported_modules(path: Path) -> set[str]:
    """Every slurmrun module that `path` imports, at the top or inside functions."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.startswith("slurmrun")}


@pytest.mark.parametrize(
    ("side", "other"),
    [("launcher", "node"), ("node", "launcher"), ("batch", "node"), ("cli", "node")],
)
def test_one_side_of_a_launch_imports_nothing_of_the_other(side: str, other: str) -> None:
    """They meet only on the ground floor (protocol, transport, ...): the wire is the contract."""
    crossing = {
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((PACKAGE / side).rglob("*.py"))
        for name in _imported_modules(path)
        if name == f"slurmrun.{other}" or name.startswith(f"slurmrun.{other}.")
    }
    assert not crossing, sorted(crossing)


def test_the_ground_floor_imports_neither_side() -> None:
    """Modules directly in slurmrun/ (but the package's face and entry point) and the packages
    beside the sides (SLURM's facts in slurmrun/slurm/, the stacks in slurmrun/stacks/, ...)
    stand below both."""
    above = {PACKAGE / "__init__.py", PACKAGE / "__main__.py"}
    sides = {"launcher", "node", "batch", "cli"}
    beside = [d for d in PACKAGE.iterdir() if d.is_dir() and d.name not in sides]
    floor = [*PACKAGE.glob("*.py"), *(path for d in beside for path in d.rglob("*.py"))]
    assert PACKAGE / "stacks" / "report.py" in floor
    crossing = {
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted(floor)
        if path not in above
        for name in _imported_modules(path)
        if name.split(".")[1:2] in (["launcher"], ["node"], ["batch"], ["cli"])
    }
    assert not crossing, sorted(crossing)


def test_no_two_modules_share_a_name() -> None:
    """A module's name says where it is: two ``run.py`` (the launcher's run, the command's) or
    two ``submit.py`` had a reader open the wrong one (``__init__.py`` aside)."""
    by_name: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "__init__.py":
            by_name.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not {name: paths for name, paths in by_name.items() if len(paths) > 1}


def test_the_launcher_package_names_only_modules_it_has() -> None:
    """launcher/__init__.py maps its modules for a reader: each `name` it cites exists."""
    import re

    import slurmrun.launcher

    doc = slurmrun.launcher.__doc__ or ""
    cited = set(re.findall(r"`([a-z_]+)`", doc)) - {"launch"}
    here = PACKAGE / "launcher"
    missing = {n for n in cited if not (here / f"{n}.py").exists() and not (here / n).is_dir()}
    assert cited and not missing, sorted(missing)


def test_a_run_takes_one_object_per_concern() -> None:
    """The pool, the call, its output and what watches it: not 18 keywords."""
    import dataclasses

    from slurmrun.launcher.run import Run

    assert [f.name for f in dataclasses.fields(Run)] == ["pool", "call", "output", "watching", "id"]
