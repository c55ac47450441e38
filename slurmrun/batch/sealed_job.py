"""A submitted job's call and result, sealed (`slurmrun.batch.seal`) on both sides.

submitit's node side, ``python -m submitit.core._submit <folder>``, unpickles the job's
``<id>_submitted.pkl`` as it finds it. A slurmrun job runs this module instead: the
executor's ``python`` is ``<python> -u -m slurmrun.batch.sealed_job <nonce>``, so the batch
script's command reads ``... sealed_job <nonce> -u -m submitit.core._submit <folder>``. On
the node, `main` reads the call, checks its seal against the key and the nonce, and only
then unpickles and runs it, as submitit's ``process_job`` would; it seals the result it
writes with the same nonce. A call whose seal fails runs nothing: the job's result is the
`JobFolderTamperedError`, and it exits 1.

On the login side, `SealedExecutor` pickles each call itself and seals it under a nonce of
its own (submitit would dump it unsealed). When sbatch has named the job id and
``<folder>/<id>/`` already exists, an earlier job of that id left it (ids repeat): it is
moved aside to ``<id>.old-<time>`` with a warning before anything of the new job goes there.
"""

from __future__ import annotations

import os
import pickle
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import cloudpickle
from submitit.core import utils
from submitit.core.core import Job
from submitit.slurm.slurm import SlurmExecutor, SlurmJob, SlurmJobEnvironment

from slurmrun.batch.seal import NONCE, job_key, read_sealed, write_sealed
from slurmrun.errors import JobFolderTamperedError, JobKeyError

__all__ = ["SealedExecutor", "main", "set_aside"]

# As long as submitit's node side waits for the call to show up (the submitter moves it in
# after sbatch has answered).
CALL_WAIT = 60.0
_SUBMITIT = ["-u", "-m", "submitit.core._submit"]


class SealedExecutor(SlurmExecutor):
    """submitit's ``SlurmExecutor``, whose jobs run only a call sealed for this submission.

    Args:
        folder: ``<base folder>/%j``.
        nonce: the submission's nonce (`slurmrun.batch.seal.new_nonce`).
    """

    def __init__(self, folder: str, nonce: str) -> None:
        python = f"{shlex.quote(sys.executable)} -u -m {__name__} {nonce}"
        super().__init__(folder=folder, python=python)
        self.nonce = nonce

    def _internal_process_submissions(
        self, delayed_submissions: list[utils.DelayedSubmission]
    ) -> list[Job[Any]]:
        key = job_key(create=True)  # before sbatch: a bad key submits nothing
        calls = []
        for delayed in delayed_submissions:
            delayed.set_timeout(self.parameters.get("time", 5), self.max_num_timeout)
            calls.append(cloudpickle.dumps(delayed, pickle.HIGHEST_PROTOCOL))
        if len(calls) > 1:
            self.parameters["map_count"] = len(calls)  # an array (submitit's parameter)
        try:
            first = self._submit_command(self._submitit_command_str)
        finally:
            self.parameters.pop("map_count", None)
        ids = (
            [first.job_id]
            if len(calls) == 1
            else [f"{first.job_id}_{k}" for k in range(len(calls))]
        )
        jobs: list[Job[Any]] = []
        for job_id, call in zip(ids, calls, strict=True):
            job: SlurmJob[Any] = SlurmJob(folder=self.folder, job_id=job_id)
            job.paths.folder.mkdir(mode=0o700, exist_ok=True)
            write_sealed(job.paths.submitted_pickle, call, key=key, nonce=self.nonce)
            jobs.append(job)
        return jobs

    # submitit's is a static method; it is called on the executor, which this one needs.
    def _get_job_id_from_submission_command(self, string: bytes | str) -> str:  # type: ignore[override]
        # Called by submitit right after sbatch answered, before it puts anything into the
        # job's folder: where an earlier job of this id left its folder, move it aside now.
        job_id: str = SlurmExecutor._get_job_id_from_submission_command(string)
        base = utils.JobPaths.get_first_id_independent_folder(self.folder)
        count = self.parameters.get("map_count")
        names = [job_id] if count is None else [job_id, *(f"{job_id}_{k}" for k in range(count))]
        for name in names:
            set_aside(base / name)
        return job_id


