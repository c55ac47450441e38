"""Launch overhead with NCCL, printed next to `torchrun --standalone` on the same GPUs.

Measured, never asserted (speed belongs in benchmarks/): the test checks only that every
launch ran. Each variant runs one NCCL all_reduce on every GPU and exits.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from gpu_helpers import need_gpus, script_env

pytestmark = pytest.mark.gpu

ROUNDS = 3

TORCHRUN_JOB = textwrap.dedent(
    """
    import os

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    assert int(t.item()) == dist.get_world_size()
    dist.destroy_process_group()
    """
)

SLURMRUN_JOB = textwrap.dedent(
    """
    import json
    import sys
    import time

    import slurmrun


    def step():
        import torch
        import torch.distributed as dist

        t = torch.ones(1, device="cuda")
        dist.all_reduce(t)
        return int(t.item())


    def timed(run):
        start = time.perf_counter()
        values = run(step).values()
        assert values == [len(values)] * len(values), values
        return time.perf_counter() - start


    rounds = int(sys.argv[1])
    times = {"first": [timed(slurmrun.launch)]}
    times["later"] = [timed(slurmrun.launch) for _ in range(rounds)]
    with slurmrun.Launcher() as launcher:
        times["warm_first"] = [timed(launcher.run)]
        times["warm"] = [timed(launcher.run) for _ in range(rounds)]
    print("TIMES", json.dumps(times))
    """
)


def _run(argv: list[str], cwd: Path) -> tuple[float, str]:
    start = time.perf_counter()
    out = subprocess.run(
        argv,
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env=script_env(),
    )
    took = time.perf_counter() - start
    assert out.returncode == 0, f"{argv} failed:\n{out.stderr[-4000:]}"
    return took, out.stdout


@pytest.mark.timeout(1800)
def test_launch_overhead_next_to_torchrun(tmp_path, report) -> None:
    n = need_gpus(1)
    (tmp_path / "torchrun_job.py").write_text(TORCHRUN_JOB)
    (tmp_path / "slurmrun_job.py").write_text(SLURMRUN_JOB)
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={n}",
        "torchrun_job.py",
    ]
    torchrun_s = [_run(torchrun, tmp_path)[0] for _ in range(ROUNDS)]
    script_s, stdout = _run([sys.executable, "slurmrun_job.py", str(ROUNDS)], tmp_path)
    line = next(x for x in stdout.splitlines() if x.startswith("TIMES "))
    times = json.loads(line.removeprefix("TIMES "))
    med = {k: statistics.median(v) for k, v in times.items()}
    base = statistics.median(torchrun_s)
    report(f"launch overhead, {n} GPU worker(s), NCCL, one all_reduce (median of {ROUNDS}):")
    report(f"  torchrun --standalone (whole command)         {base:7.2f} s   1.00x")
    rows = [
        ("slurmrun.launch, first in a process", med["first"]),
        ("slurmrun.launch, later", med["later"]),
        ("Launcher() as l: l.run, first", med["warm_first"]),
        ("Launcher() as l: l.run, warm", med["warm"]),
    ]
    for name, seconds in rows:
        report(f"  {name:44} {seconds:7.2f} s   {seconds / base:4.2f}x")
    report(f"  (the slurmrun script, interpreter to exit: {script_s:.2f} s for all its launches)")
