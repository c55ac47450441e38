"""The agent process's entry point (``python -m slurmrun.node.agent_main``).

Importing torch dominates a launch, so the agent's first act is to fork the spawner that
imports it (`slurmrun.node.spawner`); the rest of the agent (`slurmrun.node.agent`, about 0.1 s of
imports) loads while the spawner works. This module therefore imports only the standard
library, `slurmrun.environment`, `slurmrun.protocol`, `slurmrun.node.proctitle` and
`slurmrun.node.spawner` before the fork.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

from slurmrun.environment import FORWARDED_SIGNALS, EnvFileError, source_env_file
from slurmrun.log_mark import unseen_mark
from slurmrun.node.proctitle import AGENT_COMM, node_name, set_title
from slurmrun.node.spawner import Spawner, forget_variable
from slurmrun.slurm.step import step_id
from slurmrun.variables import (
    ENV_FILE_VAR,
    LEARN_PRELOADS_VAR,
    PRELOAD_LATER_VAR,
    PRELOAD_VAR,
    SECRET_STDIN_VAR,
    SECRET_VAR,
)
from slurmrun.versions import missing_dependency

__all__ = ["main", "read_variables", "run"]

_SECRET_KEY = os.fsencode(SECRET_VAR)


def _read_line(fd: int) -> bytes:
    """One line from `fd`, read byte by byte: nothing after it is taken from the pipe."""
    line = b""
    while not line.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            break
        line += byte
    return line.strip()


def _read_exactly(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise EOFError("stdin ended before the agent's variables did")
        data += chunk
    return data


def read_variables(fd: int) -> None:
    """Takes an ssh agent's variables from `fd` into the environment (and its PYTHONPATH).

    They come as one line with the length of a JSON object of names to values, then the
    object (`slurmrun.launcher.agents.ssh.stdin_block`): never on a command line, where every user
    of the host can read them. The secret follows them, read after the spawner's fork.
    """
    size = int(_read_line(fd).decode("ascii"))
    variables = json.loads(_read_exactly(fd, size))
    os.environ.update(variables)
    # What the interpreter would have done with it at startup: the spawner imports from it.
    entries = [p for p in variables.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[1:1] = [p for p in entries if p not in sys.path]


def _exit_on_stdin_eof() -> None:
    """Ends the agent (SIGTERM: workers stopped on the way out) when its stdin closes."""
    while os.read(0, 4096):
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def _prepare_environment() -> str | None:
    """Sources the env file into this process's environment; returns an error message."""
    env_file = os.environ.pop(ENV_FILE_VAR, "")
    if not env_file:
        return None
    # Not dict(os.environ): that would decode the secret into a str, which the spawner and
    # every worker would inherit.
    environ = {name: os.environ[name] for name in os.environ if name != SECRET_VAR}
    try:
        os.environ.update(source_env_file(env_file, environ))
    except EnvFileError as e:
        return str(e)
    return None


def main() -> int:
    """Starts the worker spawner, then runs the agent; returns its exit code."""
    # The secret must never enter a Python object in this process before the spawner is
    # forked: workers are forks of the spawner and would inherit it (a str cannot be wiped).
    # os.environb hands out the bytes object the interpreter made at startup, not a copy; the
    # spawner wipes that object and its environment blocks (forget_variable).
    from_stdin = os.environ.get(SECRET_STDIN_VAR) == "1"  # an ssh agent (launcher/agents/ssh.py)
    if from_stdin:
        read_variables(0)  # before anything reads the environment
    if not from_stdin and not os.environb.get(_SECRET_KEY):
        print(
            f"slurmrun.node.agent: {SECRET_VAR} is not set; agents are started by slurmrun.launch",
            file=sys.stderr,
        )
        return 2
    # First, before the other agents' hellos can end the step: a node that cannot see the
    # log directory removes what SLURM created there for it.
    unseen = unseen_mark(os.environ)
    if step_id(os.environ) is not None:
        # slurmstepd signals every process of the step (`scancel --signal`, `--signal=USR1@60`):
        # the agent must survive those, and workers get them directly. SIG_IGN is inherited by
        # the spawner; workers restore the default before running the user's function.
        for signum in FORWARDED_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
    problem = _prepare_environment()  # before the spawner, so that workers inherit it
    if problem is None:
        # The spawner never initialises CUDA: `import torch` alone does not.
        preload = [m for m in os.environ.get(PRELOAD_VAR, "torch").split(",") if m]
        later = [m for m in os.environ.get(PRELOAD_LATER_VAR, "").split(",") if m]
        spawner: Spawner | str = Spawner.start(
            preload,
            forget=[SECRET_VAR],
            later=later,
            learn=os.environ.get(LEARN_PRELOADS_VAR) == "1",
        )
    else:
        spawner = problem
    # Before any thread starts: threads inherit the comm (top's name) of their creator.
    set_title(f"slurmrun agent ({node_name(os.environ)})", AGENT_COMM)
    if from_stdin:
        # Read only now, after the fork: the spawner holds no copy. The pipe then stays open
        # for the agent's life; its end (the launcher or the connection gone) ends the agent.
        secret = bytes.fromhex(_read_line(0).decode("ascii"))
        threading.Thread(target=_exit_on_stdin_eof, daemon=True).start()
    else:
        secret = bytes.fromhex(os.environb[_SECRET_KEY].decode("ascii"))
        forget_variable(SECRET_VAR)  # out of /proc/<agent>/environ too
    try:
        from slurmrun.node import agent  # noqa: PLC0415 - loads while the spawner imports torch
    except ModuleNotFoundError as e:  # this Python lacks a package slurmrun needs
        if isinstance(spawner, Spawner):
            spawner.close()
        print(f"slurmrun.node.agent: {missing_dependency(e.name or str(e))}", file=sys.stderr)
        return 1
    return agent.main(secret, spawner, unseen)


def _on_sigterm(signum: int, frame: object) -> None:
    # Outside a SLURM step (a local or ssh agent): workers get SIGTERM from stop_workers() on
    # the way out, then the launcher's grace period. In a step the agent, once connected,
    # takes SIGTERM as SLURM ending the step instead (`agent.Agent.on_slurm_sigterm`).
    raise SystemExit(128 + signum)


def run() -> None:
    """Runs the agent process to its end (``python -m``, or an ssh agent's bootstrap)."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    code = main()
    # Workers are stopped and joined and the launcher's connection is closed: skip the
    # interpreter's teardown (~30 ms here), which every launch would wait for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
