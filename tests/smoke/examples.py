"""The README's first Python example and the localhost examples, as a new user runs them.

    python examples.py ROOT     ROOT holds README.md and examples/ (copies, outside the checkout)

Run by tests/fresh_venv.sh in the venv it made as the README says (``pip install
torch==2.13.0 .``): each example runs as ``python <file>`` in a fresh folder and its output is
checked, not only its exit status. Where numpy is absent, torch's "Failed to initialize NumPy"
warning must appear neither in an example's output nor in its agents' and workers' logs. Every
file of examples/ is either run here or named as a SLURM one (run on the test cluster by
tests/slurm/test_examples_slurm.py), so a new example is not forgotten. A plain script, like
smoke.py: one line per check, ``N passed, M failed``, exit 1 if any failed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from smoke import run_checks  # copied beside this file, as tests/fresh_venv.sh does

from slurmrun.devices import usable_cpu_count

ROOT = Path(sys.argv[1]).resolve()
SLURM_ONLY = {"sbatch_job.sh", "submit_from_login.py"}
NUMPY_WARNING = "Failed to initialize NumPy"


def numpy_absent() -> bool:
    try:
        import numpy  # noqa: F401 - only whether it imports
    except ImportError:
        return True
    return False


NO_NUMPY = numpy_absent()
CORES = usable_cpu_count()  # workers_per_host="auto" outside SLURM


def readme_first_python_block() -> str:
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("```python") + 1
    return "\n".join(lines[start : lines.index("```", start)]) + "\n"


def run(script: Path, *args: str) -> str:
    """Runs `python script args` in a new folder; returns its output, checked for the warning."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURMRUN_LOG_DIR"] = os.path.join(tmp, "logs")
        cp = subprocess.run(
            [sys.executable, str(script), *args],
            cwd=tmp,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        out = cp.stdout + cp.stderr
        assert cp.returncode == 0, f"{script.name} exited with {cp.returncode}:\n{out}"
        if NO_NUMPY:
            assert NUMPY_WARNING not in out, f"{script.name} printed torch's warning:\n{out}"
            logs = sorted(Path(tmp, "logs").rglob("*.log"))
            noisy = [p.name for p in logs if NUMPY_WARNING in p.read_text()]
            assert not noisy, f"{script.name}: torch's numpy warning in the logs {noisy}"
    return out


def example(name: str, *args: str) -> str:
    return run(ROOT / "examples" / name, *args)


def fitted_ranks(out: str, world: int) -> list[int]:
    fits = re.findall(rf"rank (\d+)/{world}: loss [\d.]+, y = ([\d.]+) x \+ ([\d.]+)", out)
    assert all(abs(float(w) - 3) < 0.1 and abs(float(b) - 1) < 0.1 for _, w, b in fits), out
    return [int(rank) for rank, _, _ in fits]


# ---------------------------------------------------------------- checks, one per example


def readme_first_example() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp, "readme_example.py")
        script.write_text(readme_first_python_block())
        out = run(script)
    total = 0.5 * sum(range(1, CORES + 1))  # train(0.5): all_reduce of 0.5 * (rank + 1)
    assert f"{[total] * CORES}\n{total} {CORES}\n" in out, out


def quickstart_py() -> None:
    # QUICKSTART_WORKERS, its override, is tested in tests/test_examples.py
    assert fitted_ranks(example("quickstart.py"), CORES) == list(range(CORES))


def progress_bar_py() -> None:
    out = example("progress_bar.py")
    assert "result: [0, 1]" in out, out
    assert "[localhost:0] halfway: checkpoint saved\n" in out, out
    assert "[localhost:0] epoch 1: [" + "#" * 30 + "] 40/40\n" in out, out


def train_ddp_py() -> None:
    out = example("train_ddp.py")
    assert f"trained on {CORES} workers" in out, out
    match = re.search(r"test accuracy: ([\d.]+)", out)
    assert match and float(match.group(1)) > 0.9, out


def cli_tyro_py() -> None:
    out = example("cli_tyro.py", "--workers-per-host", "3", "--backend", "gloo")
    assert sorted(re.findall(r"hello from rank (\d) of 3", out)) == ["0", "1", "2"], out
    assert "--heartbeat-timeout" in example("cli_tyro.py", "--help")


CHECKS: dict[str, Callable[[], None]] = {
    "quickstart.py": quickstart_py,
    "progress_bar.py": progress_bar_py,
    "train_ddp.py": train_ddp_py,
    "cli_tyro.py": cli_tyro_py,
}


def every_example_is_run_or_slurm_only() -> None:
    files = {p.name for p in (ROOT / "examples").iterdir() if p.is_file()}
    unknown = files - set(CHECKS) - SLURM_ONLY
    assert not unknown, f"examples neither run here nor SLURM-only: {sorted(unknown)}"


def main() -> int:
    print(f"examples: {ROOT}, numpy {'absent' if NO_NUMPY else 'present'}, {CORES} cores")
    return run_checks([every_example_is_run_or_slurm_only, readme_first_example, *CHECKS.values()])


if __name__ == "__main__":
    sys.exit(main())
