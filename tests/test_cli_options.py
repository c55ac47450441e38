"""The launcher options on the real command line: flags, values, and argparse-style errors.

Each command is ``python -m slurmrun --dry-run ...`` (nothing starts) but one, which runs a
script to see a flag reach its workers with the script's own arguments intact.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

import slurmrun
from slurmrun.cli.command import parse_launcher
from slurmrun.cli.values import option_specs
from tests.test_cli import _slurmrun as run_slurmrun

REPO = Path(__file__).resolve().parents[1]
USAGE = "usage: slurmrun [OPTIONS] SCRIPT [ARGS...]"


def _slurmrun(args: list[str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return run_slurmrun(args, cwd, timeout=timeout, env={"COLUMNS": "80"})


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "tr.py"
    path.write_text("raise AssertionError('a dry run runs nothing')\n")
    return path


def test_every_boolean_option_is_an_on_and_off_flag_before_the_scripts_own_args(
    script: Path,
) -> None:
    flags = [spec for spec in option_specs().values() if spec.flag]
    assert {spec.name for spec in flags} == {"flight_recorder", "learn_preloads", "stragglers"}
    for spec in flags:
        for flag, value in ((spec.option, True), (spec.off, False)):
            # A script argument after a flag stays the script's, the same flag included.
            cmd = ["--dry-run", flag, str(script), flag, "True"]
            cp = _slurmrun(cmd, script.parent)
            assert cp.returncode == 0, cp.stderr
            assert f"{script} {flag} True (script mode" in cp.stdout
            assert getattr(parse_launcher([flag]), spec.name) is value
    # The learned preloads' switch reaches the agents (shown with values for an ssh host).
    cp = _slurmrun(
        ["--dry-run", "--hostnames", "192.0.2.9", "--no-learn-preloads", "tr.py"], script.parent
    )
    assert "SLURMRUN_LEARN_PRELOADS=0" in cp.stdout, cp.stderr


def test_a_boolean_word_after_a_flag_is_refused_with_the_flags_to_use(script: Path) -> None:
    cp = _slurmrun(["--dry-run", "--flight-recorder", "True", str(script)], script.parent)
    assert cp.returncode == 2
    assert cp.stderr.startswith(USAGE)
    assert cp.stderr.splitlines()[-1] == (
        "slurmrun: error: argument --flight-recorder: takes no value (got 'True', which would"
        " be the script): --flight-recorder turns it on, --no-flight-recorder turns it off"
        " (e.g. slurmrun --flight-recorder train.py)"
    )
    cp = _slurmrun(["--dry-run", "--learn-preloads=False", str(script)], script.parent)
    assert (cp.returncode, cp.stderr.splitlines()[-1]) == (
        2,
        "slurmrun: error: argument --learn-preloads: takes no value (got 'False'):"
        " --learn-preloads turns it on, --no-learn-preloads turns it off",
    )


def test_the_flight_recorder_flag_reaches_every_worker_of_a_real_run(tmp_path: Path) -> None:
    (tmp_path / "fr.py").write_text(
        "import json, os, sys\n"
        "print(json.dumps([sys.argv[1:], os.environ.get('TORCH_FR_BUFFER_SIZE')]))\n"
    )
    cp = _slurmrun(
        ["--workers-per-host", "1", "--flight-recorder", "fr.py", "--flight-recorder"],
        tmp_path,
        timeout=180,
    )
    assert cp.returncode == 0, cp.stderr
    line = cp.stdout.strip().splitlines()[-1]
    assert line.startswith("[localhost:0] "), cp.stdout
    argv, buffer = json.loads(line.removeprefix("[localhost:0] "))
    assert argv == ["--flight-recorder"]
    assert buffer is not None and int(buffer) > 0


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (
            ["--workers-per-host", "abc"],
            "argument --workers-per-host: invalid value 'abc': give auto, slurm, a number of"
            " workers for every host, or one number per host (e.g. --workers-per-host 2, or"
            " --workers-per-host 4 2 on two hosts)",
        ),
        (
            ["--hosts", "x"],
            "argument --hosts: invalid value 'x': give a number of hosts (e.g. --hosts 4)",
        ),
        (
            ["--stall-timeout", "soon"],
            "argument --stall-timeout: invalid value 'soon': give a number of seconds"
            " (e.g. --stall-timeout 300)",
        ),
        (
            ["--backend", "fast"],
            "argument --backend: invalid value 'fast': give auto, nccl, gloo, mpi, ucc, or None"
            " (no process group) (e.g. --backend gloo)",
        ),
        (
            ["--worker-per-host", "2"],
            "unrecognized option --worker-per-host: did you mean --workers-per-host?"
            " (--help lists the options)",
        ),
        (
            ["--workers-per-host", "2", "3"],
            "workers_per_host has 2 counts (2 3) but hostnames names 1 host (localhost): give"
            " one count per host, or one count for every host (workers_per_host=2; on the"
            " command line --workers-per-host 2)",
        ),
    ],
)
def test_a_bad_option_is_one_argparse_style_line_with_what_to_give(
    script: Path, args: list[str], error: str
) -> None:
    cp = _slurmrun(["--dry-run", "--hostnames", "localhost", *args, str(script)], script.parent)
    assert cp.returncode == 2
    assert cp.stderr.startswith(USAGE)
    assert cp.stderr.splitlines()[-1] == f"slurmrun: error: {error}"
    assert "│" not in cp.stderr and "typing." not in cp.stderr and "``" not in cp.stderr


def test_more_counts_than_the_hosts_found_says_what_to_give(script: Path) -> None:
    cp = _slurmrun(["--dry-run", "--workers-per-host", "2", "3", str(script)], script.parent)
    assert (cp.returncode, cp.stderr.splitlines()[-1]) == (
        2,
        "slurmrun: error: workers_per_host has 2 counts (2 3) but 1 host was found (localhost):"
        " give one count per host, or one count for every host (workers_per_host=2; on the"
        " command line --workers-per-host 2)",
    )


def test_a_bad_option_of_submit_is_the_same_style(script: Path) -> None:
    cp = _slurmrun(["submit", "--dry-run", "--timeout", "x", str(script)], script.parent)
    assert cp.returncode == 2
    assert cp.stderr.splitlines()[-1] == (
        "slurmrun submit: error: argument --timeout: invalid value 'x': give a number of"
        " seconds (e.g. --timeout 60)"
    )


def test_every_option_in_the_help_has_a_metavar_or_is_a_flag(script: Path) -> None:
    text = _slurmrun(["--help"], script.parent).stdout
    assert not re.search(r"--[a-z-]+ VALUE", text)
    assert "  --flight-recorder, --no-flight-recorder\n" in text
    assert "  --learn-preloads, --no-learn-preloads\n" in text
    for line in ("  --hosts N ", "  --stall-timeout SECONDS", "  --timeout SECONDS "):
        assert line in text
    assert parse_launcher([]) == slurmrun.Launcher(backend=None)
