"""The GPU suite (issue 18): collected only where CUDA is available, so on CPU machines this
directory adds nothing to `pytest tests` (no test, no skip, same exit code).

The `report` fixture prints measurements in the terminal and appends them to
``$SLURMRUN_GPU_REPORT`` (run.sh shows that file in its summary); helpers are in gpu_helpers.py.
"""

from __future__ import annotations

import contextlib
import os

import pytest

# NVML answers "is there a GPU" without cuInit in the pytest process: the launcher stays a
# process that never touched CUDA, as a user's driver script that only launches would be.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


if not _cuda_available():
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture
def report(request):
    """`report(line)`: a measurement for the run's summary (printed, never asserted)."""
    lines: list[str] = []
    yield lines.append
    if not lines:
        return
    path = os.environ.get("SLURMRUN_GPU_REPORT")
    if path:
        with contextlib.suppress(OSError), open(path, "a") as f:
            f.write(f"## {request.node.nodeid}\n" + "".join(f"{line}\n" for line in lines))
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None:
        return
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        reporter.write_line("")
        for line in lines:
            reporter.write_line(line)
