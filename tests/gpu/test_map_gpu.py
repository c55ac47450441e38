"""`Launcher.map` on real GPUs (issue 49): each item in a world of its own bound to one GPU
(NCCL over that world), one CUDA context per slot however many items it runs, none left when
the map ends, a worker that died taking its context with it, and a model loaded once per slot
serving every item the slot runs."""

from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path

import pytest
from gpu_helpers import GIB, compute_app_pids, gpu_memory, need_gpus, wait_memory_back

import slurmrun

pytestmark = pytest.mark.gpu

CONTEXTS_SETTLE = 10.0  # seconds for a dead worker's context to leave nvidia-smi's list


def probe(item: tuple[int, str]) -> dict[str, object]:
    """What an item sees, after real work on its GPU; item 1's first try dies holding memory."""
    import torch
    import torch.distributed as dist

    index, marker = item
    start = time.time()
    x = torch.randn(2048, 2048, device="cuda")
    held = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    if index == 1 and not os.path.exists(marker):
        Path(marker).touch()
        torch.cuda.synchronize()
        os._exit(3)  # dies with its context and 256 MiB: the retry goes to a fresh worker
    t = (x @ x).sum().reshape(1)
    dist.all_reduce(t)  # the item's own world: one rank
    torch.cuda.synchronize()
    del held
    return {
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "count": torch.cuda.device_count(),
        "uuid": str(torch.cuda.get_device_properties(0).uuid),
        "backend": dist.get_backend(),
        "world": (os.environ["RANK"], os.environ["WORLD_SIZE"]),
        "pid": os.getpid(),
        "span": (start, time.time()),
    }


def _contexts_settle(apps: set[int], slots: int) -> set[int]:
    """Pids (not `apps`) holding a context, once at most `slots` do (bounded wait)."""
    deadline = time.monotonic() + CONTEXTS_SETTLE
    while len(held := compute_app_pids() - apps) > slots and time.monotonic() < deadline:
        time.sleep(0.2)
    return held


@pytest.mark.timeout(600)
def test_map_items_each_get_one_gpu_and_leave_no_cuda_context(tmp_path: Path, report) -> None:
    n = need_gpus(1)
    baseline = gpu_memory()
    apps = compute_app_pids()
    items = [(i, str(tmp_path / "died-once")) for i in range(2 * n + 3)]
    values: dict[int, dict[str, object]] = {}
    holding: list[set[int]] = []
    with slurmrun.Launcher(timeout=300) as launcher:
        start = time.perf_counter()
        for index, value in launcher.imap(probe, items, retries=1):
            values[index] = value
            holding.append(_contexts_settle(apps, n))
        elapsed = time.perf_counter() - start
    assert sorted(values) == list(range(len(items))), "every item, item 1 on its retry"
    for index, v in values.items():
        visible = str(v["visible"])
        assert visible.isdigit() and v["count"] == 1, f"item {index} saw {visible!r}: {v}"
        assert v["backend"] == "nccl" and v["world"] == ("0", "1"), (index, v)
    pids = {v["pid"] for v in values.values()}
    assert len(pids) <= n + 1, f"one worker per slot, and one started again: {pids}"
    for held in holding:
        assert len(held) <= n, f"more CUDA contexts than slots while the map ran: {held}"
    overlapping = [
        (a, b)
        for a in values
        for b in values
        if a < b
        and values[a]["span"][0] < values[b]["span"][1]  # type: ignore[index]
        and values[b]["span"][0] < values[a]["span"][1]  # type: ignore[index]
    ]
    for a, b in overlapping:
        assert values[a]["uuid"] != values[b]["uuid"], f"items {a} and {b} shared a GPU"
    extra = wait_memory_back(baseline)
    assert all(e <= GIB // 2 for e in extra), f"after the map: {extra} bytes still used"
    left = compute_app_pids() - apps
    assert not left, f"after the map, pids {left} still hold a CUDA context"
    report(
        f"map of {len(items)} items on {n} GPU slot(s), one worker died and its item retried: "
        f"{elapsed:.2f} s; contexts held at each value: {[len(h) for h in holding]}"
    )


def serve(item: int) -> tuple[int, int, bool, float, float]:
    """(pid, the model's weight pointer, loaded now, seconds, output) of one item."""
    import torch

    state = slurmrun.worker_state()
    start = time.perf_counter()
    loaded = "model" not in state
    if loaded:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(4096, 4096) for _ in range(8)]  # 134 M parameters, 537 MB
        state["model"] = torch.nn.Sequential(*layers).cuda().eval()
    model = state["model"]
    with torch.no_grad():
        out = model(torch.full((64, 4096), float(item) / 100, device="cuda")).sum().item()
    torch.cuda.synchronize()
    return os.getpid(), model[0].weight.data_ptr(), loaded, time.perf_counter() - start, out


@pytest.mark.timeout(900)
def test_a_model_loaded_once_per_slot_serves_every_item(report) -> None:
    n = need_gpus(1)
    items = list(range(4 * n + 4))
    with slurmrun.Launcher(timeout=300, keep_workers=True) as launcher:
        start = time.perf_counter()
        mapped = launcher.map(serve, items)
        map_s = time.perf_counter() - start
    by_pid: dict[int, set[int]] = {}
    for pid, pointer, _, _, _ in mapped:
        by_pid.setdefault(pid, set()).add(pointer)
    assert len(by_pid) == n, f"one worker per slot: {sorted(by_pid)}"
    assert all(len(p) == 1 for p in by_pid.values()), f"one model per slot: {by_pid}"
    assert sum(loaded for _, _, loaded, _, _ in mapped) == n, "loaded once per slot, no more"
    fresh: list[float] = []
    for item in items[:3]:
        start = time.perf_counter()
        pid, _, loaded, _, out = slurmrun.launch(serve, (item,), timeout=300).rank(0)
        fresh.append(time.perf_counter() - start)
        assert loaded and pid not in by_pid, "a launch is a fresh worker that loads again"
        assert math.isclose(out, mapped[item][4], rel_tol=1e-4), (item, out, mapped[item][4])
    later = [s for _, _, loaded, s, _ in mapped if not loaded]
    first = [s for _, _, loaded, s, _ in mapped if loaded]
    report(
        f"model of 537 MB, {len(items)} items on {n} slot(s): map {map_s:.2f} s "
        f"({map_s / len(items):.3f} s an item); in the item: load + first "
        f"{statistics.median(first):.2f} s, later items {statistics.median(later) * 1e3:.1f} ms; "
        f"fresh workers (one launch an item) {statistics.median(fresh):.2f} s an item"
    )
