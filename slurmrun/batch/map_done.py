"""A submitted map's finished items, kept in its job's folder so that a requeued run skips them.

When SLURM preempts a map's job, or signals it ahead of its time limit, the job is requeued
and maps again (`slurmrun.batch.call`). Each item's value is written, as it comes, to
``<job folder>/items_done/<index>_value.pkl``, sealed as the job's call and result are
(`slurmrun.batch.seal`: the user's job key and this submission's nonce), so the next run
unpickles only what this submission wrote; the index is sealed inside too, so a file moved to
another item's name is refused. A failed item writes nothing: the next run tries it again.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from slurmrun.batch.seal import read_sealed, write_sealed
from slurmrun.errors import JobFolderTamperedError
from slurmrun.pickling import dumps_inband, loads

__all__ = ["FOLDER", "DoneItems", "kept_count"]

FOLDER = "items_done"
_SUFFIX = "_value.pkl"  # <index>_value.pkl


class DoneItems:
    """The items of a submitted map that earlier runs of its job finished.

    Args:
        job_dir: the job's folder.
        key: the user's job key.
        nonce: this submission's nonce (that of the job's sealed call).
    """

    def __init__(self, job_dir: str | os.PathLike[str], key: bytes, nonce: str) -> None:
        self.folder = Path(job_dir, FOLDER)
        self._key = key
        self._nonce = nonce

    def _path(self, index: int) -> Path:
        return self.folder / f"{index}{_SUFFIX}"

    def read(self, count: int) -> dict[int, Any]:
        """The values of items ``0..count-1`` that a run of this submission finished.

        Raises:
            JobFolderTamperedError: a file there was not sealed by this submission for its item.
        """
        done: dict[int, Any] = {}
        for index in range(count) if self.folder.is_dir() else ():
            try:
                sealed = read_sealed(self._path(index), key=self._key)
            except FileNotFoundError:
                continue
            if sealed.nonce != self._nonce:
                continue  # an earlier submission's, under a job id used again
            sealed_index, value = loads(sealed.payload)
            if sealed_index != index:
                raise JobFolderTamperedError(
                    f"{self._path(index)} holds item {sealed_index}'s value, not item {index}'s: "
                    "the job folder was tampered with; nothing of it was used",
                    path=str(self._path(index)),
                )
            done[index] = value
        return done

    def write(self, index: int, value: Any) -> None:
        """Keeps item `index`'s value for a later run of this job."""
        self.folder.mkdir(mode=0o700, exist_ok=True)
        payload = dumps_inband((index, value))
        write_sealed(self._path(index), payload, key=self._key, nonce=self._nonce)


def kept_count(job_dir: str | os.PathLike[str]) -> int:
    """How many items' values the job's runs kept so far (files counted, none read)."""
    folder = Path(job_dir, FOLDER)
    return sum(1 for _ in folder.glob(f"*{_SUFFIX}")) if folder.is_dir() else 0
