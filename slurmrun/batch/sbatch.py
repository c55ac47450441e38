"""The batch script that submitit writes for a job's parameters: what a dry run shows.

submitit has no public call that returns the script it would submit, so slurmrun renders it
here from the parameters it gives ``submitit.SlurmExecutor`` (``executor.parameters``), the
way submitit's ``SlurmExecutor`` does (submitit 1.5). tests/test_dry_run_script.py compares
the two over parameters users pass, so a submitit that writes its scripts otherwise fails
there rather than in a user's dry run.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["batch_script", "submitit_command"]

# submitit's defaults for what it always writes (or decides by).
_DEFAULTS: dict[str, Any] = {
    "job_name": "submitit",
    "time": 5,
    "nodes": 1,
    "signal_delay_s": 90,
    "array_parallelism": 256,
    "wckey": "submitit",
    "stderr_to_stdout": False,
    "use_srun": True,
}
# Parameters that are not sbatch options: submitit reads them, and writes no line for them.
_NOT_SBATCH = frozenset(
    {
        "map_count",
        "array_parallelism",
        "additional_parameters",
        "setup",
        "teardown",
        "signal_delay_s",
        "stderr_to_stdout",
        "srun_args",
        "use_srun",
    }
)
# submitit signals a job's end with SIGUSR2 (``SlurmJobEnvironment.USR_SIG``).
_SIGNAL = "USR2"


def submitit_command(folder: Path, python: str) -> str:
    """The command a submitit batch script runs: it loads the pickled call from `folder`."""
    return f"{python} -u -m submitit.core._submit {shlex.quote(str(folder))}"


def batch_script(parameters: Mapping[str, Any], folder: Path, python: str) -> str:
    """The batch script submitit submits for `parameters` into `folder` (``.../%j``).

    Args:
        parameters: the executor's parameters (with ``map_count`` for an array).
        folder: the executor's folder (absolute, ending in ``%j``).
        python: the (shell-quoted) interpreter the job runs.
    """
    given = {**_DEFAULTS, **{k: v for k, v in parameters.items() if v is not None}}
    sbatch = {k: v for k, v in given.items() if k not in _NOT_SBATCH}
    sbatch["signal"] = f"{_SIGNAL}@{given['signal_delay_s']}"
    if "num_gpus" in sbatch:  # submitit's older name
        sbatch["gpus_per_node"] = sbatch.pop("num_gpus")
    stdout = str(folder / "%j_%t_log.out")
    stderr = str(folder / "%j_%t_log.err")
    map_count = given.get("map_count")
    if map_count is not None:
        sbatch["array"] = f"0-{map_count - 1}%{min(map_count, given['array_parallelism'])}"
        stdout, stderr = stdout.replace("%j", "%A_%a"), stderr.replace("%j", "%A_%a")
    sbatch["output"] = stdout.replace("%t", "0")
    if not given["stderr_to_stdout"]:
        sbatch["error"] = stderr.replace("%t", "0")
    sbatch["open-mode"] = "append"
    sbatch.update(given.get("additional_parameters") or {})
    lines = ["#!/bin/bash", "", "# Parameters"]
    lines += [_flag(k, sbatch[k]) for k in sorted(sbatch)]
    if given.get("setup") is not None:
        lines += ["", "# setup", *given["setup"]]
    command = submitit_command(folder, python)
    if given["use_srun"]:
        errors = [] if given["stderr_to_stdout"] else ["--error", stderr]
        srun = ["srun", "--unbuffered", "--output", stdout, *errors, *given.get("srun_args", ())]
        command = f"{shlex.join(srun)} {command}"
    lines += ["", "# command", "export SUBMITIT_EXECUTOR=slurm", command, ""]
    if given.get("teardown") is not None:
        lines += ["", "# teardown", *given["teardown"]]
    return "\n".join(lines)


def _flag(key: str, value: Any) -> str:
    key = key.replace("_", "-")
    return f"#SBATCH --{key}" if value is True else f"#SBATCH --{key}={shlex.quote(str(value))}"
