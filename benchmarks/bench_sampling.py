"""The cost of sampling every rank's stacks (stragglers, hangs): steps/s with it on and off.

    python benchmarks/bench_sampling.py [--workers 2] [--seconds 3] [--rounds 10] [--same]
                                        [--json benchmarks/results/sampling.json]

Localhost, gloo. One warm launcher with kept workers, each of its runs with ``stragglers=False``
(no sampling) or ``stragglers=True, hang_timeout=600`` (both judges on; sampling once a second
while nothing looks wrong, four times a second while a judge suspects a rank; the samples taken
per second are printed); ``--same``: both cases without sampling (an A/A check). Each round
runs a loop of ``all_reduce`` on a small tensor (the step most sensitive to an interruption)
for `--seconds` in each case, in alternating order, and takes rank 0's steps per second; a
round's ratio (on / off) compares runs seconds apart, so that a busy machine's drift cancels,
and the median of the rounds' ratios is the result. Also prints what one sample costs a
worker's own thread (`slurmrun.stacks.report.capture` of a 30-frame stack), and the load.
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
from slurmrun.launcher import sampling

_made: list[sampling.Sampling] = []  # every run's sampling, to count its samples
_init = sampling.Sampling.__init__


def _counted(self: sampling.Sampling, *args: object, **kwargs: object) -> None:
    _init(self, *args, **kwargs)  # type: ignore[arg-type]
    _made.append(self)


sampling.Sampling.__init__ = _counted  # type: ignore[method-assign]


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
        "--same", action="store_true", help="both cases without sampling (an A/A check)"
    )
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"off": [], "on": []}
    cpus: dict[str, list[float]] = {"off": [], "on": []}
    ratios: list[float] = []
    samples: list[float] = []  # per second, of each round's sampled run
    # One warm launcher, its workers kept, sampling switched on and off between runs: the same
    # processes run both cases (two launchers' workers differed by up to 20 % in an A/A check).
    on = not args.same
    settings = {"off": (False, None), "on": (on, 600.0 if on else None)}
    with slurmrun.Launcher(workers_per_host=args.workers, backend="gloo", keep_workers=True) as run:
        for round_ in range(args.rounds + 1):  # the first round warms both up, uncounted
            order = ("off", "on") if round_ % 2 == 0 else ("on", "off")
            got, cpu = {}, {}
            for case in order:
                run.stragglers, run.hang_timeout = settings[case]
                _made.clear()
                began = time.monotonic()
                got[case], cpu[case] = run.run(all_reduce_loop, (args.seconds,)).rank(0)
                if case == "on":
                    taken = sum(s.samples for s in _made)
                    samples.append(taken / (time.monotonic() - began))
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
    off, on_rate = statistics.median(rates["off"]), statistics.median(rates["on"])
    ratio = statistics.median(ratios)
    cpu_off, cpu_on = statistics.median(cpus["off"]), statistics.median(cpus["on"])
    sample = capture_cost()
    rate = statistics.median(samples)
    summary = {
        "workers": args.workers,
        "seconds": args.seconds,
        "rates": rates,
        "median_off": off,
        "median_on": on_rate,
        "ratios": ratios,
        "cpu_per_step": cpus,
        "cpu_ratio_on_off": cpu_on / cpu_off,
        "ratio_on_off": ratio,
        "capture_seconds": sample,
        "samples_per_second": rate,
        "load_average": os.getloadavg()[0],
    }
    print(
        f"{args.workers} workers: {off:,.0f} steps/s without sampling, {on_rate:,.0f} with it "
        f"(medians); median ratio on/off {ratio:.3f}; {rate:.2f} samples/s; "
        f"one capture: {sample * 1e6:.0f} us (x4/s: {4 * sample:.2%} of a rank's time); "
        f"load {os.getloadavg()[0]:.1f}; CPU per step (medians) "
        f"{cpu_off * 1e6:.0f} us off, {cpu_on * 1e6:.0f} us on: ratio {cpu_on / cpu_off:.3f}"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
