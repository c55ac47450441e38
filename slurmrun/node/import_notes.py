"""What a worker tells its spawner about its imports: each one as it starts, all at the end.

The spawner learns preloads from them (`slurmrun.node.preloads`). Two kinds of line go into
the worker's report pipe, both bounded (`MAX_NAMES`, `MAX_BYTES` each)
and written without ever blocking (a full pipe drops the line):

- as an import of an installed top-level package starts (a finder first on
  ``sys.meta_path`` that only looks, and lets the import go on as it would): ``+name<TAB>file``,
  the file the path finder finds for it. The spawner starts importing it in the background
  while the run goes on: a run that imports a package first thing and takes as long as the
  import again finds it preloaded at the next run.
- once the run's function has ended: what the worker imported, as before
  (`report`): ``name<TAB>file`` per installed top-level package, the file it was
  loaded from. Only a package named there (from the same file) is ever preloaded: one whose
  import failed in the worker, or came from another file, is not.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any

__all__ = [
    "MAX_BYTES",
    "MAX_NAME",
    "MAX_NAMES",
    "STARTED",
    "Notes",
    "decode",
    "encode",
    "installed_top_level",
    "is_installed",
    "report",
    "spec_origin",
]

MAX_NAMES = 200
MAX_NAME = 100
MAX_BYTES = 16 << 10  # per kind of line; both kinds fit a pipe (64 KiB; a full one drops lines)
STARTED = "+"  # the mark of a line written as an import starts
_INSTALLED_DIRS = ("site-packages", "dist-packages")
_MAX_LINE = 1024  # well under PIPE_BUF: each line is written whole or not at all


class Notes:
    """A worker's notes on its imports: a finder that only looks, and the report at the end.

    Args:
        pipe: the report pipe's write end (None: learning is off).
        known: the modules the worker started with (the spawner's).
        early: whether to note each import as it starts (the spawner reads them at once).
    """

    def __init__(self, pipe: int | None, known: set[str], *, early: bool = False) -> None:
        self.pipe = pipe  # None: learning is off, or reported already
        self.known = known
        self._pid = os.getpid()  # a fork of the worker (a DataLoader's) says nothing
        self._seen: set[str] = set()
        self._written = 0
        if pipe is not None and early:
            with contextlib.suppress(OSError):
                os.set_blocking(pipe, False)
            sys.meta_path.insert(0, self)

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> None:
        """Notes the start of an installed top-level package's import; finds nothing itself."""
        if path is not None or "." in name or name in self._seen or self.pipe is None:
            return
        if os.getpid() != self._pid or len(self._seen) >= MAX_NAMES:
            return
        if not _importing(name):  # `importlib.util.find_spec`: a package asks what is there
            return
        self._seen.add(name)
        origin = _found_origin(name)
        if origin is None or not is_installed(origin) or name.startswith("_"):
            return
        line = f"{STARTED}{name}\t{origin}\n".encode(errors="replace")
        if len(line) > _MAX_LINE or self._written + len(line) > MAX_BYTES:
            return
        with contextlib.suppress(OSError):  # full: dropped (the report at the end still counts)
            self._written += os.write(self.pipe, line)

    def invalidate_caches(self) -> None:
        """Nothing cached here (``importlib.invalidate_caches`` calls every finder's)."""

    def report(self) -> None:
        """Reports what the run imported and closes the pipe (a kept worker's later runs: no)."""
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        report(self.pipe, self.known)
        self.pipe = None


def _origin(module: object) -> str | None:
    """The file a module was loaded from (a namespace package's first directory), or None."""
    path = getattr(module, "__file__", None)
    if path is None:
        paths = list(getattr(module, "__path__", []) or [])
        path = paths[0] if paths else None
    return path if isinstance(path, str) else None


def is_installed(path: str) -> bool:
    """Whether `path` lies in an installed packages' directory (``site-packages``)."""
    parts = path.split(os.sep)
    return any(d in parts for d in _INSTALLED_DIRS)


def installed_top_level(modules: Mapping[str, object], known: Iterable[str] = ()) -> dict[str, str]:
    """The top-level installed packages among `modules` (``sys.modules``), less `known`.

    Returns:
        Name to the file it was loaded from, in import order.
    """
    skip = set(known)
    found: dict[str, str] = {}
    for name, module in list(modules.items()):
        if "." in name or name in skip or name.startswith("_"):
            continue
        origin = _origin(module)
        if origin is not None and is_installed(origin):
            found[name] = origin
    return found


def encode(found: Mapping[str, str]) -> bytes:
    """One ``name<TAB>origin`` line per module, cut to the bounds (see the module's docstring)."""
    out = bytearray()
    for count, (name, origin) in enumerate(found.items()):
        line = f"{name}\t{origin}\n".encode(errors="replace")
        if count >= MAX_NAMES or len(out) + len(line) > MAX_BYTES:
            break
        if len(name) <= MAX_NAME and name.isidentifier():
            out += line
    return bytes(out)


def decode(data: bytes) -> dict[str, str]:
    """The names and origins `encode` wrote (a cut last line is dropped)."""
    found: dict[str, str] = {}
    for line in data.decode(errors="replace").split("\n")[:-1]:
        name, _, origin = line.partition("\t")
        if name.isidentifier() and len(name) <= MAX_NAME and len(found) < MAX_NAMES:
            found[name] = origin
    return found


def report(fd: int | None, known: Iterable[str]) -> None:
    """Writes what this worker imported beyond `known` into the spawner's pipe; never blocks.

    Args:
        fd: the pipe's write end (None: learning is off); closed here.
        known: the modules the worker started with (the spawner's).
    """
    if fd is None:
        return
    with contextlib.suppress(OSError):
        os.set_blocking(fd, False)  # a full pipe cuts the list, and never holds the exit up
        os.write(fd, encode(installed_top_level(sys.modules, known)))
    with contextlib.suppress(OSError):
        os.close(fd)


def spec_origin(spec: importlib.machinery.ModuleSpec) -> str | None:
    """The file a module spec loads (a namespace package's first directory), or None."""
    if spec.origin not in (None, "namespace"):
        return spec.origin
    locations = list(spec.submodule_search_locations or [])
    return locations[0] if locations else None


def _importing(name: str) -> bool:
    """Whether `name` is being imported, not only looked for (True where that is unknown).

    The import system holds a module's lock while it finds and loads it; a look
    (``importlib.util.find_spec``, which transformers makes for every optional package) takes
    no lock, and would otherwise have the spawner import what the worker never did.
    """
    locks = getattr(sys.modules.get("importlib._bootstrap"), "_module_locks", None)
    return not isinstance(locks, dict) or name in locks


def _found_origin(name: str) -> str | None:
    """The file the path finder finds for top-level `name` (None: none, or it failed)."""
    try:
        spec: Any = importlib.machinery.PathFinder.find_spec(name)
    except Exception:  # a broken path entry: the import itself will say so
        return None
    if spec is None:
        return None
    return spec_origin(spec)
