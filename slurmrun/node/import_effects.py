"""What importing a package changed in this process, of what a worker's setup depends on.

A learned preload (`slurmrun.node.preloads`) is imported in the spawner, before each worker
sets itself up (its logging handler, signal handlers, ``faulthandler``, working directory,
environment, streams, ``sys.path``); without it, the worker imports the package after that
setup. An import that changes any of these leaves a preloaded worker in another state than a
fresh interpreter importing it there: ``logging.basicConfig()`` at import is a no-op in a
worker (slurmrun's handler is on the root logger already) but gives the spawner, and so every
worker, a root handler that shows each record a second time.

So for each check, what is done with a change:

- found by the probe (a throwaway fork that imports the candidates): **refused**, the
  package is not preloaded (workers import it themselves, as in a fresh interpreter). No
  check restores a change and preloads the package anyway: the change's effect in a worker
  depends on its order with the worker's setup, which only the worker's own import keeps.
- found in the spawner after a probe approved the import (an import that does not do the
  same each time): **restored** (`ProcessState.restore`), the modules it loaded are dropped
  so that workers import them again, and learning stops for the launcher.

The checks (`ProcessState`'s fields): the root logger's handlers and level, ``logging``'s
disable level, logger class, record factory and ``warnings.showwarning`` (where
``logging.captureWarnings`` sends warnings); every signal's handler; ``sys.excepthook``,
``threading.excepthook``, ``sys.unraisablehook`` and ``sys.displayhook``; whether
``faulthandler`` is enabled; the working directory; the environment; ``sys.stdin``,
``sys.stdout`` and ``sys.stderr``; ``sys.path``. Other loggers' handlers and levels are not
checked: a package's own logger is the same in both orders (slurmrun does not touch it, and
a console handler there is recognised by the worker's logging handler).
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import logging
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["ProcessState"]

_SIGNALS = tuple(s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP))


@dataclasses.dataclass(frozen=True)
class ProcessState:
    """The parts of this process's state that an import must leave as they were (see above)."""

    logging: tuple[Any, ...]
    signals: tuple[Any, ...]
    hooks: tuple[Callable[..., Any], ...]
    faulthandler: bool
    cwd: str | None
    environ: dict[str, str]
    stdio: tuple[Any, ...]
    sys_path: tuple[str, ...]

    @classmethod
    def now(cls) -> ProcessState:
        """This process's state now."""
        root = logging.getLogger()
        return cls(
            logging=(
                tuple(root.handlers),
                root.level,
                logging.root.manager.disable,
                logging.getLoggerClass(),
                logging.getLogRecordFactory(),
                warnings.showwarning,
            ),
            signals=tuple(_handler(s) for s in _SIGNALS),
            hooks=(sys.excepthook, threading.excepthook, sys.unraisablehook, sys.displayhook),
            faulthandler=faulthandler.is_enabled(),
            cwd=_cwd(),
            environ=dict(os.environ),
            stdio=(sys.stdin, sys.stdout, sys.stderr),
            sys_path=tuple(sys.path),
        )

    def changes(self, before: ProcessState) -> list[str]:
        """The checks whose value differs from `before`'s (empty: nothing changed)."""
        return [
            f.name
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(before, f.name)
        ]

    def restore(self) -> None:
        """Puts this state back, as far as each part can be (a failing part is left)."""
        root = logging.getLogger()
        handlers, level, disable, logger_class, factory, showwarning = self.logging
        root.handlers[:] = list(handlers)
        root.setLevel(level)
        logging.disable(disable)
        logging.setLoggerClass(logger_class)
        logging.setLogRecordFactory(factory)
        warnings.showwarning = showwarning
        for signum, handler in zip(_SIGNALS, self.signals, strict=True):
            if handler is not None and _handler(signum) != handler:
                with contextlib.suppress(OSError, ValueError, TypeError):
                    signal.signal(signum, handler)
        sys.excepthook, threading.excepthook, sys.unraisablehook, sys.displayhook = self.hooks
        if faulthandler.is_enabled() and not self.faulthandler:
            faulthandler.disable()
        if self.cwd is not None:
            with contextlib.suppress(OSError):
                os.chdir(self.cwd)
        if dict(os.environ) != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        sys.stdin, sys.stdout, sys.stderr = self.stdio
        sys.path[:] = self.sys_path


def _handler(signum: signal.Signals) -> Any:
    try:
        return signal.getsignal(signum)
    except (OSError, ValueError):
        return None


def _cwd() -> str | None:
    try:
        return os.getcwd()
    except OSError:  # removed under us
        return None
