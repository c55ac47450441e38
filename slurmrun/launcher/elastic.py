"""Restarts without a lost node: on a spare (`Launcher.hosts`) or on those left (`min_hosts`).

A node counts as lost when its agent fails during an attempt (`AgentFailedError` naming its
host: the agent died, went silent past ``heartbeat_timeout``, or its step ended on that node).
The next attempt then runs on the other hosts of the plan, if at least ``min_hosts`` are
left: a plan without the lost host (its srun step asks for the others only), so the workers
see the smaller ``WORLD_SIZE`` with their ranks renumbered densely, and
``SLURMRUN_RESTART_COUNT`` counts the attempt. A host lost once is not used again within the
same launch. With spares (`Launcher.hosts` of the allocation's nodes run, the others wait),
a spare takes the lost host's place (its node rank) and the world size stays. Any other
failure (a worker raising, a segfault) restarts at the same size.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from slurmrun.errors import AgentFailedError

if TYPE_CHECKING:
    from slurmrun.launcher.options import Options
    from slurmrun.launcher.plan import Plan

__all__ = ["without_lost_host"]


def without_lost_host(cfg: Options, plan: Plan, error: BaseException) -> Plan | None:
    """The plan for the next attempt, without the host that `error` lost.

    Returns:
        The plan with a spare in the lost host's place, or without it if `min_hosts` allows;
        None if `error` lost no host or neither applies (the next attempt is the same plan).
    """
    if not isinstance(error, AgentFailedError) or error.hostname not in plan.hostnames:
        return None
    lost = error.hostname
    if plan.spares:
        spare, *spares = plan.spares
        hosts = [spare if host == lost else host for host in plan.hostnames]
        return _with_hosts(plan, hosts, plan.workers_per_host, spares)
    if cfg.min_hosts is None or len(plan.hostnames) - 1 < cfg.min_hosts:
        return None
    keep = [i for i, host in enumerate(plan.hostnames) if host != lost]
    counts = plan.workers_per_host
    return _with_hosts(
        plan,
        [plan.hostnames[i] for i in keep],
        None if counts is None else [counts[i] for i in keep],
        [],
    )


def _with_hosts(plan: Plan, hosts: list[str], counts: list[int] | None, spares: list[str]) -> Plan:
    # Its step is made from the job's nodes as planning read them: SLURM is not asked again.
    return dataclasses.replace(plan, hostnames=hosts, workers_per_host=counts, spares=spares)
