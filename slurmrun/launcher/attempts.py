"""A launch's attempts: the run, and again after a failure, up to `Options.max_restarts` times.

Each attempt is one run on the kept agents (`slurmrun.launcher.warm.run_attempt`); after a
lost host, the next runs without it (`slurmrun.launcher.elastic`). A preemption, a version
mismatch and the last attempt's failure are raised.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from slurmrun.errors import AgentFailedError, VersionMismatchError, add_note
from slurmrun.events import AgentFailed, LaunchStarted, Restarting, Trace
from slurmrun.launcher.elastic import HostsDownError, note_hosts_down, restart_plan
from slurmrun.launcher.failures import note_preemption
from slurmrun.launcher.pool import some_hosts
from slurmrun.launcher.warm import Warm, run_attempt, say, sigterm_as_exit
from slurmrun.logs import host_labels, log_level
from slurmrun.result import LaunchResult

if TYPE_CHECKING:
    from slurmrun.launcher.options import Options
    from slurmrun.launcher.plan import Plan

__all__ = ["run_launch"]

log = logging.getLogger("slurmrun")


def run_launch(cfg: Options, warm: Warm, plan: Plan, payload: bytes) -> LaunchResult[Any]:
    """Runs a launch on the agents `warm` keeps (or new ones), with its restarts and events.

    Raises:
        Exception: the last attempt's error, with the launch's ``timings``.
    """
    warm.check_unchanged(cfg, plan)
    trace = Trace(cfg.on_event)
    counts = plan.workers_per_host
    trace.emit(
        LaunchStarted(
            hosts=tuple(plan.hostnames),
            world_size=None if counts is None else sum(counts),
        )
    )
    error: BaseException | None = None
    try:
        result, restarts = _attempts(cfg, warm, plan, payload, trace)
    except BaseException as e:
        error = e
        if isinstance(e, AgentFailedError):
            trace.emit(AgentFailed(host=e.hostname or "", message=str(e)))
        raise
    finally:
        timings = trace.finish(error)
        if error is not None:
            with contextlib.suppress(AttributeError, TypeError):
                error.timings = timings  # type: ignore[attr-defined]
    if cfg.log_handlers is None and log_level() <= logging.INFO:
        log_dir = warm.pool.log_dir if warm.pool is not None else None
        folder = log_dir.path if log_dir is not None and log_dir.keep else None
        say(summary(result, timings.get("total", 0.0), restarts, folder))
    return replace(result, timings=timings)


def summary(result: LaunchResult[Any], seconds: float, restarts: int, folder: str | None) -> str:
    """A successful run's last line: its world size, hosts, wall time, restarts, log folder."""
    ranks = sum(len(values) for values in result.return_values)
    where = "no log files (SLURMRUN_LOG_DIR is empty)"
    if folder is not None:
        near = os.path.relpath(folder)  # slurmrun_logs/... in the usual case
        where = f"logs: {folder if near.startswith('..') else near}"
    return (
        f"slurmrun: {ranks} rank{'s' * (ranks != 1)} on {some_hosts(result.hostnames)}, "
        f"{seconds:.1f} s, "
        f"{restarts} restart{'s' * (restarts != 1)}; {where}"
    )


def _attempts(
    cfg: Options, warm: Warm, plan: Plan, payload: bytes, trace: Trace
) -> tuple[LaunchResult[Any], int]:
    """Runs the call, and again after a failure, up to `Options.max_restarts` times.

    Returns:
        The result, and how many restarts it took.
    """
    lost: dict[str, str] = {}  # hosts lost (`Options.min_hosts`), and why
    # Each place's name in `lost`: its host's, "<host>#<index>" for a host named twice.
    labels = host_labels([*plan.hostnames, *plan.spares])
    with sigterm_as_exit():
        for attempt in range(cfg.max_restarts + 1):
            try:
                result = run_attempt(cfg, warm, plan, payload, attempt, trace)
                return replace(result, lost_hosts=dict(lost)), attempt
            except (KeyboardInterrupt, SystemExit):
                raise
            except Exception as e:
                preempted = note_preemption(e, plan.alloc)
                if preempted or isinstance(e, VersionMismatchError):  # the same agents again
                    raise
                if attempt == cfg.max_restarts:
                    if isinstance(e, AgentFailedError):
                        note_hosts_down(plan, e)
                    raise
                if isinstance(e, AgentFailedError):
                    trace.emit(AgentFailed(host=e.hostname or "", message=str(e)))
                refused: HostsDownError | None = None
                try:
                    restart = restart_plan(cfg, plan, e)
                except HostsDownError as down:
                    refused, restart = down, None
                if refused is not None:  # raised as it is (its cause intact), with the reason
                    add_note(e, f"slurmrun: not restarted: {refused}")
                    raise
                where = ""
                if restart is not None:
                    lost.update((labels[rank], why) for rank, why in restart.lost.items())
                    labels = [labels[i] for i in restart.kept]
                    plan = restart.plan
                    hosts = labels[: len(plan.hostnames)]
                    where = f" on {', '.join(hosts)} (lost: {', '.join(lost)})"
                trace.emit(
                    Restarting(
                        attempt=attempt + 1,
                        error=type(e).__name__,
                        hosts=tuple(plan.hostnames),
                        lost=tuple(lost),
                    )
                )
                log.warning(
                    "slurmrun: attempt %d of %d failed (%s: %s); restarting the workers%s",
                    attempt + 1,
                    cfg.max_restarts + 1,
                    type(e).__name__,
                    e,
                    where,
                )
    raise AssertionError("unreachable")  # pragma: no cover
