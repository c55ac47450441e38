"""Whether SLURM can take a job from here, and where a submitted job went.

Before submitting, `check_slurm` makes sure that SLURM's commands are here and that a
controller answers (``scontrol ping``: about a second when none does, where sbatch tries
for 20 s, or 60 s for a missing configuration file). After submitting, `placement` says which
cluster and partition took the job: SLURM's configuration on a login node may name another
cluster than the one meant.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from slurmrun.slurm.scontrol import scontrol, scontrol_fields

__all__ = ["SlurmUnavailableError", "check_slurm", "placement"]

COMMANDS = ("sbatch", "srun")  # submitit needs srun on PATH even to write the batch script
PING_TIMEOUT = 10.0  # scontrol ping gives up on a silent controller by itself, sooner
QUERY_TIMEOUT = 10.0


class SlurmUnavailableError(RuntimeError):
    """SLURM cannot take a job from this machine (no commands, or no controller answers)."""


def check_slurm(*, ping: bool = True, timeout: float = PING_TIMEOUT) -> None:
    """Raises unless SLURM's commands are on PATH and (with `ping`) a controller answers.

    Raises:
        SlurmUnavailableError: what is missing or silent, and what to do about it.
    """
    missing = [name for name in COMMANDS if shutil.which(name) is None]
    if missing:
        raise SlurmUnavailableError(
            f"{' and '.join(missing)} not found on PATH: SLURM's commands are not installed "
            "on this machine (or not on PATH), so no job can be submitted from here. Submit "
            "from a login node of your cluster (where SLURM's commands may need `module load "
            "slurm`), or run here without SLURM: `slurmrun SCRIPT.py` or slurmrun.launch()."
        )
    scontrol = shutil.which("scontrol")
    if not ping or scontrol is None:
        return
    where = os.environ.get("SLURM_CONF")
    if where and not os.path.isfile(where):  # SLURM's commands would retry it for 60 s
        raise SlurmUnavailableError(
            f"SLURM_CONF={where}: no such file, so SLURM's commands cannot find the cluster. "
            "Point SLURM_CONF at your cluster's slurm.conf, or unset it to use SLURM's default."
        )
    config = f"SLURM_CONF={where}" if where else "SLURM's default configuration file"
    advice = (
        f"Check that {config} is your cluster's (its SlurmctldHost), that this machine can "
        "reach that host, and that slurmctld runs there (`sinfo` fails the same way; your "
        "cluster's admins can tell)."
    )
    try:
        done = subprocess.run(
            [scontrol, "ping"], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as e:
        said = _said(e.stdout, e.stderr)
        raise SlurmUnavailableError(
            f"no SLURM controller answered `scontrol ping` within {timeout:g} s"
            f"{f' ({said})' if said else ''}, so nothing was submitted. {advice}"
        ) from None
    if " is UP" in done.stdout:
        return
    said = _said(done.stdout, done.stderr) or "no output"
    raise SlurmUnavailableError(
        f"no SLURM controller answers (`scontrol ping`: {said}), so nothing was submitted. {advice}"
    )


def _said(*outputs: str | bytes | None) -> str:
    """What a command printed, on one line (without scontrol's RESTORE SLURMCTLD banner)."""
    text = "".join(o.decode(errors="replace") if isinstance(o, bytes) else o or "" for o in outputs)
    lines = [line.strip() for line in text.splitlines()]
    return " / ".join(line for line in lines if line and not line.startswith("*"))


def placement(job_id: str, *, timeout: float = QUERY_TIMEOUT) -> str:
    """Where job `job_id` went, e.g. ``cluster slurmtest, partition debug``.

    Read from ``scontrol show job`` (partition) and ``scontrol show config`` (the controller's
    ClusterName); ``""`` where neither can be read.
    """
    job = scontrol(["show", "job", "-o", job_id.partition("_")[0]], timeout) or ""
    config = scontrol(["show", "config"], timeout) or ""
    cluster = scontrol_fields(config).get("ClusterName")
    partition = scontrol_fields(job).get("Partition")  # an array's first element: the first wins
    parts = [
        f"cluster {cluster}" if cluster else "",
        f"partition {partition}" if partition else "",
    ]
    return ", ".join(part for part in parts if part)
