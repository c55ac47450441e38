"""Restarts without a lost node: on a spare (`Launcher.hosts`) or on those left (`min_hosts`).

A host counts as lost when SLURM marks its node down, drained or not responding once an
attempt failed (srun agents: `AgentKind.marked_down`; srun then ends the other nodes' tasks
itself, so which connection closed first tells nothing), or else when its agent failed during
the attempt (`AgentFailedError` naming its place: the agent died, went silent past
``heartbeat_timeout``, or its step ended on that node). Hosts are told apart by their place
(node rank), never by name alone: ``["localhost", "localhost"]`` runs two agents, and losing
one leaves the other. The next attempt then runs on the other hosts of the plan, if at least
``min_hosts`` are left: a plan without the lost host (its srun step asks for the others only),
so the workers see the smaller ``WORLD_SIZE`` with their ranks renumbered densely, and
``SLURMRUN_RESTART_COUNT`` counts the attempt. A host lost once is not used again within the
same launch. With spares (`Launcher.hosts` of the allocation's nodes run, the others wait), a
spare takes the lost host's place (its node rank) and the world size stays; a spare SLURM marks
down is dropped. Any other failure (a worker raising, a segfault) restarts at the same size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from slurmrun.errors import AgentFailedError, add_note

if TYPE_CHECKING:
    from slurmrun.launcher.options import Options
    from slurmrun.launcher.plan import Plan
    from slurmrun.slurm.scontrol import NodeState

__all__ = [
    "HostsDownError",
    "Restart",
    "lost_place",
    "note_hosts_down",
    "restart_plan",
    "without_lost_host",
]

# How long the question to SLURM may take after a failed attempt.
SCONTROL_TIMEOUT = 10.0


class HostsDownError(RuntimeError):
    """SLURM marks hosts of the plan down, and no restart can leave them out (no restart)."""


@dataclass(frozen=True)
class Restart:
    """The next attempt after a lost host: its plan, the hosts lost, where each place came from.

    Attributes:
        plan: the next attempt's plan.
        lost: the failed attempt's node ranks that were lost, and why.
        kept: for each host then spare of `plan`, its index among the failed attempt's hosts
            then spares (to follow a place's label through restarts).
    """

    plan: Plan
    lost: dict[int, str]
    kept: tuple[int, ...]


def restart_plan(cfg: Options, plan: Plan, error: BaseException) -> Restart | None:
    """The next attempt's plan after `error`, without the hosts it lost.

    Returns:
        The plan with spares in the lost hosts' places, or without them if `min_hosts`
        allows; None if no host was lost or neither applies (the next attempt is the same
        plan).

    Raises:
        HostsDownError: SLURM marks hosts of the plan down and neither applies: a restart
            would ask for them.
    """
    down = _unusable(plan)
    lost = {
        rank: f"SLURM marks {host} {down[host]}"
        for rank, host in enumerate(plan.hostnames)
        if host in down
    }
    if not lost:
        rank = lost_place(plan, error)
        if rank is None:
            return None
        lost = {rank: str(error).split("\n", 1)[0][:500]}
    n = len(plan.hostnames)
    spares = [n + i for i, host in enumerate(plan.spares) if host not in down]
    places = list(range(n))
    for rank in sorted(lost):
        places[rank] = spares.pop(0) if spares else -1
    left = [place for place in places if place >= 0]
    if len(left) < n and (cfg.min_hosts is None or len(left) < cfg.min_hosts):
        marked = [f"{host} {down[host]}" for host in plan.hostnames if host in down]
        if marked:  # the same plan's step would ask for them: SLURM would refuse it
            room = "no spare is left" if cfg.min_hosts is None else f"min_hosts={cfg.min_hosts}"
            raise HostsDownError(
                f"SLURM marks {'; '.join(marked)}, and the restart cannot leave "
                f"{'them' if len(marked) > 1 else 'it'} out ({room})"
            )
        return None
    everything = [*plan.hostnames, *plan.spares]
    counts = plan.workers_per_host
    if counts is not None:  # a spare runs as many workers as the host it replaces
        counts = [counts[rank] for rank, place in enumerate(places) if place >= 0]
    # Its step is made from the job's nodes as planning read them: SLURM is not asked again.
    smaller = dataclasses.replace(
        plan,
        hostnames=[everything[place] for place in left],
        workers_per_host=counts,
        spares=[everything[place] for place in spares],
    )
    return Restart(smaller, lost, tuple(left + spares))


def without_lost_host(cfg: Options, plan: Plan, error: BaseException) -> Plan | None:
    """`restart_plan`'s plan alone (None: the next attempt is the same plan)."""
    restart = restart_plan(cfg, plan, error)
    return None if restart is None else restart.plan


def lost_place(plan: Plan, error: BaseException) -> int | None:
    """The node rank of the host `error` says failed, or None.

    Its node rank when the error knows it; else its host's, if only one place has that name.
    """
    if not isinstance(error, AgentFailedError):
        return None
    rank = error.node_rank
    if rank is not None:
        in_plan = 0 <= rank < len(plan.hostnames)
        return rank if in_plan and error.hostname in ("", plan.hostnames[rank]) else None
    places = [i for i, host in enumerate(plan.hostnames) if host == error.hostname]
    return places[0] if len(places) == 1 else None


def note_hosts_down(plan: Plan, error: BaseException) -> None:
    """Notes on `error` the plan's hosts SLURM marks down (srun agents), if any.

    For a launch's last failure: the failure began there, whatever agent `error` names (srun
    ends the other nodes' tasks itself).
    """
    down = _unusable(plan)
    marked = [f"{host} {down[host]}" for host in plan.hostnames if host in down]
    if marked:
        add_note(error, f"slurmrun: SLURM marks {'; '.join(marked)}: the failure began there")


def _unusable(plan: Plan) -> dict[str, NodeState]:
    """The plan's nodes and spares that SLURM marks down (srun agents only; else none)."""
    return plan.agents.marked_down([*plan.hostnames, *plan.spares], SCONTROL_TIMEOUT)
