"""`slurmrun.worker_state()`: what a worker keeps from one run to the next."""

from __future__ import annotations

from typing import Any

__all__ = ["worker_state"]

_STATE: dict[str, Any] = {}


def worker_state() -> dict[str, Any]:
    """This worker's own dict, kept from one run of a warm launcher to the next.

    With ``Launcher(keep_workers=True)``, the same worker processes serve every run of the
    launcher, and what a run puts here (a model on the GPU, a dataset in memory) is there for
    the next::

        def load(path):
            slurmrun.worker_state()["model"] = torch.load(path).cuda()

        def evaluate(batch):
            return slurmrun.worker_state()["model"](batch)

    A worker that is new (the first run, or any run after one that failed or was stopped:
    the launcher then warns that the state was lost) starts with an empty dict, never with
    another worker's. Without ``keep_workers`` every run starts empty. In a process that is
    not a worker (the launcher) it is that process's own dict.

    Returns:
        The dict itself: change it in place.
    """
    return _STATE
