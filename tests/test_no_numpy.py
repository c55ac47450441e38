"""Without numpy, torch's "Failed to initialize NumPy" warning is not what slurmrun shows first.

slurmrun imports torch in every spawner and, when a result holds tensors, in the launcher; torch
warns on import when numpy is missing. A package named numpy that fails to import (first on
PYTHONPATH, for the launcher and, through the environment, for its agents and workers) makes
this machine numpy-free; tests/fresh_venv.sh checks the same in a venv that has no numpy.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCH_WARNING = "Failed to initialize NumPy: No module named 'numpy'"

SCRIPT = """
import warnings

import slurmrun


def ones():
    import torch

    return torch.ones(2)


values = slurmrun.launch(ones, workers_per_host=2, hostnames=["localhost"]).values()
print("values", [v.tolist() for v in values])
warnings.warn("Failed to initialize NumPy: the user's own warning", stacklevel=1)
"""


def test_no_numpy_warning_in_the_launcher_or_node_logs_but_the_filter_is_scoped(tmp_path):
    shadow = tmp_path / "shadow" / "numpy"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n"
    )
    logs = tmp_path / "logs"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}
    env |= {"PYTHONPATH": f"{shadow.parent}{os.pathsep}{REPO}", "SLURMRUN_LOG_DIR": str(logs)}
    # The shadow works: torch itself warns when the test's own interpreter imports it.
    bare = subprocess.run(
        [sys.executable, "-c", "import torch"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert TORCH_WARNING in bare.stderr, bare.stderr

    (tmp_path / "driver.py").write_text(SCRIPT)
    cp = subprocess.run(
        [sys.executable, "driver.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = cp.stdout + cp.stderr
    assert cp.returncode == 0, out
    assert "values [[1.0, 1.0], [1.0, 1.0]]" in out
    assert TORCH_WARNING not in out
    # Only slurmrun's own import was quiet: the same message from the user still shows.
    assert "the user's own warning" in out
    files = sorted(logs.rglob("*.log"))
    assert any(f.name == "localhost.agent.log" for f in files), files
    noisy = [f.name for f in files if TORCH_WARNING in f.read_text()]
    assert not noisy, f"torch's numpy warning in {noisy}"
