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
from collections.abc import Mapping
from typing import Any

from slurmrun import protocol

__all__ = ["mismatch", "protocol_fingerprint", "slurmrun_version"]


@functools.cache
def slurmrun_version() -> str:
    """The installed distribution's version; ``0+unknown`` for a checkout never installed."""
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415 - cold path

    try:
        return version("slurmrun")
    except PackageNotFoundError:
        return "0+unknown"


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
