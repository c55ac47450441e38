"""The agent process's entry point (``python -m slurmrun.agent_main``).

Importing torch dominates a launch, so the agent's first act is to start the forkserver that
imports it; the rest of the agent (`slurmrun.agent`, about 0.1 s of imports) loads while the
forkserver works. This module therefore imports only the standard library and
`slurmrun.environment` before the forkserver runs.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from multiprocessing import forkserver

from slurmrun.environment import ENV_FILE_VAR, FORWARDED_SIGNALS, EnvFileError, source_env_file

__all__ = ["main"]


def _prepare_environment() -> str | None:
    """Sources the env file into this process's environment; returns an error message."""
    env_file = os.environ.pop(ENV_FILE_VAR, "")
    if not env_file:
        return None
    try:
        os.environ.update(source_env_file(env_file, os.environ))
    except EnvFileError as e:
        return str(e)
    return None


def _start_forkserver() -> None:
    # Started before connecting so that the torch import overlaps the handshake and hand-out.
    # The forkserver never initialises CUDA: `import torch` alone does not.
    preload = [m for m in os.environ.get("SLURMRUN_PRELOAD", "torch").split(",") if m]
    multiprocessing.set_forkserver_preload([*preload, "slurmrun.worker"])
    forkserver.ensure_running()


def main() -> int:
    """Starts the forkserver, then runs the agent; returns its exit code."""
    secret_hex = os.environ.pop("SLURMRUN_SECRET", "")
    if not secret_hex:
        print(
            "slurmrun.agent: SLURMRUN_SECRET is not set; agents are started by slurmrun.launch",
            file=sys.stderr,
        )
        return 2
    if "SLURM_STEP_ID" in os.environ:
        # slurmstepd signals every process of the step (`scancel --signal`, `--signal=USR1@60`):
        # the agent must survive those, and workers get them directly. SIG_IGN is inherited by
        # the forkserver; workers restore the default before running the user's function.
        for signum in FORWARDED_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
    problem = _prepare_environment()  # before the forkserver, so that workers inherit it
    if problem is None:
        _start_forkserver()
    from slurmrun import agent  # noqa: PLC0415 - loads while the forkserver imports torch

    return agent.main(bytes.fromhex(secret_hex), problem)


def _on_sigterm(signum: int, frame: object) -> None:
    # SLURM's preemption and time limit: SIGTERM, then SIGKILL after KillWait. Workers get
    # SIGTERM from stop_workers() on the way out, and their grace period to checkpoint.
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _on_sigterm)
    code = main()
    # Workers are stopped and joined and the launcher's connection is closed: skip the
    # interpreter's teardown (~30 ms here), which every launch would wait for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
