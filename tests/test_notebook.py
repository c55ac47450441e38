"""A notebook with a warm launcher, executed by a real Jupyter kernel on localhost.

tests/notebook_driver.py runs the cells with nbclient and ipykernel; this checks what a
notebook user sees: rank 0's output and its progress bar in the cell's output, the same
agents for the next cell, and an interrupted kernel leaving no worker and a usable launcher.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

DRIVER = Path(__file__).resolve().parent / "notebook_driver.py"
REPO = Path(__file__).resolve().parents[1]
DRIVER_TIMEOUT = 900  # a bound for a loaded 2-core machine, not a speed claim


def rendered(text: str) -> list[str]:
    r"""The lines a notebook shows for a stream's text: ``\r`` rewrites its line (as Jupyter)."""
    return [line.rsplit("\r", 1)[-1] for line in text.split("\n")][:-1]


def check_notebook(summary: dict[str, Any], workers: int) -> None:
    """What every notebook run must show, on localhost and on the cluster."""
    cells = summary["cells"]
    assert [c["error"] for c in cells] == [None] * 4 + ["KeyboardInterrupt", None, None], cells
    run = cells[2]["stdout"]
    assert "\x1b" not in run, "terminal escapes in a notebook's output"
    assert run.count("\r") >= 3, f"the bar was not shown live: {run!r}"
    lines = rendered(run)
    assert len(lines) == 3, lines  # rank 0's line, the bar's last state, the cell's print
    assert re.fullmatch(rf"\[[^:]+:0\] hello from rank 0 of {workers}", lines[0]), lines
    assert re.fullmatch(r"\[[^:]+:0\] 100%\|#+\| 30/30 .*", lines[1]), lines
    assert lines[2] == f"ranks: {list(range(workers))}"
    assert cells[3]["stdout"] == cells[5]["stdout"], "the next cells did not reuse the agents"
    assert summary["workers_started"] == workers
    assert summary["interrupted_cell_returned"]
    assert summary["workers_alive_after_interrupt"] == []


def test_notebook_on_localhost(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(DRIVER), str(tmp_path), 'workers_per_host=2, backend="gloo"'],
        env=env,
        capture_output=True,
        text=True,
        timeout=DRIVER_TIMEOUT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    check_notebook(json.loads((tmp_path / "summary.json").read_text()), workers=2)
