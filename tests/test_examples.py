"""Every localhost example in examples/ runs as a reader runs it, and does what it says.

The SLURM ones (sbatch_job.sh, submit_from_login.py) run on the test cluster:
tests/slurm/test_examples_slurm.py.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tests.test_docs import run

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example(tmp_path: Path, name: str, *args: str) -> str:
    cp = run([sys.executable, str(EXAMPLES / name), *args], tmp_path, 240)
    assert cp.returncode == 0, f"examples/{name} failed:\n{cp.stdout}"
    return cp.stdout


def test_quickstart_fits_the_line_on_two_workers(tmp_path):
    out = example(tmp_path, "quickstart.py")
    fits = re.findall(r"rank (\d)/2: loss [\d.]+, y = ([\d.]+) x \+ ([\d.]+)", out)
    assert [rank for rank, _, _ in fits] == ["0", "1"], out
    assert all(abs(float(w) - 3) < 0.1 and abs(float(b) - 1) < 0.1 for _, w, b in fits), out


def test_progress_bar_returns_every_rank(tmp_path):
    out = example(tmp_path, "progress_bar.py")
    assert "result: [0, 1]" in out
    assert "halfway: checkpoint saved" in out


def test_train_ddp_trains_on_many_and_tests_on_one(tmp_path):
    out = example(tmp_path, "train_ddp.py")
    assert "trained on 2 workers" in out
    accuracy = float(re.search(r"test accuracy: ([\d.]+)", out).group(1))
    assert accuracy > 0.9, out


def test_cli_tyro_takes_launcher_options_from_the_command_line(tmp_path):
    out = example(tmp_path, "cli_tyro.py", "--workers-per-host", "3", "--backend", "gloo")
    assert sorted(re.findall(r"hello from rank (\d) of 3", out)) == ["0", "1", "2"], out
    help_text = example(tmp_path, "cli_tyro.py", "--help")
    assert "--heartbeat-timeout" in help_text
