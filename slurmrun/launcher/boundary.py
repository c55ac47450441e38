"""The API's edge: the exception a run raises shows the user's frames, not slurmrun's.

A worker's failure or a Ctrl-C reaches the user through a dozen frames of the launcher's
machinery (the attempts, the pump, the verdicts); what the user needs is their own call line
and, for a worker's exception, the remote traceback (its ``__cause__``). `hide_internal_frames`
drops slurmrun's frames (and the standard library's they called) from such an exception's
traceback, keeps the whole one as text in ``slurmrun_traceback`` and logs it at DEBUG.
"""

from __future__ import annotations

import logging
import os
import sysconfig
import traceback
import types

from slurmrun.errors import AgentFailedError, OptionsError, RemoteTraceback, WorkerFailedError

log = logging.getLogger("slurmrun")

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB = tuple(
    os.path.abspath(sysconfig.get_paths()[name]) + os.sep for name in ("stdlib", "platstdlib")
)
# What a user meets at the call site: the run's verdict, a bad call, a Ctrl-C or SIGTERM. Any
# other exception from slurmrun is slurmrun's own bug, whose frames are the point.
_USERS = (WorkerFailedError, AgentFailedError, OptionsError, KeyboardInterrupt, SystemExit)


def hide_internal_frames(exc: BaseException) -> None:
    """Drops slurmrun's frames from `exc`'s traceback if it is one the user caused or meets.

    The frames above slurmrun's first (the user's callers) stay; below it, slurmrun's and the
    standard library's go, and others (a user's callback, such as ``on_event``) stay. The whole
    traceback's frames are kept as text in ``exc.slurmrun_traceback`` (a string: the exception
    still pickles) and logged at DEBUG to "slurmrun". Called at the API's edge before a bare
    ``raise``, which raises with ``exc.__traceback__`` as set here from Python 3.11 (on 3.10,
    whose bare ``raise`` brings the whole traceback back, ``raise exc``: one frame shows).
    """
    whole = exc.__traceback__
    if whole is None or not _users(exc):
        return
    kept: list[types.TracebackType] = []
    inside = False
    tb: types.TracebackType | None = whole
    while tb is not None:
        filename = os.path.abspath(tb.tb_frame.f_code.co_filename)
        ours = filename.startswith(_PACKAGE)
        inside = inside or ours
        if not (ours or (inside and filename.startswith(_STDLIB))):
            kept.append(tb)
        tb = tb.tb_next
    shown: types.TracebackType | None = None
    for entry in reversed(kept):
        shown = types.TracebackType(shown, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    if getattr(exc, "slurmrun_traceback", None) is None:  # the first edge (run) saw it whole
        log.debug(
            "%s raised through slurmrun; its whole traceback:",
            type(exc).__name__,
            exc_info=(type(exc), exc, whole),
        )
        # Text, not the traceback object: the exception must still pickle (a batch job's does).
        text = "Traceback (most recent call last):\n" + "".join(traceback.format_tb(whole))
        exc.slurmrun_traceback = text  # type: ignore[attr-defined]
    exc.with_traceback(shown)


def _users(exc: BaseException) -> bool:
    """Whether `exc` is the user's to read: a verdict, a bad call, an interrupt, or a worker's."""
    return isinstance(exc, _USERS) or isinstance(exc.__cause__, RemoteTraceback)
