"""Executes a notebook that uses a warm launcher, with a real Jupyter kernel (nbclient).

    python tests/notebook_driver.py OUT_DIR [LAUNCHER_KWARGS]

Run by tests/test_notebook.py on localhost and, inside ``salloc``, by
tests/slurm/test_notebook_slurm.py: the kernel inherits this process's environment (the
allocation's SLURM_* variables, PYTHONPATH). The cells: define a function; run it on every
worker (rank 0's output and tqdm bar in the cell's output); run again on the same agents;
run a function that sleeps, interrupted with ``KernelManager.interrupt_kernel`` once every
worker wrote its pid; run once more; close. Writes the executed notebook (``run.ipynb``) and
``summary.json`` (each cell's outputs, and whether the interrupted run's workers are gone)
into OUT_DIR.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import nbformat
import psutil
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

START_WITHIN = 300.0  # bounds for a loaded 2-core machine (agents start, torch imports)
GONE_WITHIN = 60.0
CELL_TIMEOUT = 600

CELLS = [
    """\
import os
import sys
import time

import slurmrun
from tqdm import tqdm


def hello(steps: int) -> int:
    import torch.distributed as dist

    rank = dist.get_rank()
    print(f"hello from rank {rank} of {dist.get_world_size()}", flush=True)
    for _ in tqdm(range(steps), file=sys.stdout, mininterval=0, ascii=True, ncols=60):
        time.sleep(0.01)
    dist.barrier()
    return rank


def agent_pid() -> int:
    import psutil

    return psutil.Process().parent().parent().pid  # worker -> spawner -> agent


def sleep_forever(pid_dir: str) -> None:
    import torch.distributed as dist

    with open(os.path.join(pid_dir, str(dist.get_rank())), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(3600)
""",
    "launcher = slurmrun.Launcher({kwargs}).open()  # keeps the agents until close",
    "result = launcher.run(hello, (30,))\nprint('ranks:', result.values())",
    "first = launcher.run(agent_pid).values()\nprint('agents:', sorted(set(first)))",
    "launcher.run(sleep_forever, ({pid_dir!r},))",
    "again = launcher.run(agent_pid).values()\nprint('agents:', sorted(set(again)))",
    "launcher.close()",
]


def _outputs(cell: Any) -> dict[str, Any]:
    """A cell's stdout and stderr (stream outputs joined, raw) and its error's name."""
    out: dict[str, Any] = {"stdout": "", "stderr": "", "error": None}
    for output in cell.get("outputs", []):
        if output["output_type"] == "stream":
            out[output["name"]] += output["text"]
        elif output["output_type"] == "error":
            out["error"] = output["ename"]
    return out


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait_gone(pids: list[int]) -> list[int]:
    deadline = time.monotonic() + GONE_WITHIN
    while (alive := _alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def main(out_dir: str, kwargs: str) -> None:
    """Executes the notebook cell by cell; interrupts the kernel during the sleeping run."""
    out = Path(out_dir)
    pid_dir = out / "pids"
    pid_dir.mkdir(parents=True, exist_ok=True)
    source = [
        c.replace("{kwargs}", kwargs).replace("{pid_dir!r}", repr(str(pid_dir))) for c in CELLS
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in source])
    km = KernelManager(kernel_name="python3")
    client = NotebookClient(nb, km=km, timeout=CELL_TIMEOUT, allow_errors=True)
    summary: dict[str, Any] = {}
    with client.setup_kernel(cwd=str(out)):
        for index in range(4):
            client.execute_cell(nb.cells[index], index)
        sleeping = threading.Thread(target=client.execute_cell, args=(nb.cells[4], 4))
        sleeping.start()
        deadline = time.monotonic() + START_WITHIN
        while time.monotonic() < deadline and sleeping.is_alive():
            if len(os.listdir(pid_dir)) >= _world_size(nb.cells[2]):
                break
            time.sleep(0.1)
        pids = [int((pid_dir / name).read_text()) for name in os.listdir(pid_dir)]
        summary["workers_started"] = len(pids)
        km.interrupt_kernel()
        sleeping.join(timeout=CELL_TIMEOUT)
        summary["interrupted_cell_returned"] = not sleeping.is_alive()
        summary["workers_alive_after_interrupt"] = _wait_gone(pids)
        for index in range(5, len(nb.cells)):
            client.execute_cell(nb.cells[index], index)
    summary["cells"] = [_outputs(cell) for cell in nb.cells]
    nbformat.write(nb, str(out / "run.ipynb"))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


def _world_size(cell: Any) -> int:
    """The number of ranks that the first run printed (``ranks: [0, 1, ...]``)."""
    for line in _outputs(cell)["stdout"].splitlines():
        if line.startswith("ranks: "):
            return len(json.loads(line[len("ranks: ") :]))
    raise RuntimeError(f"the first run printed no ranks: {_outputs(cell)}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")
