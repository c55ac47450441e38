"""Chaos on localhost: warm runs with a random fault at a random moment (tests/chaos_driver.py).

Each fault (a 3 MB exception, SIGKILL, SIGSEGV, a child or daemon left behind, Ctrl-C, a
failing handler, a flood of silent connections) is followed by a clean run: no hang, no
process left, no result lost, no line lost or shown as another run's. The same driver runs
on the SLURM test cluster in tests/slurm/test_chaos_slurm.py.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

DRIVER = Path(__file__).parent / "chaos_driver.py"


def report_of(done: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """The driver's REPORT line as fields (empty when it printed none)."""
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    return dict(item.split("=", 1) for item in lines[0].split()[1:]) if lines else {}


@pytest.mark.timeout(120)
def test_chaos_on_localhost_leaves_no_hang_no_process_no_lost_result_or_byte():
    seed = random.randrange(1 << 30)
    done = subprocess.run(
        [sys.executable, str(DRIVER), "12", str(seed), "2"],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    report = report_of(done)
    said = f"seed {seed}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert done.returncode == 0 and report, said
    assert report["problems"] == "0", said
    assert (report["faults"], report["clean_ok"], report["left"]) == ("12", "12", "0"), said
