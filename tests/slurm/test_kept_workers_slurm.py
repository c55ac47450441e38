"""Kept workers on the real 3-node SLURM test cluster: three runs of a gloo all_reduce served
by the same worker processes on every node, with the same process group and store (no new
rendezvous), and each worker's `slurmrun.worker_state()` kept from run to run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import slurmrun

REPO = str(Path(slurmrun.__file__).parents[1])

SCRIPT = """
import json, os, time
import slurmrun

def step(k):
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    state = slurmrun.worker_state()
    state.setdefault("seen", []).append(k)
    t = torch.tensor([float(k)])
    dist.all_reduce(t)
    store = distributed_c10d._get_default_store()
    return [os.environ["SLURMD_NODENAME"], os.getpid(), id(dist.group.WORLD), id(store),
            t.item(), state["seen"]]

with slurmrun.Launcher(workers_per_host=2, backend="gloo", timeout=60, keep_workers=True) as l:
    for k in (1, 2, 3):
        t = time.perf_counter()
        values = l.run(step, (k,)).values()
        print("RUN " + json.dumps([values, time.perf_counter() - t]), flush=True)
"""


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_kept_workers_serve_three_runs_on_every_node(run_in_allocation) -> None:
    cp = run_in_allocation(["-N3"], SCRIPT, timeout=120, env={"PYTHONPATH": REPO})
    runs = [json.loads(x[4:]) for x in cp.stdout.splitlines() if x.startswith("RUN ")]
    assert len(runs) == 3, cp.stdout + cp.stderr
    print("seconds per run:", [seconds for _, seconds in runs])
    values = [v for v, _ in runs]
    assert [node for node, *_ in values[0]] == ["node1"] * 2 + ["node2"] * 2 + ["node3"] * 2
    for k, run in enumerate(values, start=1):
        assert [sum_ for *_, sum_, _seen in run] == [6.0 * k] * 6
        assert [seen for *_, seen in run] == [list(range(1, k + 1))] * 6, "state kept"
    # The same processes, process group and store object in every run, on every node.
    first = [tuple(v[:4]) for v in values[0]]
    assert all([tuple(v[:4]) for v in run] == first for run in values)
    assert len({pid for _, pid, *_ in first}) == 6
