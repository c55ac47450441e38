"""Which ranks reach the terminal (``--ranks`` / `Launcher.show_ranks`), and a run's summary line.

Real two-worker launches on localhost through ``python -m slurmrun``: each rank prints a line;
the terminal shows the chosen ranks' lines and every worker's file has its own either way.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slurmrun import launch
from slurmrun.cli.command import parse_launcher, split_command
from slurmrun.errors import OptionsValueError
from slurmrun.launcher.checks import check_call
from slurmrun.launcher.options import Options

REPO = Path(__file__).resolve().parents[1]
LIMIT = 180  # seconds for one command on a loaded 2-core machine

TALK = "import os\nprint(f\"line of rank {os.environ['RANK']}\", flush=True)\n"
# A successful run's last line: world size, hosts, wall time, restarts, the log folder.
SUMMARY = re.compile(
    r"^slurmrun: 2 ranks on 1 host \(localhost\), \d+\.\d s, 0 restarts; logs: (\S+)$", re.M
)


def _slurmrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env["PYTHONPATH"] = str(REPO)
    env["SLURMRUN_LOG_DIR"] = str(cwd / "logs")
    (cwd / "talk.py").write_text(TALK)
    return subprocess.run(
        [sys.executable, "-m", "slurmrun", "--workers-per-host", "2", *args, "talk.py"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=LIMIT,
        check=False,
    )


def _talk() -> int:
    print(f"line of rank {os.environ['RANK']}", flush=True)
    return int(os.environ["RANK"])


def _shown(out: str) -> list[str]:
    return sorted(re.findall(r"line of rank \d", out))


@pytest.mark.parametrize(
    ("args", "shown"),
    [
        ([], ["line of rank 0"]),
        (["--ranks", "all"], ["line of rank 0", "line of rank 1"]),
        (["--ranks", "1"], ["line of rank 1"]),
    ],
    ids=["default", "all", "one"],
)
def test_ranks_chosen_reach_the_terminal_and_every_file_has_its_own(
    tmp_path: Path, args: list[str], shown: list[str]
) -> None:
    cp = _slurmrun(args, tmp_path)
    assert cp.returncode == 0, cp.stderr
    assert _shown(cp.stdout) == shown, cp.stdout
    files = sorted({f.resolve() for f in (tmp_path / "logs").glob("*/localhost.[01].log")})
    # Each file: the run's header line, then what its worker wrote.
    assert [f.read_text().splitlines()[1:] for f in files] == [
        ["line of rank 0"],
        ["line of rank 1"],
    ]


def test_a_successful_run_ends_with_one_summary_line_naming_the_log_folder(
    tmp_path: Path,
) -> None:
    cp = _slurmrun([], tmp_path)
    assert cp.returncode == 0, cp.stderr
    found = SUMMARY.findall(cp.stderr)
    assert len(found) == 1, cp.stderr
    assert cp.stderr.rstrip().splitlines()[-1].startswith("slurmrun: 2 ranks"), cp.stderr
    (folder,) = found
    assert folder.startswith("logs/")  # relative to the working directory, where it is
    assert (tmp_path / folder).parent == tmp_path / "logs"
    assert (tmp_path / folder / "localhost.1.log").is_file()


def test_the_launch_option_shows_the_ranks_chosen_and_own_handlers_get_no_summary(
    capfd: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path))
    assert launch(_talk, workers_per_host=2, show_ranks=[1]).values() == [0, 1]
    out, err = capfd.readouterr()
    assert _shown(out) == ["line of rank 1"], out
    assert len(SUMMARY.findall(err)) == 1, err
    # The user's own handlers: the terminal is theirs, the launcher adds no line to it.
    assert launch(_talk, workers_per_host=2, log_handlers=[]).values() == [0, 1]
    out, err = capfd.readouterr()
    assert _shown(out) == [], out
    assert "slurmrun:" not in err, err


def _fails_first(path: str) -> str:
    if os.environ["SLURMRUN_RESTART_COUNT"] == "0":
        raise RuntimeError("the first attempt fails")
    return "done"


def test_the_summary_counts_the_restarts(
    capfd: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path))
    assert launch(_fails_first, ("x",), workers_per_host=1, max_restarts=1).values() == ["done"]
    err = capfd.readouterr().err
    said = re.findall(
        r"^slurmrun: 1 rank on 1 host \(localhost\), \d+\.\d s, 1 restart; .*$", err, re.M
    )
    assert len(said) == 1, err
    assert said[0].endswith(f"; logs: {next(tmp_path.glob('20*'))}")  # outside the cwd: whole


def test_agents_slow_to_connect_are_announced_once(tmp_path: Path) -> None:
    # The agents start a second and a half late, as under a queued srun or a container.
    late = ["--agent-python", sys.executable, "--agent-prefix", "sh -c 'sleep 1.5; exec \"$@\"' sh"]
    cp = _slurmrun(late, tmp_path)
    assert cp.returncode == 0, cp.stderr
    line = "slurmrun: starting agents on 1 host (localhost): 0 of 1 connected, waiting up to 600 s"
    assert cp.stderr.count(line) == 1, cp.stderr
    assert _shown(cp.stdout) == ["line of rank 0"]


def test_ranks_on_the_command_line_read_as_the_option() -> None:
    def parse(*words: str) -> Options:
        return parse_launcher(split_command([*words, "x.py"]).launcher_args)

    assert parse().show_ranks == (0,)
    assert parse("--ranks", "all").show_ranks == "all"
    assert parse("--ranks", "0,3").show_ranks == (0, 3)
    assert parse("--ranks", "0", "3").show_ranks == (0, 3)
    assert parse("--show-ranks", "2").show_ranks == (2,)


@pytest.mark.parametrize("bad", ["some", (-1,), 3, (True,)])
def test_a_bad_show_ranks_is_refused_before_anything_starts(bad: object) -> None:
    with pytest.raises(OptionsValueError, match="show_ranks must be 'all' or a tuple"):
        check_call(Options(show_ranks=bad), print, (), {})  # type: ignore[arg-type]
