"""Tests for slurmrun.devices: the GPUs and CPUs this process may use."""

from __future__ import annotations

import os

import pytest

from slurmrun.devices import usable_cpu_count, visible_gpu_count

# --- visible_gpu_count ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0", 1),
        ("0,1,2,3", 4),
        ("2,3", 2),
        (" 0 , 1 ", 2),
        ("GPU-8f0b0b3e-1a2b-4c5d-9e8f-0123456789ab,GPU-11111111-2222-3333-4444-555555555555", 2),
        ("MIG-0b0b3e1a-2b4c-5d9e-8f01-23456789abcd", 1),
        ("", 0),
        ("-1", 0),
        ("NoDevFiles", 0),
        ("0,-1,1", 1),
        ("0,1,", 2),
    ],
)
def test_visible_gpu_count_reads_cuda_visible_devices(value, expected, tmp_path):
    (tmp_path / "nvidia0").touch()
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": value}, dev_dir=tmp_path) == expected


def test_visible_gpu_count_counts_nvidia_device_files(tmp_path):
    for name in ["nvidia0", "nvidia1", "nvidia7", "nvidia10"]:
        (tmp_path / name).touch()
    for name in ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset", "null"]:
        (tmp_path / name).touch()
    (tmp_path / "nvidia-caps").mkdir()
    assert visible_gpu_count({}, dev_dir=tmp_path) == 4


def test_visible_gpu_count_is_zero_without_devices(tmp_path):
    assert visible_gpu_count({}, dev_dir=tmp_path) == 0
    assert visible_gpu_count({}, dev_dir=tmp_path / "missing") == 0


# --- usable_cpu_count ------------------------------------------------------------------------


def test_usable_cpu_count_follows_affinity_mask():
    expected = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert usable_cpu_count() == expected
    assert usable_cpu_count() >= 1


def test_usable_cpu_count_falls_back_to_cpu_count(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert usable_cpu_count() == 6
