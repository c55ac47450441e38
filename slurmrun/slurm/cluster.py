"""Whether SLURM can take a job from here, and where a submitted job went.

Before submitting, `check_slurm` makes sure that SLURM's commands are here and that a
controller answers (``scontrol ping``: about a second when none does, where sbatch tries
for 20 s, or 60 s for a missing configuration file). A controller's host name that does not
resolve is said first, at once (`controller_hosts` read from slurm.conf): scontrol would
try ten times, a second apart. After submitting, `placement` says which
cluster and partition took the job: SLURM's configuration on a login node may name another
cluster than the one meant.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable, Sequence

from slurmrun.slurm.fields import config_fields, first_record
from slurmrun.slurm.scontrol import scontrol

__all__ = [
    "SlurmUnavailableError",
    "check_slurm",
    "controller_hosts",
    "placement",
    "slurm_version",
    "unresolved_controllers",
]

COMMANDS = ("sbatch", "srun")  # submitit needs srun on PATH even to write the batch script
PING_TIMEOUT = 10.0  # scontrol ping gives up on a silent controller by itself, sooner
QUERY_TIMEOUT = 10.0
RESOLVE_TIMEOUT = 3.0  # a slow DNS: then scontrol ping decides, within PING_TIMEOUT
DEFAULT_CONF = "/etc/slurm/slurm.conf"  # SLURM's packages' default; a build may differ
# slurm.conf's controller lines: SlurmctldHost=name[(address)]; before 18.08 ControlMachine
# and BackupController (with ControlAddr and BackupAddr).
_CONTROLLER_LINE = re.compile(
    r"^\s*(SlurmctldHost|ControlMachine|BackupController)\s*=\s*([^\s(#]+)(?:\(([^)\s]+)\))?",
    re.IGNORECASE | re.MULTILINE,
)


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
    unresolved = unresolved_controllers()
    if unresolved:
        names = " and ".join(unresolved)
        raise SlurmUnavailableError(
            f"the SLURM controller's host {names} (SlurmctldHost in {config}) does not resolve "
            f"to an address here, so nothing was submitted. Check that {config} is your "
            "cluster's, and that this machine's DNS (or /etc/hosts) knows that host (`sinfo` "
            "fails the same way; your cluster's admins can tell)."
        )
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


def controller_hosts(path: str) -> list[tuple[str, str | None]]:
    """The controllers that slurm.conf at `path` names: ``(host, its address or None)``.

    ``[]`` when the file cannot be read or names none (a configless setup, an ``Include``).
    """
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return []
    return [(name, address or None) for _, name, address in _CONTROLLER_LINE.findall(text)]


def unresolved_controllers(path: str | None = None) -> list[str]:
    """The controllers of slurm.conf when none of them resolves; else ``[]``.

    `path`: the file (default: ``$SLURM_CONF``, else `DEFAULT_CONF`).

    Each is looked up in a thread of its own, for `RESOLVE_TIMEOUT` at most: a host still
    being looked up counts as resolving (scontrol ping then says more).
    """
    hosts = controller_hosts(path or os.environ.get("SLURM_CONF") or DEFAULT_CONF)
    failed: list[str] = []

    def look_up(host: str, address: str | None) -> None:
        try:
            socket.getaddrinfo(address or host, None)
        except (OSError, UnicodeError):  # socket.gaierror: no such name
            failed.append(host if address is None else f"{host}({address})")

    threads = [threading.Thread(target=look_up, args=h, daemon=True) for h in hosts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(RESOLVE_TIMEOUT)
    return failed if hosts and len(failed) == len(hosts) else []


def _said(*outputs: str | bytes | None) -> str:
    """What a command printed, on one line (without scontrol's RESTORE SLURMCTLD banner).

    Lines said again but for SLURM's retry count (``..., attempt number 3``) are said once.
    """
    text = "".join(o.decode(errors="replace") if isinstance(o, bytes) else o or "" for o in outputs)
    lines = [re.sub(r", attempt number -?\d+$", "", line.strip()) for line in text.splitlines()]
    unique = dict.fromkeys(line for line in lines if line and not line.startswith("*"))
    return " / ".join(unique)


def placement(job_id: str, *, timeout: float = QUERY_TIMEOUT) -> str:
    """Where job `job_id` went, e.g. ``cluster slurmtest, partition debug``.

    Read from ``scontrol show job`` (partition) and ``scontrol show config`` (the controller's
    ClusterName); ``""`` where neither can be read.
    """
    job = scontrol(["show", "job", job_id.partition("_")[0]], timeout) or ""
    config = scontrol(["show", "config"], timeout) or ""
    cluster = config_fields(config).get("ClusterName")
    partition = first_record(job).fields.get("Partition")  # an array's first element
    parts = [
        f"cluster {cluster}" if cluster else "",
        f"partition {partition}" if partition else "",
    ]
    return ", ".join(part for part in parts if part)


def slurm_version(
    scontrol: Callable[[Sequence[str]], str | None] = scontrol,
) -> str | None:
    """The SLURM controller's version (``26.05.5``), or None when scontrol does not answer.

    Read from the ``SLURM_VERSION`` field of ``scontrol show config``: the controller's, where
    ``scontrol --version`` names the client's. Where SLURM versions differ, their outputs are
    read by fields; only a behaviour that no field shows is decided by the release
    (`slurmrun.slurm.job_end.requeued_when_batch_ends`); ``slurmrun info`` shows it.

    Args:
        scontrol: runs scontrol with these arguments; its output, or None if it failed.
    """
    return config_fields(scontrol(["show", "config"]) or "").get("SLURM_VERSION") or None
