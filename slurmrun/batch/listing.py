"""`slurmrun.batch(folder)`: the jobs submitted into a folder, with their states."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurmrun.batch.folder import base_folder, check_folder, submitted_jobs
from slurmrun.batch.handle import SubmittedLaunch, SubmittedMap, handle_of, states_of

__all__ = ["JobInfo", "jobs"]


@dataclass(frozen=True)
class JobInfo:
    """One job submitted into a folder.

    Attributes:
        job_id: the SLURM job id.
        state: its state now (SLURM's name, ``UNKNOWN`` if no record is left).
        function: the submitted function (``module.qualname``), if recorded.
        submitted: when it was submitted (seconds since the epoch), if recorded.
        handle: its `SubmittedLaunch` (a `SubmittedMap` for a job of `slurmrun.submit_map`).
    """

    job_id: str
    state: str
    function: str
    submitted: float | None
    handle: SubmittedLaunch[Any] | SubmittedMap[Any]


def jobs(folder: str | os.PathLike[str] = "slurmrun_jobs") -> list[JobInfo]:
    """The jobs submitted into `folder`, oldest first, with their states (one query for all).

    Args:
        folder: the folder given to `slurmrun.submit`.

    Raises:
        slurmrun.batch.JobFolderError: `folder` is not yours alone (`slurmrun.attach`).
    """
    base: Path = base_folder(folder)
    check_folder(base)
    found = submitted_jobs(base)
    metas = [f.meta() for f in found]
    handles = [handle_of(f.job_id, base, meta) for f, meta in zip(found, metas, strict=True)]
    states = states_of(handles)
    infos = []
    for meta, handle in zip(metas, handles, strict=True):
        submitted = meta.get("submitted")
        infos.append(
            JobInfo(
                job_id=handle.job_id,
                state=states[handle.job_id],
                function=str(meta.get("function", "")),
                submitted=float(submitted) if isinstance(submitted, int | float) else None,
                handle=handle,
            )
        )
    return infos
