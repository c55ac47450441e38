"""NCCL on real GPUs: backend and worker count chosen by "auto", collectives on CUDA tensors,
each worker on its LOCAL_RANK's device, and CUDA_VISIBLE_DEVICES subsets respected."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from gpu_helpers import need_gpus

import slurmrun

pytestmark = pytest.mark.gpu

OPTIONS = {"timeout": 300}


def where_am_i() -> dict[str, object]:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    t = torch.tensor([float(rank + 1)], device="cuda")
    dist.all_reduce(t)
    return {
        "backend": dist.get_backend(),
        "rank": rank,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "current_device": torch.cuda.current_device(),
        "sum": t.item(),
        "sum_device": str(t.device),
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "device_count": torch.cuda.device_count(),
        "uuid": str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid),
    }


def test_auto_picks_nccl_and_one_worker_per_gpu() -> None:
    n = need_gpus(1)
    result = slurmrun.launch(where_am_i, **OPTIONS)
    assert result.world_size == n, "workers_per_host='auto' starts one worker per visible GPU"
    values = result.values()
    assert {v["backend"] for v in values} == {"nccl"}
    assert [v["rank"] for v in values] == list(range(n))
    assert {v["sum"] for v in values} == {n * (n + 1) / 2}, "all_reduce of a CUDA tensor"
    for v in values:
        assert v["current_device"] == v["local_rank"], v
        assert v["sum_device"] == f"cuda:{v['local_rank']}", v
    assert len({v["uuid"] for v in values}) == n, "every worker on a GPU of its own"


def _uuids(visible: str) -> list[str]:
    """The UUIDs of the GPUs a fresh process sees under CUDA_VISIBLE_DEVICES=`visible`."""
    script = textwrap.dedent(
        """
        import json, torch
        n = torch.cuda.device_count()
        print(json.dumps([str(torch.cuda.get_device_properties(i).uuid) for i in range(n)]))
        """
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible}
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


SUBSETS = {
    # name: (GPUs the machine needs, the subset as a function of the GPU count)
    "first": (2, lambda n: "0"),
    "last": (2, lambda n: str(n - 1)),
    "every_other": (3, lambda n: ",".join(str(i) for i in range(0, n, 2))),
}


@pytest.mark.parametrize("name", list(SUBSETS))
def test_cuda_visible_devices_subset_is_respected(name: str, monkeypatch) -> None:
    needed, subset = SUBSETS[name]
    visible = subset(need_gpus(needed))
    expected = _uuids(visible)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    result = slurmrun.launch(where_am_i, **OPTIONS)
    values = result.values()
    assert result.world_size == len(visible.split(",")), "auto: one worker per visible GPU"
    assert [v["uuid"] for v in values] == expected, "worker i on the i-th GPU of the subset"
    for v in values:
        assert v["visible"] == visible and v["device_count"] == len(expected), v
        assert v["backend"] == "nccl" and v["current_device"] == v["local_rank"], v
    assert {v["sum"] for v in values} == {len(expected) * (len(expected) + 1) / 2}


def backend_and_gpus() -> tuple[str, int]:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.get_backend(), torch.cuda.device_count()


def test_hiding_every_gpu_gives_gloo_workers_without_gpus(monkeypatch) -> None:
    # The one subset a 1-GPU machine can check: none of its GPUs.
    need_gpus(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    result = slurmrun.launch(backend_and_gpus, workers_per_host=2, **OPTIONS)
    assert result.values() == [("gloo", 0)] * 2


def test_more_workers_than_gpus_is_a_clear_error() -> None:
    # Two NCCL ranks on one GPU is an NCCL error, and set_device(n) on n GPUs a CUDA one:
    # slurmrun says which rule was broken and what to do instead.
    n = need_gpus(1)
    with pytest.raises(RuntimeError, match="backend 'nccl' needs one GPU per worker") as raised:
        slurmrun.launch(where_am_i, workers_per_host=n + 1, **OPTIONS)
    message = str(raised.value)
    assert f"local rank {n}" in message and f"sees {n} GPU(s)" in message, message
