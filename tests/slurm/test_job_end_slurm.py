"""``scancel`` of a job (as at its time limit): SLURM sends SIGTERM to the batch script (the
launcher) and to every process of the agents' step (agents, spawners, workers), and SIGKILL
after KillWait (5 s on the test cluster). The workers keep that time to checkpoint: one
SIGTERM each, no kill of slurmrun's own. (Preemption: tests/slurm/test_preemption_slurm.py.)
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.slurm.slurm_helpers import wait_for
from tests.slurm.test_preemption_slurm import _ready, _submit

DRIVER = """
import os, pathlib, signal, time
import slurmrun

def train():
    rank = os.environ["RANK"]
    sigterms = []
    signal.signal(signal.SIGTERM, lambda *_: sigterms.append(time.time()))
    pathlib.Path(f"ready.{rank}").touch()
    while not sigterms:
        time.sleep(0.1)
    time.sleep(3.5)  # longer than slurmrun's own grace (3 s), within KillWait (5 s)
    pathlib.Path(f"checkpoint.{rank}").write_text(str(len(sigterms)))

try:
    slurmrun.launch(train, backend=None)
except BaseException as e:
    print("raised", type(e).__name__, e, sep="\\n", flush=True)
"""


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_a_cancelled_jobs_workers_keep_killwait_to_checkpoint(
    slurm_cluster, tmp_path, node_processes
):
    (tmp_path / "driver.py").write_text(DRIVER)
    job_id = _submit(tmp_path, f"{sys.executable} driver.py\n")
    wait_for(lambda: _ready(tmp_path), 90, "both ranks ready", job_id=job_id)
    subprocess.run(["scancel", job_id], check=True, timeout=30)
    time.sleep(6)  # KillWait, and a second
    out = (tmp_path / "job.out").read_text()
    assert [(tmp_path / f"checkpoint.{r}").read_text() for r in (0, 1)] == ["1", "1"], out
    assert "raised\nSystemExit\n143" in out  # the launcher's own SIGTERM
    assert node_processes() == {}
