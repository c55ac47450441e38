"""What a run runs, in a few words: a script's name or a function's (both sides use them).

The workers' process titles (`slurmrun.node.proctitle`) and the header line each run writes
at the top of its part of every worker's log file (`slurmrun.logs.run_header`, from the
launcher's `slurmrun.protocol.Start.title`) name the same thing.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["run_title", "what_runs"]

_SCRIPT_RUNNER = ("slurmrun.cli.script", "run_script")


def what_runs(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
    """What a worker runs, for its title: a script's base name, ``-m module``, or a function's name.

    A function's qualified name, ``<locals>`` left out: ``Trainer.fit``, ``main.step``.
    Never an argument: a command line is readable by every user of the host. Never raises
    (a name is not worth failing a run for): "" when `func` has no name to give.
    """
    return _what_runs(func, args, kwargs)[1]


def run_title(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
    """What a run runs, for the header of each worker's log file (`slurmrun.logs.run_header`).

    ``func Trainer.fit``, ``script train.py``, ``script -m package``: `what_runs`, with what
    it is. Never raises.
    """
    kind, what = _what_runs(func, args, kwargs)
    return f"{kind} {what}" if what else ""


def _what_runs(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[str, str]:
    try:
        while isinstance(func, functools.partial):
            func = func.func
        name = getattr(func, "__qualname__", None)
        if (getattr(func, "__module__", None), name) == _SCRIPT_RUNNER:
            target = args[0] if args else kwargs.get("target")
            if isinstance(target, str):
                module = args[2] if len(args) > 2 else kwargs.get("module", False)
                return "script", f"-m {target}" if module else os.path.basename(target)
        # A function defined in a function: "main.<locals>.step" reads as "main.step".
        return "func", str(name or type(func).__qualname__).replace(".<locals>", "")
    except Exception:
        return "", ""
