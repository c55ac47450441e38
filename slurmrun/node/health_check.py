"""A node's health check before its workers start (``Launcher(health_check=...)``).

The agent runs the launch's command in a shell before it forks a run's fresh workers (kept
workers need none: they ran the last run), with the agent's environment and ``GROUP_RANK``
(the node's index). A failing check is told to the launcher (`slurmrun.protocol.Unhealthy`),
which fails the run with `slurmrun.NodeUnhealthyError`: the node is then lost, as one whose
agent died (``min_hosts``, spares).
"""

from __future__ import annotations

import contextlib
import os
import subprocess

from slurmrun import protocol
from slurmrun.node.link import LauncherConnection

__all__ = ["HEALTH_TIMEOUT", "check_health", "healthy"]

HEALTH_TIMEOUT = 60.0  # seconds a check may take
_TAIL_LINES = 10


def healthy(start: protocol.Start, launcher: LauncherConnection) -> bool:
    """Runs `start`'s health check; if it fails, tells the launcher why and cuts the link."""
    why = check_health(start.health_check or "", start.node_rank)
    if why is None:
        return True
    with contextlib.suppress(OSError):  # cut: the launcher sees the connection end
        launcher.send(protocol.Unhealthy(run=start.run, why=why).header())
    launcher.cut(f"failed its health check: {why}")
    return False


def check_health(command: str, node_rank: int) -> str | None:
    """Runs `command`; returns why the node is unhealthy, or None if it passed."""
    env = {**os.environ, "GROUP_RANK": str(node_rank)}
    try:
        done = subprocess.run(  # noqa: S602 - the launch's own command, run as the user asked
            command,
            shell=True,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=HEALTH_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"{command!r} did not finish within {HEALTH_TIMEOUT:g} s"
    except OSError as e:
        return f"{command!r} could not run: {e}"
    if done.returncode == 0:
        return None
    lines = done.stdout.decode(errors="replace").rstrip().splitlines()[-_TAIL_LINES:]
    status = (
        f"exit status {done.returncode}" if done.returncode > 0 else f"signal {-done.returncode}"
    )
    why = f"{command!r} failed ({status})"
    if not lines:
        return why
    # Its last line on the first (what a lost host's reason keeps), then the rest.
    return f"{why}: {lines[-1]}" + ("\n" + "\n".join(lines) if len(lines) > 1 else "")
