"""What every worker runs in script mode: a script or module as ``__main__``.

This module is imported by workers (the shipped function lives here), so it imports only the
standard library.
"""

from __future__ import annotations

import os
import runpy
import sys
from types import TracebackType

__all__ = ["ScriptExit", "run_item", "run_script"]


class ScriptExit(Exception):
    """A rank's script called ``sys.exit(code)`` with a failing code.

    Attributes:
        code: the exit status the rank asked for (1 for ``sys.exit("message")``).
    """

    def __init__(self, code: int) -> None:
        super().__init__(f"the script exited with status {code}")
        self.code = code

    def __reduce__(self) -> tuple[type[ScriptExit], tuple[int], dict[str, object]]:
        # With its __dict__: the note of the rank that exited reaches a submitted job's status.
        return ScriptExit, (self.code,), self.__dict__


def _exit_status(code: object) -> int:
    """The status ``python script.py`` would exit with after ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int) and not isinstance(code, bool):
        return code & 0xFF
    print(code, file=sys.stderr, flush=True)  # as the interpreter does for sys.exit("message")
    return 1


def run_script(target: str, args: list[str], *, module: bool = False) -> None:
    """Runs a script (or ``-m`` module) as ``__main__`` with ``sys.argv`` set, as Python would.

    Args:
        target: the script's absolute path, or the module's name when `module` is true.
        args: the script's arguments (``sys.argv[1:]``).
        module: run `target` as a module (``python -m target``).

    Raises:
        ScriptExit: the script called ``sys.exit`` with a failing status.
    """
    # `python script.py` puts the script's directory first on sys.path, `python -m` the
    # working directory; sys.path[0] here is the launcher's own entry (its cwd or bin dir).
    first = os.getcwd() if module else os.path.dirname(target)
    if sys.path:
        sys.path[0] = first
    else:
        sys.path.append(first)
    sys.argv = [target, *args]  # runpy sets argv[0] to the script's (or module's) file
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        status = _exit_status(e.code)
        if status:
            raise ScriptExit(status) from None
    except BaseException as e:
        raise e.with_traceback(_user_frames(e.__traceback__))  # noqa: B904 - the same exception


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """`tb` without its leading runpy frames: the traceback printed starts at the script."""
    first = tb.tb_next if tb is not None else None  # run_script's own frame
    while first is not None and first.tb_frame.f_code.co_filename.endswith(
        ("runpy.py", "<frozen runpy>")
    ):
        first = first.tb_next
    return first or tb


def run_item(target: str, args: list[str], module: bool, own_group: bool, extra: list[str]) -> None:
    """One item of ``slurmrun --map``: the script, `extra` appended to its arguments `args`.

    A slot's worker runs item after item: with `own_group` (the command made no process group,
    the script makes its own), a group the script left initialised is destroyed after it, so
    that the next item's ``init_process_group`` does not find one.

    Raises:
        ScriptExit: the script called ``sys.exit`` with a failing status.
    """
    try:
        run_script(target, [*args, *extra], module=module)
    finally:
        dist = sys.modules.get("torch.distributed")
        if own_group and dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
