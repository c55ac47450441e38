"""A fake scheduler for slurmrun's plugin tests: its "allocation" is a hostfile.

``FAKE_SCHEDULER_HOSTFILE`` names a file of ``HOST WORKERS`` lines; when it is set, the
scheduler answers before SLURM does (priority 5), with local agents (its hosts are this
machine). It also ships two named resources for ``slurmrun.submit``.
"""

from __future__ import annotations

from collections.abc import Mapping

from slurmrun.providers import Hosts
from slurmrun.resources import Resources

GPU_X8 = Resources(nodes=2, gpus_per_node=8, cpus_per_worker=12, mem="500G", partition="gpu")
CPU_SMALL = Resources(nodes=1, cpus_per_worker=2, mem="4G")


class FakeScheduler:
    """Hosts and workers from the file ``$FAKE_SCHEDULER_HOSTFILE``."""

    priority = 5

    def detect(self, environ: Mapping[str, str]) -> Hosts | None:
        """The hostfile's hosts, or None when the variable is not set."""
        path = environ.get("FAKE_SCHEDULER_HOSTFILE")
        if not path:
            return None
        with open(path, encoding="utf-8") as f:
            rows = [line.split() for line in f if line.strip()]
        return Hosts(tuple(r[0] for r in rows), tuple(int(r[1]) for r in rows), "local")
