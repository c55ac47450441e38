"""``slurmrun --help``, ``--version`` and the dry run's script line, from the real command.

The help at 80 columns is a golden file (UPDATE_GOLDEN=1 rewrites it; check the diff).
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

from slurmrun.cli.command import launcher_options

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"
UPDATE = bool(os.environ.get("UPDATE_GOLDEN"))


def _run(args: list[str], cwd: Path = REPO, columns: int = 80) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env |= {"PYTHONPATH": str(REPO), "COLUMNS": str(columns), "SLURMRUN_LOG_DIR": ""}
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _slurmrun(args: list[str], cwd: Path = REPO, columns: int = 80) -> str:
    out = _run(["-m", "slurmrun", *args], cwd, columns)
    assert (out.returncode, out.stderr) == (0, ""), out
    return out.stdout


def test_help_at_80_columns_matches_golden_file() -> None:
    text = _slurmrun(["--help"])
    path = GOLDEN / "cli_help_80.txt"
    if UPDATE:
        path.write_text(text)
    assert text == path.read_text()
    assert _slurmrun(["-h"]) == text
    assert _slurmrun(["--dry-run", "--help"]) == text  # help, not a dry run
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80
    usage = lines[: lines.index("")]
    assert [line.split("slurmrun ")[1].split()[0] for line in usage] == [
        "[OPTIONS]", "[OPTIONS]", "--dry-run", "--map", "info", "submit", "status", "logs",
        "cancel", "jobs", "reserve", "release", "stacks",
    ]  # fmt: skip
    options = {line.split()[0].rstrip(",") for line in lines if line.startswith("  -")}
    own = {"-h", "--version", "--dry-run", "--map", "--workers-per-item", "--retries"}
    assert options == {*own, "--item-timeout", *launcher_options()}
    assert "`" not in text  # reST made plain: ``"auto"`` is auto, `default_env_vars` an option
    assert "--default-env-vars, among which NAME=value" in " ".join(text.split())


def test_help_wraps_at_the_terminal_width() -> None:
    wide = _slurmrun(["--help"], columns=100).splitlines()
    assert 80 < max(map(len, wide)) <= 100
    assert len(wide) < len(_slurmrun(["--help"]).splitlines())


def test_version_is_the_installed_metadata_and_slurmrun_version() -> None:
    expected = importlib.metadata.version("slurmrun")
    assert _slurmrun(["--version"]) == f"slurmrun {expected}\n"
    # __version__ is read on first use: `import slurmrun` does not import importlib.metadata.
    code = (
        "import sys; before = set(sys.modules); import slurmrun; "
        "print('importlib.metadata' in set(sys.modules) - before, slurmrun.__version__)"
    )
    out = _run(["-c", code])
    assert out.stdout == f"False {expected}\n", out.stderr


def test_dry_run_shows_the_script_and_its_arguments(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise AssertionError('must not run')\n")
    out = _slurmrun(["--dry-run", "--workers-per-host", "2", "train.py", "--epochs", "2"], tmp_path)
    run_line = f"{script} --epochs 2 (script mode: as python would, sys.argv set)"
    assert f"\n  workers run:      {run_line}\n" in out
    out = _slurmrun(["--dry-run", "-m", "json.tool", "--indent", "2", "a b"], tmp_path)
    run_line = "-m json.tool --indent 2 'a b' (module mode: as python -m would, sys.argv set)"
    assert f"\n  workers run:      {run_line}\n" in out
