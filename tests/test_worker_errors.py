"""A failing rank's error reaches the launcher whole enough, and points at a file that says why.

Issue 24: an error message over the frame header's limit hung the launch; a quiet rank's note
named a log file that was never written; the remote traceback began with slurmrun's frames.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import slurmrun
from slurmrun.errors import RemoteTraceback

# What the launcher shows of one text: the worker clips each one (`protocol.clip`).
SHOWN_LIMIT = 100_000
HUGE = 3_000_000


def raise_huge_ascii() -> None:
    raise ValueError("x" * HUGE)


def raise_huge_non_ascii() -> None:
    raise ValueError("é" * 500_000)  # 6 bytes each as a JSON escape: 3 MB of header


def raise_quietly() -> None:
    if os.environ["RANK"] == "1":
        raise KeyError("quiet rank's missing key")


def _log_text(exc: BaseException) -> str:
    # The note that names the rank's log file; a run that fails while another rank is still
    # running also gets a note of where that rank was (the stacks dump): under load, it can.
    (note,) = [n for n in exc.__notes__ if "its log: " in n]
    log_file = note.split("its log: ")[1]
    return Path(log_file).read_text(encoding="utf-8")


@pytest.mark.timeout(60)  # it hung forever
@pytest.mark.parametrize(
    ("func", "char", "count"),
    [(raise_huge_ascii, "x", HUGE), (raise_huge_non_ascii, "é", 500_000)],
    ids=["ascii", "non-ascii"],
)
def test_huge_error_message_raises_promptly_clipped_and_whole_in_the_log(func, char, count):
    with pytest.raises(ValueError) as info:
        slurmrun.launch(func, hostnames=["localhost"], workers_per_host=1, backend=None)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert len(cause.text) < SHOWN_LIMIT
    assert "characters cut: the whole text is in the worker's log file]" in cause.text
    assert "Traceback (most recent call last)" in cause.text
    assert str(info.value) == char * count  # the exception itself is rebuilt whole
    logged = _log_text(info.value)
    assert char * count in logged
    header, traceback = logged.split("\n", 1)  # the run's header line, then what it wrote
    assert header.startswith("=== slurmrun run 1, ")
    assert traceback.startswith("Traceback (most recent call last)")


def test_quiet_failing_rank_note_names_an_existing_file_holding_its_traceback():
    with pytest.raises(KeyError) as info:
        slurmrun.launch(raise_quietly, hostnames=["localhost"], workers_per_host=2, backend=None)
    logged = _log_text(info.value)
    assert "Traceback (most recent call last)" in logged
    assert 'KeyError: "quiet rank\'s missing key"' in logged
    assert 'raise KeyError("quiet rank\'s missing key")' in logged


SCRIPT = """\
    import slurmrun


    def helper(table):
        return table["missing"]  # the raising line


    def fails():
        def nested():
            return helper({})  # the nested function's line

        value = 1
        return nested()  # the calling line


    if __name__ == "__main__":
        slurmrun.launch(fails, hostnames=["localhost"], workers_per_host=1, backend=None)
"""


@pytest.mark.timeout(120)
def test_function_of_a_main_script_has_its_frame_first_with_path_and_line(tmp_path):
    # Its functions are pickled by value: cloudpickle 3 renames their file "<dynamic-code>";
    # the worker must still name the script, its lines and their source (nested ones too).
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    root = Path(slurmrun.__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "script.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 1
    remote = done.stderr.split('"""')[1]  # RemoteTraceback's text, between its quotes
    carets = re.compile(r"\s*[~^]+\s*")  # under the failing part of a line (Python 3.11+)
    lines = [line for line in remote.strip().splitlines() if not carets.fullmatch(line)]
    assert lines == [
        "Traceback (most recent call last):",
        f'  File "{script}", line 13, in fails',
        "    return nested()  # the calling line",
        f'  File "{script}", line 10, in nested',
        "    return helper({})  # the nested function's line",
        f'  File "{script}", line 5, in helper',
        '    return table["missing"]  # the raising line',
        "KeyError: 'missing'",
    ], remote


def report_rank() -> int:
    rank = int(os.environ["RANK"])
    print(f"line from rank {rank}", flush=True)
    return rank


def test_repeated_host_gives_every_rank_its_own_file_and_prefix(capfd, tmp_path, monkeypatch):
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path))
    result = slurmrun.launch(
        report_rank, hostnames=["localhost", "localhost"], workers_per_host=1, backend=None
    )
    assert result.return_values == [[0], [1]]
    (run_dir,) = tmp_path.glob("20*")
    for name, rank in (("localhost.0.log", 0), ("localhost#1.0.log", 1)):
        header, line = (run_dir / name).read_text().splitlines()
        assert header.startswith("=== slurmrun run 1, ") and line == f"line from rank {rank}"
    out = capfd.readouterr().out
    assert "[localhost:0] line from rank 0" in out
    assert "rank 1" not in out  # rank 0 alone is shown live, under a prefix of its own


@pytest.mark.skipif(shutil.which("ssh") is None, reason="agents on other hosts start over ssh")
def test_hostname_with_a_slash_gets_a_readable_log_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path))
    monkeypatch.setenv("SLURMRUN_LAUNCHER_ADDR", "127.0.0.1")  # no lookup of the bad name
    with pytest.raises(slurmrun.AgentFailedError, match="Could not resolve hostname") as info:
        slurmrun.launch(report_rank, hostnames=["rack/3"], workers_per_host=1, backend=None)
    (run_dir,) = tmp_path.glob("20*")
    assert info.value.log_file == str(run_dir / "rack%2F3.agent.log")
