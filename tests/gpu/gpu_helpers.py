"""Helpers of the GPU tests: GPU counts without touching CUDA, memory seen by a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

GIB = 1 << 30
REPO = Path(__file__).resolve().parents[2]

# Bounds for GPU memory to be released and processes to go: generous, for a loaded machine.
FREED_WITHIN = 60.0


def gpu_count() -> int:
    """The GPUs this process sees (CUDA_VISIBLE_DEVICES applies), without initialising CUDA."""
    import torch

    return torch.cuda.device_count()


def need_gpus(n: int) -> int:
    """Skips the test unless at least `n` GPUs are visible; returns how many there are."""
    have = gpu_count()
    if have < n:
        pytest.skip(f"needs {n} GPU(s), this machine shows {have}")
    return have


_MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, torch
    print(json.dumps([torch.cuda.mem_get_info(i) for i in range(torch.cuda.device_count())]))
    """
)


def gpu_memory() -> list[tuple[int, int]]:
    """(free, total) bytes of every visible GPU, asked by a fresh process (its own context)."""
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return [(int(free), int(total)) for free, total in json.loads(out.strip().splitlines()[-1])]


def compute_app_pids() -> set[int]:
    """Pids nvidia-smi lists as holding a CUDA context (empty where it cannot see them)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    return {int(line) for line in out.split() if line.strip().isdigit()}


def used(memory: list[tuple[int, int]]) -> list[int]:
    return [total - free for free, total in memory]


def wait_memory_back(baseline: list[tuple[int, int]], slack: int = GIB // 2) -> list[int]:
    """Waits (bounded) until every GPU uses no more than at `baseline` (+ `slack`); returns
    the bytes still used above the baseline per GPU (all <= slack when it came back)."""
    deadline = time.monotonic() + FREED_WITHIN
    while True:
        extra = [
            now - before for now, before in zip(used(gpu_memory()), used(baseline), strict=True)
        ]
        if all(e <= slack for e in extra) or time.monotonic() > deadline:
            return extra
        time.sleep(1.0)


def script_env() -> dict[str, str]:
    """The environment of a script the test runs: this checkout first on PYTHONPATH, and
    whatever was there already (run.sh puts the carried wheels' folder there) after it."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}
