"""Chaos on the 3-node SLURM test cluster: tests/chaos_driver.py inside ``salloc -N3``.

A warm launcher (one srun step of 3 agents, 2 workers each) meets a random fault at a random
moment of each run, each followed by a clean run; nothing may be left on any node.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

DRIVER = Path(__file__).resolve().parents[1] / "chaos_driver.py"


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_chaos_on_three_nodes_leaves_no_hang_no_process_no_lost_result_or_byte(
    run_in_allocation, node_processes
):
    seed = random.randrange(1 << 30)
    script = f"""
        import runpy, sys
        sys.argv = [{str(DRIVER)!r}, "8", "{seed}", "2"]
        runpy.run_path({str(DRIVER)!r}, run_name="__main__")
    """
    done = run_in_allocation(["-N3", "--ntasks-per-node=2"], script, timeout=150, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    said = f"seed {seed}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert done.returncode == 0 and lines, said
    report = dict(item.split("=", 1) for item in lines[0].split()[1:])
    assert report["problems"] == "0", said
    assert (report["world"], report["faults"], report["clean_ok"]) == ("6", "8", "8"), said
    assert node_processes() == {}, said
