"""Whether this process is a task of a SLURM job step: one question, asked alike by all.

SLURM sets ``SLURM_STEP_ID`` (and its older spelling ``SLURM_STEPID``) in every process it
starts, the job's own shell included: there its value is one of SLURM's special step ids
(``SLURM_BATCH_SCRIPT`` 0xfffffffb in a batch script, ``SLURM_EXTERN_CONT`` 0xfffffffc,
``SLURM_INTERACTIVE_STEP`` 0xfffffffa, ``SLURM_PENDING_STEP`` 0xfffffffd), which 26.05
sets signed (``-5``) in a batch script, where older versions set nothing. A step that
``srun`` starts has a regular id: a number from 0 below ``SLURM_MAX_NORMAL_STEP_ID``
(0xfffffff0). The launcher and the agents
ask `step_id`; it imports nothing, so the agent's first module may ask it.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["MAX_NORMAL_STEP_ID", "step_id"]

MAX_NORMAL_STEP_ID = 0xFFFFFFF0
"""SLURM's ``SLURM_MAX_NORMAL_STEP_ID``: ids from here up (and negative ones) are special."""


def step_id(env: Mapping[str, str]) -> int | None:
    """The id of the SLURM step whose task this process is; None outside a step.

    Outside a step means: no ``SLURM_STEP_ID`` / ``SLURM_STEPID``, or one of SLURM's special
    ids (the batch script's, the extern or interactive step's, a pending step's: negative,
    or ``MAX_NORMAL_STEP_ID`` and above), or a value that is not a number.

    Args:
        env: the environment to read (``os.environ``, or an agent's).
    """
    value = (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or "").strip()
    if not value.isdigit():  # "-5" (26.05's batch script), "", or not SLURM's
        return None
    number = int(value)
    return number if number < MAX_NORMAL_STEP_ID else None
