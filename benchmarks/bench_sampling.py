"""The cost of sampling every rank's stacks (stragglers, hangs): steps/s with it on and off.

    python benchmarks/bench_sampling.py [--workers 2] [--seconds 3] [--rounds 10]
                                        [--json benchmarks/results/sampling.json]

Localhost, gloo. Two warm launchers with kept workers, one with ``stragglers=False`` (no
sampling), one with ``stragglers=True, hang_timeout=600`` (sampling four times a second, both
judges on). Each round runs a loop of ``all_reduce`` on a small tensor (the step most
sensitive to an interruption) for `--seconds` on each, in alternating order, and takes rank
0's steps per second; a round's ratio (on / off) compares runs seconds apart, so that a busy
machine's drift cancels, and the median of the rounds' ratios is the result. Also prints what
one sample costs a worker's own thread (`slurmrun.stacks.report.capture` of a 30-frame stack).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import slurmrun


def all_reduce_loop(seconds: float) -> tuple[float, float]:
    """Rank 0's all_reduce steps per second over `seconds` (after a second of warm-up), and
    its process's CPU seconds per step (all its threads: the sampling's answers count)."""
    import torch
    import torch.distributed as dist

    data = torch.ones(16)
    flag = torch.zeros(1)

    def run(limit: float) -> int:
        end = time.monotonic() + limit
        steps = 0
        while True:
            for _ in range(100):
                dist.all_reduce(data)
            steps += 100
            flag[0] = 1.0 if dist.get_rank() == 0 and time.monotonic() > end else 0.0
            dist.all_reduce(flag)
            if flag.item() > 0:
                return steps

    run(1.0)
    start, cpu = time.monotonic(), time.process_time()
    steps = run(seconds)
    return steps / (time.monotonic() - start), (time.process_time() - cpu) / steps


def capture_cost(frames: int = 30, repeat: int = 2000) -> float:
    """Seconds one `capture()` takes with another thread `frames` deep."""
    from slurmrun.stacks.report import capture

    ready, done = threading.Event(), threading.Event()

    def deep(n: int) -> None:
        if n:
            deep(n - 1)
        else:
            ready.set()
            done.wait()

    thread = threading.Thread(target=deep, args=(frames,), daemon=True)
    thread.start()
    ready.wait()
    capture()
    start = time.perf_counter()
    for _ in range(repeat):
        capture()
    took = (time.perf_counter() - start) / repeat
    done.set()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--same", action="store_true", help="both launchers without sampling (an A/A check)"
    )
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"off": [], "on": []}
    cpus: dict[str, list[float]] = {"off": [], "on": []}
    ratios: list[float] = []
    common = {"workers_per_host": args.workers, "backend": "gloo", "keep_workers": True}
    on_options = {"stragglers": False} if args.same else {"stragglers": True, "hang_timeout": 600.0}
    with (
        slurmrun.Launcher(stragglers=False, **common) as off_launcher,  # type: ignore[arg-type]
        slurmrun.Launcher(**on_options, **common) as on_launcher,  # type: ignore[arg-type]
    ):
        launchers = {"off": off_launcher, "on": on_launcher}
        for round_ in range(args.rounds + 1):  # the first round warms both up, uncounted
            order = ("off", "on") if round_ % 2 == 0 else ("on", "off")
            got, cpu = {}, {}
            for case in order:
                got[case], cpu[case] = launchers[case].run(all_reduce_loop, (args.seconds,)).rank(0)
            if round_ == 0:
                continue
            for case in order:
                rates[case].append(got[case])
                cpus[case].append(cpu[case])
            ratios.append(got["on"] / got["off"])
            print(
                f"round {round_}: {got['off']:,.0f} steps/s off, {got['on']:,.0f} on "
                f"(ratio {ratios[-1]:.3f}); CPU per step {cpu['off'] * 1e6:.0f} us off, "
                f"{cpu['on'] * 1e6:.0f} us on",
                flush=True,
            )
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    ratio = statistics.median(ratios)
    cpu_off, cpu_on = statistics.median(cpus["off"]), statistics.median(cpus["on"])
    sample = capture_cost()
    summary = {
        "workers": args.workers,
        "seconds": args.seconds,
        "rates": rates,
        "median_off": off,
        "median_on": on,
        "ratios": ratios,
        "cpu_per_step": cpus,
        "cpu_ratio_on_off": cpu_on / cpu_off,
        "ratio_on_off": ratio,
        "capture_seconds": sample,
        "samples_per_second": 4,
    }
    print(
        f"{args.workers} workers: {off:,.0f} steps/s without sampling, {on:,.0f} with it "
        f"(medians); median ratio on/off {ratio:.3f}; one capture: {sample * 1e6:.0f} us "
        f"(x4/s: {4 * sample:.2%} of a rank's time); CPU per step (medians) "
        f"{cpu_off * 1e6:.0f} us off, {cpu_on * 1e6:.0f} us on: ratio {cpu_on / cpu_off:.3f}"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
