"""One measured launch with slurmrun or torchrunx on localhost (run by benchmarks/run.py).

    python benchmarks/bench_launch.py --tool slurmrun trivial --launches 2 --workers 2
    python benchmarks/bench_launch.py --tool slurmrun trivial --launches 5 --warm
    python benchmarks/bench_launch.py --tool torchrunx returns --kind tensor --mib 64
    python benchmarks/bench_launch.py --tool slurmrun fail --how kill --death-file F --cap 60

Prints one ``BENCH_JSON`` line: the launch-call times and what the mode measures.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402 - the clock starts before any import
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import current_rss_bytes, emit, last_stamp, peak_rss_bytes, read_float  # noqa: E402

MIB = 1 << 20

# ------------------------------------------------------------------ worker functions
# Defined in __main__, so both tools ship them by value with cloudpickle.


def trivial() -> int:
    """One all_reduce, then the rank."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.get_rank()


def _stamp(stamp_dir: str, rank: int) -> None:
    """Notes when this rank's value is ready (the launcher measures the transfer from it)."""
    with open(os.path.join(stamp_dir, f"created-{rank}"), "w") as f:
        f.write(repr(time.time()))


def tensor_of(nbytes: int, stamp_dir: str) -> Any:
    """A float32 tensor of `nbytes` filled with the rank."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    value = torch.full((nbytes // 4,), float(rank), dtype=torch.float32)
    _stamp(stamp_dir, rank)
    return value


def numpy_of(nbytes: int, stamp_dir: str) -> Any:
    """A float32 numpy array of `nbytes` filled with the rank."""
    import numpy as np
    import torch.distributed as dist

    rank = dist.get_rank()
    value = np.full(nbytes // 4, rank, dtype=np.float32)
    _stamp(stamp_dir, rank)
    return value


def nested_of(count: int, each: int, stamp_dir: str) -> dict[str, Any]:
    """A dict of `count` float32 tensors of `each` bytes."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    value = {
        f"t{i}": torch.full((each // 4,), float(rank), dtype=torch.float32) for i in range(count)
    }
    _stamp(stamp_dir, rank)
    return value


def die(death_file: str, how: str) -> int:
    """Rank 1 records the time and dies; rank 0 waits for it in an all_reduce."""
    import signal

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == 1:
        time.sleep(1.0)  # rank 0 is inside the collective by now
        with open(death_file, "w") as f:
            f.write(repr(time.time()))
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)
    t = torch.ones(1)
    dist.all_reduce(t)
    return rank


# ------------------------------------------------------------------ the tools


def launch_slurmrun(func: Callable[..., Any], args: Sequence[Any], workers: int) -> list[Any]:
    """slurmrun.launch on localhost with gloo."""
    import slurmrun

    result = slurmrun.launch(
        func, tuple(args), hostnames=["localhost"], workers_per_host=workers, backend="gloo"
    )
    return list(result.values())


def launch_torchrunx(func: Callable[..., Any], args: Sequence[Any], workers: int) -> list[Any]:
    """torchrunx.Launcher(...).run on localhost with gloo (torchrunx 0.4 API)."""
    import torchrunx

    launcher = torchrunx.Launcher(hostnames=["localhost"], workers_per_host=workers, backend="gloo")
    result = launcher.run(func, *args)
    return [result.rank(i) for i in range(workers)]


TOOLS: dict[str, Callable[[Callable[..., Any], Sequence[Any], int], list[Any]]] = {
    "slurmrun": launch_slurmrun,
    "torchrunx": launch_torchrunx,
}


def import_tool(tool: str) -> float:
    """Imports the tool's package; returns the seconds it took."""
    t0 = time.perf_counter()
    __import__(tool)
    return time.perf_counter() - t0


# ------------------------------------------------------------------ modes


def mode_trivial(tool: str, workers: int, launches: int, warm: bool = False) -> dict[str, Any]:
    """Times `launches` trivial launches in a row (``warm``: in one slurmrun.Launcher block)."""
    import_s = import_tool(tool)
    times: list[float] = []
    ok = True
    if warm:
        import slurmrun

        with slurmrun.Launcher(
            hostnames=["localhost"], workers_per_host=workers, backend="gloo"
        ) as launcher:
            for _ in range(launches):
                t0 = time.perf_counter()
                values = list(launcher.run(trivial).values())
                times.append(time.perf_counter() - t0)
                ok = ok and values == list(range(workers))
            t0 = time.perf_counter()
            path = launcher.run(critical_path, (time.time(),)).rank(0)
            path["launch_s"] = time.perf_counter() - t0
            path["func_end_to_return_s"] = time.time() - path.pop("func_end")
        return {"import_s": import_s, "launch_s": times, "ok": ok, "critical_path": path}
    for _ in range(launches):
        t0 = time.perf_counter()
        values = TOOLS[tool](trivial, (), workers)
        times.append(time.perf_counter() - t0)
        ok = ok and values == list(range(workers))
    return {"import_s": import_s, "launch_s": times, "ok": ok}


