"""A node's health checks before its workers start: built-in ones, and ``health_check=...``.

Before it forks a run's fresh workers (kept workers need none: they ran the last run), the
agent checks, in this order:

- the log directory, where it writes its workers' logs: writable (a file made and removed);
- the GPUs the job gave the node (``CUDA_VISIBLE_DEVICES``, else SLURM's ``SLURM_STEP_GPUS``,
  ``SLURM_JOB_GPUS``): ``nvidia-smi -L`` lists at least as many, and each is usable (a child
  process with torch, where torch has CUDA, makes a tensor on each; the agent itself never
  touches CUDA, which its spawner must not inherit). ``gpu_check="auto"`` (the default): only
  on a node with NVIDIA's driver (``nvidia-smi`` on the PATH, or ``/proc/driver/nvidia``), so
  that GPUs that SLURM names on a node without one (a CPU node's gres, a test cluster's fakes)
  are not judged; ``"on"``: there too, which then fails saying so; ``"off"``: never;
- the launch's command (``health_check``), in a shell, with the agent's environment and
  ``GROUP_RANK`` (the node's index).

A failing check is told to the launcher (`slurmrun.protocol.Unhealthy`),
which fails the run with `slurmrun.NodeUnhealthyError`: the node is then lost, as one whose
agent died (``min_hosts``, spares).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping

from slurmrun import protocol
from slurmrun.node.link import LauncherConnection

__all__ = ["HEALTH_TIMEOUT", "check_gpus", "check_health", "check_log_dir", "healthy"]

HEALTH_TIMEOUT = 60.0  # seconds a check may take
_TAIL_LINES = 10
_GPU_VARIABLES = ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS")
_DRIVER = "/proc/driver/nvidia/version"
# Run by the agent's interpreter with the GPUs' CUDA_VISIBLE_DEVICES: a tensor on each GPU.
# Without torch, or with a torch built without CUDA, there is nothing to try: not the node's
# fault (nvidia-smi has judged the node).
_USABLE = """
import sys
try:
    import torch
except ImportError:
    sys.exit(0)
if torch.version.cuda is None:
    sys.exit(0)
want = int(sys.argv[1])
seen = torch.cuda.device_count()
if seen < want:
    sys.exit(f"torch sees {seen} of the {want} GPU(s) given")
for i in range(want):
    try:
        torch.ones(1, device=f"cuda:{i}").add_(1).item()
    except Exception as e:
        sys.exit(f"GPU {i} (of those given) is not usable: {type(e).__name__}: {e}")
"""


def healthy(start: protocol.Start, launcher: LauncherConnection) -> bool:
    """Runs `start`'s health checks; if one fails, tells the launcher why and cuts the link."""
    why = check_log_dir(start.log_dir) or check_gpus(os.environ, start.gpu_check)
    if why is None and start.health_check:
        why = check_health(start.health_check, start.node_rank)
    if why is None:
        return True
    with contextlib.suppress(OSError):  # cut: the launcher sees the connection end
        launcher.send(protocol.Unhealthy(run=start.run, why=why).header())
    launcher.cut(f"failed its health check: {why}")
    return False


def check_log_dir(log_dir: str | None) -> str | None:
    """Why the workers' log directory is not usable here, or None (also when there is none)."""
    if log_dir is None:
        return None
    try:
        os.makedirs(log_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=log_dir, prefix=".health-"):
            pass
    except OSError as e:
        return f"the log directory {log_dir} is not writable here: {e}"
    return None


def given_gpus(environ: Mapping[str, str]) -> tuple[str, list[str]] | None:
    """The variable that gives this node's GPUs, and their ids; None: none are given."""
    for name in _GPU_VARIABLES:
        value = environ.get(name, "").strip()
        if not value:
            continue
        ids = []
        for entry in (item.strip() for item in value.split(",")):
            # CUDA stops at the first invalid entry ("-1" hides every GPU; SLURM writes
            # "NoDevFiles" for GPUs configured without device files).
            if not entry or entry == "NoDevFiles" or entry.startswith("-"):
                break
            ids.append(entry)
        return (f"{name}={value}", ids) if ids else None
    return None


def check_gpus(environ: Mapping[str, str], gpu_check: str) -> str | None:
    """Why the GPUs given to this node are not usable, or None (see the module's docstring).

    Args:
        environ: the agent's environment (what SLURM gave the node).
        gpu_check: ``"auto"``, only where NVIDIA's driver is; ``"on"``, wherever GPUs are
            given; ``"off"``, never.
    """
    given = None if gpu_check == "off" else given_gpus(environ)
    if given is None:
        return None
    where, ids = given
    smi = shutil.which("nvidia-smi", path=environ.get("PATH"))
    if smi is None and not os.path.exists(_DRIVER):
        if gpu_check != "on":
            return None
        return (
            f"GPU check: {where} gives {len(ids)} GPU(s), but this node has no NVIDIA driver "
            f"(no nvidia-smi on the PATH, no {_DRIVER}); gpu_check='off' skips the check"
        )
    if smi is not None:
        why, out = _run([smi, "-L"], dict(environ), "nvidia-smi -L")
        if why is not None:
            return f"GPU check: {why}"
        listed = sum(1 for line in out.splitlines() if line.startswith("GPU "))
        if listed < len(ids):
            return f"GPU check: {where} gives {len(ids)} GPU(s), nvidia-smi -L lists {listed}"
    env = {**environ, "CUDA_VISIBLE_DEVICES": ",".join(ids)}
    why, _ = _run([sys.executable, "-c", _USABLE, str(len(ids))], env, "a tensor on each GPU")
    return None if why is None else f"GPU check ({where}): {why}"


def _run(command: list[str], env: dict[str, str], what: str) -> tuple[str | None, str]:
    """Runs a built-in check's `command`: why it failed (None: it passed), and its output."""
    try:
        done = subprocess.run(
            command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, timeout=HEALTH_TIMEOUT, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"{what} did not finish within {HEALTH_TIMEOUT:g} s", ""
    except OSError as e:
        return f"{what} could not run: {e}", ""
    out = done.stdout.decode(errors="replace")
    if done.returncode == 0:
        return None, out
    last = out.rstrip().splitlines()[-1:] or [f"exit status {done.returncode}"]
    return f"{what} failed: {last[0]}", out


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
