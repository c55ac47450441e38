"""A launcher in a SLURM step that gets SIGTERM: SLURM is likely ending the whole job, and its
SIGTERM reaches the workers itself, a moment before or after the launcher's END reaches their
agent. The workers get one SIGTERM, not two (a checkpointing handler runs once).

On localhost, with the agent's step variable set, as slurmstepd would leave it: the test plays
SLURM's part (SIGTERM to the agent and the worker) 0.3 s after the launcher's own SIGTERM: the
order that made `tests/slurm/test_job_end_slurm.py` fail now and then.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

DRIVER = """
import os, pathlib, signal, time
os.environ["SLURM_STEP_ID"] = "0"  # the agent (started from here) acts as in a SLURM step
import slurmrun

def train():
    sigterms = []
    signal.signal(signal.SIGTERM, lambda *_: sigterms.append(time.time()))
    pathlib.Path("ready").write_text(str(os.getpid()))
    while not sigterms:
        time.sleep(0.05)
    time.sleep(1.5)  # the checkpoint: a second SIGTERM would arrive while it is written
    pathlib.Path("checkpoint").write_text(str(len(sigterms)))

try:
    slurmrun.launch(train, backend=None, workers_per_host=1, extra_env_vars=("SLURM_STEP_ID",))
except BaseException as e:
    print("raised", type(e).__name__, e, flush=True)
"""


@pytest.mark.parametrize("slurm_signals", [True, False], ids=["slurm-too", "launcher-only"])
def test_a_sigtermed_launcher_in_a_step_leaves_its_workers_one_sigterm(tmp_path, slurm_signals):
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    for name in [n for n in env if n.startswith("SLURM_")]:
        del env[name]
    driver = subprocess.Popen([sys.executable, "driver.py"], cwd=tmp_path, env=env)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists() or not (tmp_path / "ready").read_text():
            assert time.monotonic() < deadline and driver.poll() is None, "no worker started"
            time.sleep(0.05)
        worker = psutil.Process(int((tmp_path / "ready").read_text()))
        agent = worker.parent().parent()  # worker <- spawner <- agent
        driver.send_signal(signal.SIGTERM)
        if slurm_signals:  # SLURM's own SIGTERM to the step's processes, a moment later
            time.sleep(0.3)
            agent.send_signal(signal.SIGTERM)
            worker.send_signal(signal.SIGTERM)
        driver.wait(timeout=30)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert (tmp_path / "checkpoint").read_text() == "1"
