"""A launcher in a SLURM step that gets SIGTERM: SLURM is likely ending the whole job, and its
SIGTERM reaches the workers itself, a moment before or after the launcher's END reaches their
agent. The workers get one SIGTERM, not two (a checkpointing handler runs once).

On localhost, with the agent's step variable set, as slurmstepd would leave it: the test plays
SLURM's part (SIGTERM to the agent and the worker) 0.3 s after the launcher's own SIGTERM: the
order that made `tests/slurm/test_job_end_slurm.py` fail now and then.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
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


def _worker_and_agent(
    tmp_path: Path, driver: subprocess.Popen[str]
) -> tuple[psutil.Process, psutil.Process]:
    """The worker that wrote its pid to ``ready`` (waited for), and its agent."""
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists() or not (tmp_path / "ready").read_text():
        assert time.monotonic() < deadline and driver.poll() is None, "no worker started"
        time.sleep(0.05)
    worker = psutil.Process(int((tmp_path / "ready").read_text()))
    return worker, worker.parent().parent()  # worker <- spawner <- agent


@pytest.mark.parametrize("slurm_signals", [True, False], ids=["slurm-too", "launcher-only"])
def test_a_sigtermed_launcher_in_a_step_leaves_its_workers_one_sigterm(tmp_path, slurm_signals):
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    for name in [n for n in env if n.startswith("SLURM_")]:
        del env[name]
    driver = subprocess.Popen([sys.executable, "driver.py"], cwd=tmp_path, env=env)
    try:
        worker, agent = _worker_and_agent(tmp_path, driver)
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


COUNTER = """
import signal, sys
signum = int(sys.argv[1])
signal.pthread_sigmask(signal.SIG_BLOCK, {signum})  # every send waits in the queue, counted below
print("ready", flush=True)
sys.stdin.read()  # until the test closes it
count = 0
while signal.sigtimedwait({signum}, 0) is not None:
    count += 1
print(count, flush=True)
"""


def _counted(send: Callable[[int, int], None]) -> str:
    """How many of the realtime signals that `send(pid, signum)` sent reached a group leader."""
    signum = signal.SIGRTMIN + 1
    child = subprocess.Popen(
        [sys.executable, "-c", COUNTER, str(signum)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        send(child.pid, signum)
        out, _ = child.communicate("", timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return out.strip()


def test_stopping_a_worker_signals_it_once():
    """The agent's signal reaches a worker (which leads its own group, as the spawner makes it)
    once: its pid and its group both signalled ran its handler twice whenever the first
    arrived in between (a loaded machine). So for a stray that leads a group. A realtime
    signal, blocked, is never merged: every send is counted."""
    from slurmrun.node.spawner import WorkerProcess
    from slurmrun.node.spawner_process import signal_stray
    from slurmrun.node.supervisor import signal_group

    reaped_r, reaped_w = os.pipe()  # the spawner's status pipe: never written while it lives
    try:
        sent = _counted(lambda pid, s: signal_group(WorkerProcess(pid, reaped_r), s))
    finally:
        os.close(reaped_w)
        os.close(reaped_r)
    assert sent == "1"
    assert _counted(signal_stray) == "1"


DIES_OF_SIGTERM = """
import os, pathlib
os.environ["SLURM_STEP_ID"] = "0"  # the agent (started from here) acts as in a SLURM step
import slurmrun

def wait():
    import time
    pathlib.Path("ready").write_text(str(os.getpid()))
    time.sleep(60)

try:
    slurmrun.launch(wait, backend=None, workers_per_host=1, extra_env_vars=("SLURM_STEP_ID",))
except BaseException as e:
    print("raised", type(e).__name__, flush=True)
"""


def test_a_worker_sigtermed_a_moment_before_its_agent_is_told_as_slurm_ending_the_step(tmp_path):
    """scancel: SLURM's SIGTERM reaches every process of the step, in no order. A worker that
    died of it before the agent's own arrived was reported as a worker's failure
    (WorkerFailedError), not SLURM ending the step (AgentFailedError): the `scancel_job` fault
    on the cluster, now and then."""
    (tmp_path / "driver.py").write_text(DIES_OF_SIGTERM)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = str(Path(__file__).parents[1])
    driver = subprocess.Popen(
        [sys.executable, "driver.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        worker, agent = _worker_and_agent(tmp_path, driver)
        worker.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        with contextlib.suppress(psutil.NoSuchProcess):  # the old code had ended the run
            agent.send_signal(signal.SIGTERM)
        out, _ = driver.communicate(timeout=30)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert "raised AgentFailedError" in out, out


def test_a_workers_exit_code_polled_from_several_threads_at_once_is_read_by_all() -> None:
    """The supervisor and a stacks sample poll a worker at once: each must get its code (3),
    none an empty pipe taken for a SIGKILL, nor a closed descriptor."""
    import struct
    import threading

    from slurmrun.node.spawner import WorkerProcess

    for _ in range(200):
        status_r, status_w = os.pipe()
        os.write(status_w, struct.pack("!i", 3))
        os.close(status_w)
        worker = WorkerProcess(12345, status_r)
        start = threading.Barrier(4)
        seen: list[object] = []

        def poll(
            worker: WorkerProcess = worker,
            start: threading.Barrier = start,
            seen: list[object] = seen,
        ) -> None:
            start.wait()
            try:
                seen.append(worker.poll())
            except OSError as e:
                seen.append(e)

        threads = [threading.Thread(target=poll) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert seen == [3, 3, 3, 3], seen