def critical_path(called: float) -> dict[str, float]:
    """Where a warm run's time goes, as rank 0 sees it, against the launcher's clock.

    `called`: the launcher's ``time.time()`` when it called ``run`` (one machine, one clock).
    The process group is already initialised when func runs: its cost is measured by a
    second init of a fresh group (a new store and a barrier), like the one the worker made.
    """
    import torch
    import torch.distributed as dist

    t_func = time.time()
    t0 = time.perf_counter()
    group = dist.new_group(backend="gloo")
    dist.barrier(group=group)
    t1 = time.perf_counter()
    t = torch.ones(1)
    dist.all_reduce(t)
    t2 = time.perf_counter()
    return {
        "call_to_func_s": t_func - called,  # hand-out, fork, unpickle, process group + barrier
        "new_group_and_barrier_s": t1 - t0,
        "all_reduce_s": t2 - t1,
        "func_end": time.time(),  # the launcher turns it into func_end_to_return_s
    }


def _check_value(kind: str, value: Any, rank: int, nbytes: int) -> bool:
    if kind == "nested":
        return len(value) == 100 and all(float(t[-1]) == rank for t in value.values())
    return int(value.nbytes) == nbytes and float(value[0]) == rank and float(value[-1]) == rank


def mode_returns(tool: str, workers: int, kind: str, mib: int) -> dict[str, Any]:
    """One launch whose workers each return `mib` MiB; launcher memory before and at peak."""
    import torch  # noqa: F401 - baseline memory includes what unpickling needs anyway

    if kind == "numpy":  # tensors need no numpy: a venv without it measures them too
        import numpy  # noqa: F401

    import_tool(tool)
    stamp_dir = tempfile.mkdtemp(prefix="slurmrun-bench-stamps-")
    func: Callable[..., Any]
    args: tuple[Any, ...]
    if kind == "tensor":
        func, args, nbytes = tensor_of, (mib * MIB, stamp_dir), mib * MIB
    elif kind == "numpy":
        func, args, nbytes = numpy_of, (mib * MIB, stamp_dir), mib * MIB
    else:
        func, args, nbytes = nested_of, (100, MIB, stamp_dir), 100 * MIB
    rss_before = current_rss_bytes()
    t0 = time.perf_counter()
    values = TOOLS[tool](func, args, workers)
    launch_s = time.perf_counter() - t0
    returned_at = time.time()
    peak = peak_rss_bytes()
    created = last_stamp(stamp_dir)
    shutil.rmtree(stamp_dir, ignore_errors=True)
    ok = all(_check_value(kind, v, r, nbytes) for r, v in enumerate(values))
    return {
        "launch_s": launch_s,
        "after_created_s": None if created is None else returned_at - created,
        "bytes_returned": nbytes * workers,
        "rss_before": rss_before,
        "peak_rss": peak,
        "ok": ok,
    }


def _cap_watchdog(death_file: str, cap: float) -> None:
    """Ends the script with a 'capped' result `cap` s after the death if nothing was raised."""
    while read_float(death_file) is None:
        time.sleep(0.05)
    time.sleep(cap)
    emit({"capped": True, "cap_s": cap, "latency_s": None})
    os._exit(0)


def mode_fail(tool: str, death_file: str, how: str, cap: float) -> dict[str, Any]:
    """Time from rank 1's death to the exception in the launcher."""
    import_tool(tool)
    threading.Thread(target=_cap_watchdog, args=(death_file, cap), daemon=True).start()
    t0 = time.perf_counter()
    try:
        TOOLS[tool](die, (death_file, how), 2)
    except BaseException as e:
        raised_at = time.time()
        died_at = read_float(death_file)
        return {
            "launch_s": time.perf_counter() - t0,
            "latency_s": None if died_at is None else raised_at - died_at,
            "exc_type": type(e).__name__,
            "exc_head": str(e).splitlines()[0][:200] if str(e) else "",
            "capped": False,
        }
    return {"launch_s": time.perf_counter() - t0, "latency_s": None, "no_exception": True}


def main() -> None:
    """Parses the command line, runs one mode, prints its BENCH_JSON line."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tool", choices=sorted(TOOLS), required=True)
    parser.add_argument("--workers", type=int, default=2)
    sub = parser.add_subparsers(dest="mode", required=True)
    p_trivial = sub.add_parser("trivial")
    p_trivial.add_argument("--launches", type=int, default=1)
    p_trivial.add_argument("--warm", action="store_true", help="slurmrun: one warm Launcher")
    p_returns = sub.add_parser("returns")
    p_returns.add_argument("--kind", choices=["tensor", "numpy", "nested"], default="tensor")
    p_returns.add_argument("--mib", type=int, default=64)
    p_fail = sub.add_parser("fail")
    p_fail.add_argument("--death-file", required=True)
    p_fail.add_argument("--how", choices=["kill", "exit"], default="kill")
    p_fail.add_argument("--cap", type=float, default=60.0)
    a = parser.parse_args()
    if a.mode == "trivial":
        data = mode_trivial(a.tool, a.workers, a.launches, a.warm)
    elif a.mode == "returns":
        data = mode_returns(a.tool, a.workers, a.kind, a.mib)
    else:
        data = mode_fail(a.tool, a.death_file, a.how, a.cap)
    data["script_s"] = time.perf_counter() - T_START
    emit(data)


if __name__ == "__main__":
    main()
