"""Stragglers on localhost: false reports of balanced ranks, and how soon a slow rank is named.

    python benchmarks/balanced_stragglers.py [--workers 2] [--seconds 300] [--slower 1.0]
                                             [--spin] [--bursts] [--record samples.pickle]
                                             [--json out.json]

gloo, `--workers` ranks on this machine, each step a sleep of 0.1 s (``--spin``: 0.1 s of CPU
work) and an ``all_reduce``; with ``--slower 1.3`` the last rank's steps take 30 % longer.
Straggler detection on (four samples a second). Prints every `slurmrun.events.Straggler` event
(rank, score, seconds after the workers started) and the load. A balanced run (``--slower
1.0``, the default) should have none in 5 minutes (issue 51). ``--bursts``: the ranks take
turns at being descheduled, 6 s in every 10 (their main thread shares a core with two busy
processes, at the lowest priority), as on a busy node. ``--record`` keeps every sample the
judge saw (pickled ``(time, StackReport)`` pairs) to replay a judge on.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import slurmrun
from slurmrun.events import Event, Straggler
from slurmrun.launcher import stragglers

_samples: list[tuple[float, object]] = []
_add = stragglers.StragglerJudge.add


def _recorded(self: stragglers.StragglerJudge, report: object, now: float) -> object:
    _samples.append((now, report))
    return _add(self, report, now)  # type: ignore[arg-type]


stragglers.StragglerJudge.add = _recorded  # type: ignore[assignment,method-assign]


BUSY = """
import os, sys
os.sched_setaffinity(0, {int(sys.argv[1])})
while os.getppid() == int(sys.argv[2]):
    pass
"""


class Bursts:
    """Deschedules this rank's main thread 6 s in every 10, in turn with the other ranks."""

    def __init__(self, rank: int, ranks: int) -> None:
        self.rank, self.ranks = rank, ranks
        self.began = time.monotonic()
        self.cpus = os.sched_getaffinity(0)
        self.busy: list[subprocess.Popen[bytes]] = []

    def step(self) -> None:
        slot, into = divmod(time.monotonic() - self.began, 10.0)
        mine = int(slot) % self.ranks == self.rank and into < 6.0
        if mine and not self.busy:
            cpu = sorted(self.cpus)[self.rank % len(self.cpus)]
            self.busy = [
                subprocess.Popen([sys.executable, "-c", BUSY, str(cpu), str(os.getpid())])
                for _ in range(2)
            ]
            os.sched_setaffinity(0, {cpu})
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        elif not mine and self.busy:
            self.end()

    def end(self) -> None:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        os.sched_setaffinity(0, self.cpus)
        for process in self.busy:
            process.kill()
            process.wait()
        self.busy = []


def steps(step: float, slower: float, seconds: float, spin: bool, bursts: bool) -> int:
    """Steps of `step` s and an all_reduce for `seconds`; the last rank's take `slower` times
    as long. A step sleeps, or with `spin` works on the CPU; with `bursts`, see `Bursts`."""
    import torch.distributed as dist

    rank = dist.get_rank()
    pause = step * (slower if rank == dist.get_world_size() - 1 else 1.0)
    turns = Bursts(rank, dist.get_world_size()) if bursts else None
    try:
        return _steps(pause, seconds, spin, turns)
    finally:
        if turns is not None:
            turns.end()


def _steps(pause: float, seconds: float, spin: bool, turns: Bursts | None) -> int:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    end = time.monotonic() + seconds
    done = 0
    while True:
        if turns is not None:
            turns.step()
        if spin:
            until = time.thread_time() + pause
            while time.thread_time() < until:
                pass
        else:
            time.sleep(pause)
        flag = torch.tensor([1.0 if rank == 0 and time.monotonic() > end else 0.0])
        dist.all_reduce(flag)
        done += 1
        if flag.item() > 0:
            return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--slower", type=float, default=1.0)
    parser.add_argument("--spin", action="store_true", help="steps work on the CPU, not sleep")
    parser.add_argument("--bursts", action="store_true", help="ranks descheduled in turns")
    parser.add_argument("--record", default=None, help="pickle every sample here")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    events: list[Event] = []
    load = os.getloadavg()[0]
    began = time.time()
    result = slurmrun.launch(
        steps,
        (0.1, args.slower, args.seconds, args.spin, args.bursts),
        workers_per_host=args.workers,
        backend="gloo",
        stragglers=True,
        on_event=events.append,
    )
    started = next((e.time for e in events if e.kind == "workers_started"), began)
    found = [e for e in events if isinstance(e, Straggler)]
    for e in found:
        print(f"straggler: rank {e.rank}, score {e.score:.2f}, {e.time - started:.1f} s")
    summary = {
        "workers": args.workers,
        "seconds": args.seconds,
        "slower": args.slower,
        "spin": args.spin,
        "bursts": args.bursts,
        "steps": result.rank(0),
        "samples": len(_samples),
        "stragglers": [(e.rank, e.score, round(e.time - started, 1)) for e in found],
        "load_average": [load, os.getloadavg()[0]],
    }
    print(
        f"{args.workers} ranks, {args.seconds:g} s, slower {args.slower:g}"
        f"{' (spin)' if args.spin else ''}{' (bursts)' if args.bursts else ''}: "
        f"{len(found)} straggler reports, {len(_samples)} samples, {result.rank(0)} steps; "
        f"load {load:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    if args.record:
        with open(args.record, "wb") as f:
            pickle.dump(_samples, f)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
