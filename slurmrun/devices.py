"""The GPUs and CPUs this process may use, counted without importing torch or touching CUDA.

Cheap to import and safe to call before forking workers.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

__all__ = ["usable_cpu_count", "visible_gpu_count"]

_NVIDIA_DEVICE = re.compile(r"nvidia\d+")
_NO_CUDA_DEVICES = frozenset({"NoDevFiles"})


def visible_gpu_count(
    environ: Mapping[str, str] | None = None, *, dev_dir: str | os.PathLike[str] = "/dev"
) -> int:
    """Count the NVIDIA GPUs this process may use, without importing torch or touching CUDA.

    ``CUDA_VISIBLE_DEVICES`` decides when set (SLURM sets it in steps that got GPUs);
    otherwise the ``nvidia<N>`` device files in ``dev_dir`` are counted.

    Args:
        environ: the environment to read; ``os.environ`` by default.
        dev_dir: where device files live; a parameter so tests can fake it.

    Returns:
        The number of GPUs, 0 if none.
    """
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return _count_cuda_visible_devices(visible)
    try:
        names = [entry.name for entry in Path(dev_dir).iterdir()]
    except OSError:
        return 0
    return sum(1 for name in names if _NVIDIA_DEVICE.fullmatch(name))


def usable_cpu_count() -> int:
    """Return how many CPUs this process may run on (its affinity mask, else all CPUs)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # sched_getaffinity is Linux-only
        return os.cpu_count() or 1


def _count_cuda_visible_devices(value: str) -> int:
    count = 0
    for entry in (item.strip() for item in value.split(",")):
        # CUDA stops enumerating at the first invalid entry: "-1" hides every GPU, and
        # SLURM writes "NoDevFiles" when GPUs are configured without device files.
        if not entry or entry in _NO_CUDA_DEVICES or entry.startswith("-"):
            break
        count += 1
    return count
