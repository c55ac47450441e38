"""The probe: a fork of the spawner that imports candidate preloads and judges each import.

It is forked in the spawner's very state (`slurmrun.node.preloads` says what is checked, and
why) and writes one ``verdict name`` line per candidate into its control socket, stopping at
the first unsafe one. Where the spawner can hand over (`Preloads.become` is set), a probe
that judged every candidate safe is the spawner's **successor**: it says ``ready`` and waits.
At a later request for a worker, once no worker of the old spawner runs, the old spawner
sends it that request, the socket to the agent and what it has learned since; the successor
checks that nothing changed since its verdicts, stops dying with the old spawner, answers
``ok`` and serves from then on, with every candidate loaded: nothing is imported twice, and
no request ever waits for an import. The old spawner exits, and the agent (a child
subreaper) becomes the successor's parent.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pickle
import signal
import socket
from collections.abc import Callable, Mapping
from typing import Any

from slurmrun.node.import_effects import ProcessState
from slurmrun.node.parent_death import be_subreaper, die_with_parent, outlive_parent
from slurmrun.torch_import import import_module

__all__ = ["MAX_TAKEOVER_BYTES", "MAX_TAKEOVER_FDS", "MORE", "OK", "READY", "SAFE", "run"]

SAFE = "ok"  # a candidate's verdict: imported, and nothing it should not do
READY = b"ready"  # a successor: every candidate judged safe (this many), waits to take over
MORE = b"more:"  # the old spawner's message of more names to judge (else: the takeover)
OK = b"ok\n"  # a successor's answer to the takeover: it serves now
MAX_TAKEOVER_BYTES = (1 << 20) + (64 << 10)  # a request (`spawner.MAX_REQUEST_BYTES`) and state
MAX_TAKEOVER_FDS = 8  # the agent's socket and a request's (`spawner.WORKER_FDS` + 2)
# The takeover's state, a pickle from the old spawner (our parent): a request and what it learned.
TakeOver = Callable[[socket.socket, bytes, list[int], dict[str, Any]], None]


def run(
    names: Mapping[str, str],
    later: list[str],
    ctl: socket.socket,
    *,
    parent: int,
    inherited: list[int],
    take_over: TakeOver | None,
) -> None:  # pragma: no cover - the forked probe; tests see it through its verdicts
    """The probe's life; ends the process (`take_over`: None, a probe and no successor)."""
    code = 0
    try:
        signal.set_wakeup_fd(-1)
        die_with_parent(parent)
        for fd in inherited:  # the spawner's: the agent's socket, workers' pipes
            with contextlib.suppress(OSError):
                os.close(fd)
        for name in later:  # trusted (see `Preloads.later`)
            with contextlib.suppress(Exception):
                import_module(name)
        if _judge(names, ctl.fileno()) and take_over is not None:
            _succeed(ctl, dict(names), take_over)
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _judge(names: Mapping[str, str], out: int) -> bool:  # pragma: no cover - in the probe
    """Imports `names` one by one; writes ``verdict name`` per name; False at an unsafe one."""
    from slurmrun.node.import_notes import spec_origin  # noqa: PLC0415
    from slurmrun.node.preloads import cuda_initialised, thread_count  # noqa: PLC0415

    for name, origin in names.items():
        verdict = SAFE
        spec = None
        with contextlib.suppress(Exception):
            spec = importlib.util.find_spec(name)
        if spec is None:
            verdict = "missing"
        elif origin and spec_origin(spec) != origin:
            verdict = "another-file"
        else:
            threads, before = thread_count(), ProcessState.now()
            try:
                import_module(name)
            except BaseException:
                verdict = "failed"
            else:
                changes = ProcessState.now().changes(before)
                if thread_count() > threads:
                    verdict = "threads"
                elif cuda_initialised():
                    verdict = "cuda"
                elif changes:
                    verdict = "changes-" + ",".join(changes)
        os.write(out, f"{verdict} {name}\n".encode())
        if verdict != SAFE:
            return False  # what it left behind would taint the next verdicts
    return True


def _succeed(
    ctl: socket.socket, names: dict[str, str], take_over: TakeOver
) -> None:  # pragma: no cover - in the probe
    """Waits to take over, judging the names that come meanwhile; then serves (if it may)."""
    from slurmrun.node.preloads import cuda_initialised, thread_count  # noqa: PLC0415

    ctl.setblocking(True)
    while True:
        threads, state = thread_count(), ProcessState.now()
        os.write(ctl.fileno(), READY + f" {len(names)}\n".encode())
        msg, fds, _, _ = socket.recv_fds(ctl, MAX_TAKEOVER_BYTES, MAX_TAKEOVER_FDS)
        if not msg:  # discarded, or the old spawner died
            return
        if msg.startswith(MORE):  # more names a run is importing
            more: dict[str, str] = pickle.loads(msg[len(MORE) :])  # noqa: S301 - our parent's
            names.update(more)
            if not _judge(more, ctl.fileno()):
                return
            continue
        break
    changed = ProcessState.now().changes(state)
    if thread_count() > threads:
        changed.append("threads")
    if cuda_initialised():
        changed.append("cuda")
    if changed or not fds:
        os.write(ctl.fileno(), f"refused {','.join(changed)}\n".encode())
        return
    outlive_parent()  # from here on, the old spawner's exit must not end us
    be_subreaper()  # what our workers leave behind is ours, as it was the old spawner's
    taken: dict[str, Any] = pickle.loads(msg)  # noqa: S301 - from our parent, over a socketpair
    sock = socket.socket(fileno=fds[0])
    os.write(ctl.fileno(), OK)
    ctl.close()
    take_over(sock, taken.pop("request"), fds[1:], taken)
