"""Which slurmrun a process runs: its version and its protocol, compared at every agent's hello.

An agent that runs another slurmrun than its launcher (an image built from an older release, a
container that found another installation first) would speak a protocol that differs in small
ways and fail late and obscurely; its `Hello` says what it runs, and the launcher refuses it
at once, naming the node and both versions (`mismatch`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import shlex
import sys
from collections.abc import Mapping
from typing import Any

from slurmrun import protocol

__all__ = ["mismatch", "missing_dependency", "protocol_fingerprint", "slurmrun_version"]


@functools.cache
def slurmrun_version() -> str:
    """The installed distribution's version; ``0+unknown`` for a checkout never installed.

    Read as `importlib.metadata.version` finds it (the first ``slurmrun-*.dist-info`` or
    ``.egg-info`` on ``sys.path``) without importing importlib.metadata, which costs an
    agent about 35 ms before its hello.
    """
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if name == "slurmrun.egg-info" or (
                name.startswith("slurmrun-") and name.endswith((".dist-info", ".egg-info"))
            ):
                version = _metadata_version(os.path.join(entry or ".", name))
                if version:
                    return version
    return "0+unknown"


def missing_dependency(module: str) -> str:
    """What to do when this Python (the agents', `Launcher.agent_python`) lacks `module`.

    Said on one line by the agent (and its worker spawner) instead of the traceback of the
    import that failed; `slurmrun.launcher.agents.containers.start_hint` points at it.
    """
    version = slurmrun_version()
    if version == "0+unknown":  # a checkout never installed: this one (on PYTHONPATH)
        package = shlex.quote(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    else:
        package = f"'slurmrun=={version}'"
    python = sys.executable
    return (
        f"{python} (Python {sys.version.split()[0]}) cannot import {module!r}, which slurmrun "
        f"needs: install slurmrun and its dependencies in it (`{python} -m pip install "
        f"{package}`), or set agent_python (--agent-python) to an interpreter that has them."
    )


def _metadata_version(info: str) -> str | None:
    for file in ("METADATA", "PKG-INFO"):
        try:
            with open(os.path.join(info, file), encoding="utf-8") as f:
                for line in f:
                    if line.startswith("Version:"):
                        return line.split(":", 1)[1].strip()
                    if not line.strip():
                        break  # the headers ended
        except OSError:
            continue
    return None


@functools.cache
def protocol_fingerprint() -> str:
    """A digest of every message kind and its fields: equal where both sides speak alike."""
    shape = sorted(
        f"{kind}:{','.join(f.name for f in dataclasses.fields(cls))}"
        for kind, cls in protocol.KINDS.items()
    )
    return hashlib.sha256("\n".join(shape).encode()).hexdigest()[:12]


def where_installed() -> str:
    """The directory slurmrun is imported from (for messages)."""
    return os.path.dirname(os.path.abspath(protocol.__file__))


def mismatch(hello: Mapping[str, Any]) -> str | None:
    """Why an agent's hello header shows another slurmrun than ours; None: the same.

    Read from the raw header, before it is parsed: another version's `Hello` may not parse.
    """
    theirs = (str(hello.get("version", "unknown")), str(hello.get("protocol", "unknown")))
    ours = (slurmrun_version(), protocol_fingerprint())
    if theirs == ours:
        return None
    host = hello.get("hostname") or "a node"
    python = hello.get("python") or "its interpreter"
    path = hello.get("where") or "an unknown place"
    what = (
        f"version {theirs[0]}"
        if theirs[0] != ours[0]
        else f"version {theirs[0]} with another protocol ({theirs[1]}, ours {ours[1]})"
    )
    return (
        f"the agent on {host} runs slurmrun {what} ({python}, from {path}), but this launcher "
        f"runs slurmrun {ours[0]} (from {where_installed()}): launcher and agents must run the "
        f"same slurmrun. Install slurmrun {ours[0]} where the agents run (in the container "
        "image, or the nodes' environment), or run the launcher with the agents' slurmrun."
    )