def set_aside(folder: Path) -> Path | None:
    """Moves the folder an earlier job of this id left to ``<id>.old-<time>``; warns.

    Returns:
        Where it went; None if there was none.
    """
    if not os.path.lexists(folder):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = folder.with_name(f"{folder.name}.old-{stamp}")
    n = 1
    while os.path.lexists(target):
        n += 1
        target = folder.with_name(f"{folder.name}.old-{stamp}-{n}")
    os.rename(folder, target)
    print(
        f"slurmrun: warning: job id {folder.name} was used before (SLURM's job ids started "
        f"again, or another cluster shares this folder): the earlier job's files are now in "
        f"{target}",
        file=sys.stderr,
        flush=True,
    )
    return target


def main(argv: list[str]) -> int:
    """On the node: ``<nonce> -u -m submitit.core._submit <folder>``; the job's exit status."""
    if len(argv) != 5 or not NONCE.match(argv[0]) or argv[1:4] != _SUBMITIT:
        print(
            f"usage: python -m {__name__} NONCE -u -m submitit.core._submit FOLDER", file=sys.stderr
        )
        return 2
    nonce, folder = argv[0], argv[4]
    os.environ["SUBMITIT_FOLDER"] = folder
    env = SlurmJobEnvironment()
    paths = env.paths
    try:
        key = job_key(create=False)
        call = _sealed_call(paths.submitted_pickle, key, nonce)
    except JobKeyError as e:  # nothing can be sealed: the error output says why
        print(f"slurmrun: {e}", file=sys.stderr, flush=True)
        return 1
    except JobFolderTamperedError as e:
        from slurmrun.batch.call import Outcome  # noqa: PLC0415 - only on this path

        print(f"slurmrun: {e}", file=sys.stderr, flush=True)
        _write_result(paths.result_pickle, ("success", Outcome.of_error(e)), key, nonce)
        return 1
    delayed = pickle.loads(call)  # noqa: S301 - sealed by the submitter for this submission
    env._handle_signals(paths, delayed)  # as submitit's process_job: SIGUSR2, SIGTERM, SIGCONT
    try:
        result = delayed.result()
    except Exception:
        _write_result(paths.result_pickle, ("error", traceback.format_exc()), key, nonce)
        raise
    _write_result(paths.result_pickle, ("success", result), key, nonce)
    return 0


def _sealed_call(path: Path, key: bytes, nonce: str) -> bytes:
    """The job's call once the submitter has put it there, checked.

    Raises:
        JobFolderTamperedError: the call there is not sealed, or sealed with another content.
        RuntimeError: no call sealed for this submission showed up within `CALL_WAIT`.
    """
    deadline = time.monotonic() + CALL_WAIT
    while True:
        try:
            sealed = read_sealed(path, key=key)
        except FileNotFoundError:
            pass
        else:
            if sealed.nonce == nonce:
                return sealed.payload
        if time.monotonic() > deadline:  # absent, or an earlier job's of this id
            raise RuntimeError(
                f"waited {CALL_WAIT:g} s for this job's call {path}; it did not show up (was the "
                "submitting process killed?)"
            )
        time.sleep(0.5)


def _write_result(path: Path, result: tuple[str, Any], key: bytes, nonce: str) -> None:
    try:
        data = cloudpickle.dumps(result, pickle.HIGHEST_PROTOCOL)
    except Exception:
        data = cloudpickle.dumps(("error", traceback.format_exc()), pickle.HIGHEST_PROTOCOL)
    write_sealed(path, data, key=key, nonce=nonce)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
