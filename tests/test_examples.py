"""Every localhost example in examples/ runs as a reader runs it, and does what it says.

The SLURM ones (sbatch_job.sh, submit_from_login.py) run on the test cluster:
tests/slurm/test_examples_slurm.py.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from slurmrun.devices import usable_cpu_count
from tests.test_docs import run

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example(tmp_path: Path, name: str, *args: str) -> str:
    cp = run([sys.executable, str(EXAMPLES / name), *args], tmp_path, 240)
    assert cp.returncode == 0, f"examples/{name} failed:\n{cp.stdout}"
    return cp.stdout


def fitted_ranks(out: str, world: int) -> list[int]:
    fits = re.findall(rf"rank (\d+)/{world}: loss [\d.]+, y = ([\d.]+) x \+ ([\d.]+)", out)
    assert all(abs(float(w) - 3) < 0.1 and abs(float(b) - 1) < 0.1 for _, w, b in fits), out
    return [int(rank) for rank, _, _ in fits]


def test_quickstart_fits_the_line_on_one_worker_per_core_unless_told(tmp_path, monkeypatch):
    # One usable core (its affinity): "one worker per CPU core", as its docstring says, is 1.
    one_core = ["taskset", "--cpu-list", str(min(os.sched_getaffinity(0)))]
    cp = run([*one_core, sys.executable, str(EXAMPLES / "quickstart.py")], tmp_path, 240)
    assert cp.returncode == 0, cp.stdout
    assert fitted_ranks(cp.stdout, 1) == [0]
    monkeypatch.setenv("QUICKSTART_WORKERS", "3")
    assert fitted_ranks(example(tmp_path, "quickstart.py"), 3) == [0, 1, 2]


def test_progress_bar_shows_rank_0s_bar_and_returns_every_rank(tmp_path):
    out = example(tmp_path, "progress_bar.py")
    assert "result: [0, 1]" in out
    assert "[localhost:0] halfway: checkpoint saved\n" in out
    # Not a terminal here: the launcher writes the bar's updates as lines.
    assert "[localhost:0] epoch 1: [" + "#" * 30 + "] 40/40\n" in out, out[-500:]


def test_train_ddp_trains_on_many_and_tests_on_one(tmp_path):
    out = example(tmp_path, "train_ddp.py")
    assert f"trained on {usable_cpu_count()} workers" in out
    accuracy = float(re.search(r"test accuracy: ([\d.]+)", out).group(1))
    assert accuracy > 0.9, out


def test_cli_tyro_takes_launcher_options_from_the_command_line(tmp_path):
    out = example(tmp_path, "cli_tyro.py", "--workers-per-host", "3", "--backend", "gloo")
    assert sorted(re.findall(r"hello from rank (\d) of 3", out)) == ["0", "1", "2"], out
    help_text = example(tmp_path, "cli_tyro.py", "--help")
    assert "--heartbeat-timeout" in help_text
