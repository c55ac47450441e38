"""The launcher's side of a launch, and its public entry: `Launcher` and `launch`.

`Launcher` is a dataclass of options and `launch(func, ...)` a call of it. Its modules: the
checks of the options and the call (`checks`), a launch's plan (`plan`: hosts, how their
agents start, the launcher's address), the agents' starters (`starters`, `srun`, `ssh`), the
agents kept in a pool (`pool`, read by `listener` and `incoming`), one run on them
(`session`, with the verdicts of `failures`), and what a warm launcher keeps between runs
(`warm`). It talks to `slurmrun.node` only through `slurmrun.protocol` and
`slurmrun.transport`.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from slurmrun.environment import DEFAULT_ENV_VARS
from slurmrun.errors import AgentFailedError, VersionMismatchError
from slurmrun.events import AgentFailed, EventHandler, LaunchStarted, Restarting, Trace
from slurmrun.launcher.checks import check_call
from slurmrun.launcher.dryrun import DryRun, describe_call
from slurmrun.launcher.elastic import check_min_hosts, without_lost_host
from slurmrun.launcher.failures import note_preemption
from slurmrun.launcher.plan import Plan, make_plan, plan_dry_run
from slurmrun.launcher.warm import WARM_ATTR, Warm, run_attempt, sigterm_as_exit, warm_of
from slurmrun.result import LaunchResult

if TYPE_CHECKING:
    import tyro

    from slurmrun.stacks import StackReport
else:

    class _Tyro:
        """tyro, imported when something reads `Launcher`'s annotations (``tyro.cli``).

        ``import slurmrun`` stays light: tyro is imported by the command, or a user's script.
        """

        def __getattr__(self, name: str) -> Any:
            return getattr(importlib.import_module("tyro"), name)

    tyro = _Tyro()

__all__ = ["Launcher", "launch"]

T = TypeVar("T")
log = logging.getLogger("slurmrun")

Backend = Literal["nccl", "gloo", "mpi", "ucc", "auto"] | None


@dataclass
class Launcher:
    """Options of a launch; `run` starts it. `launch(func, ...)` is `Launcher(...).run(func, ...)`.

    Example:
        >>> import slurmrun
        >>> result = slurmrun.Launcher(workers_per_host=2, backend="gloo").run(
        ...     lambda: __import__("os").environ["RANK"])
        >>> result.rank(1)
        '1'
    """

    # The literals first: tyro tries the union's members in order ("auto" is a list of one).
    hostnames: Literal["auto", "slurm"] | list[str] = "auto"
    """Hosts to run on. ``"auto"``: what the allocation providers find (`slurmrun.allocations`:
    the SLURM job's nodes, else ``$SLURMRUN_HOSTFILE``'s hosts, else ``["localhost"]``).
    ``"slurm"``: the job's nodes, and an error outside a job. Agents on the job's nodes start
    with srun (in a one-node job too); outside a job, hosts other than this machine get
    theirs over ssh (`slurmrun.launcher.ssh`)."""

    workers_per_host: Literal["auto", "slurm"] | int | list[int] = "auto"
    """Workers on each host. ``"auto"``: one per GPU the host sees; without GPUs, the tasks per
    node of the SLURM job (1 if unset), or the usable CPUs outside SLURM."""

    backend: Backend = "auto"
    """`torch.distributed` backend; ``"auto"``: nccl on GPU workers, else gloo; None: no
    process group is initialised."""

    timeout: float = 600
    """Seconds for agents to connect, for process-group initialisation and collectives, and
    of silence after which an agent counts as dead."""

    default_env_vars: tuple[str, ...] = DEFAULT_ENV_VARS
    """fnmatch patterns of the launcher's environment variables that agents and workers get.
    Nothing else of the launcher's environment reaches them (SLURM adds its own SLURM_*)."""

    extra_env_vars: tuple[str, ...] | Mapping[str, str] = ()
    """More patterns, added to `default_env_vars`, among which ``NAME=value`` words set a
    variable (``("WANDB_*", "NCCL_DEBUG=INFO")``; on the command line ``--extra-env-vars
    'WANDB_*' NCCL_DEBUG=INFO``); or a mapping of names to values (``{"NCCL_DEBUG": "INFO"}``).
    Variables set are on top of those the patterns pass."""

    env_file: str | None = None
    """A bash file that each agent sources before it starts workers; its exports reach them."""

    log_handlers: Annotated[list[logging.Handler] | None, tyro.conf.Suppress] = None
    """Handlers for agents' and workers' output records; None: rank 0 and agent 0 live in the
    terminal, and a file per worker under ``$SLURMRUN_LOG_DIR`` (see `slurmrun.logs`)."""

    max_restarts: int = 0
    """How often the whole worker group is started again after a failure (same world size;
    workers see ``SLURMRUN_RESTART_COUNT``). The error is raised after the last attempt."""

    hosts: int | None = None
    """Run on the first this many of the hosts found and keep the others as spares: a host
    lost during a run is replaced by a spare at the restart (the world size stays); None:
    every host runs. Needs ``max_restarts``, as `min_hosts` does."""

    min_hosts: int | None = None
    """When a host is lost during a run (its agent died or went silent), the restart runs on
    the hosts that are left if at least this many are (workers see the new ``WORLD_SIZE``,
    ranks renumbered); None: every host, as a lost host fails the launch. Needs
    ``max_restarts``: each lost host uses a restart."""

    heartbeat_timeout: float = 15.0
    """Seconds without a heartbeat (five per period, each way) after which an agent counts as
    dead (a hung node, or one the network lost), and after which agents stop their workers
    when the launcher is silent (its host vanished, or it hung)."""

    ssh_config_file: str | None = None
    """An ssh config file (``ssh -F``) for hosts started over ssh; None: ssh's own default
    (``~/.ssh/config``)."""

    srun_args: tuple[str, ...] = ()
    """Options added to the agents' srun line, one word each (``("--cpu-bind=none",
    "--reservation=maint")``); pyxis's ``"--container-image=IMAGE"`` runs the agents in IMAGE.
    Options that slurmrun sets itself (nodes, tasks, CPUs, GPUs, output) are refused. On the
    command line: one quoted string, ``--srun-args '--cpu-bind=none --mpi=pmix'``."""

    agent_prefix: tuple[str, ...] = ()
    """A command each agent runs under on its node, such as a container runtime:
    ``("apptainer", "exec", "--nv", "img.sif")``, ``("ch-run", "/images/torch", "--")``. The
    agent, ``{python} -m slurmrun.node.agent_main``, follows it (a ``"{python}"`` word in it
    places the interpreter there). On the command line: one quoted string,
    ``--agent-prefix 'ch-run /images/torch --'``. docs/containers.md has recipes."""

    agent_python: str | None = None
    """The interpreter of agents and workers; None: ``python3`` inside a container
    (`agent_prefix`, or pyxis's ``--container-image``), else the launcher's own."""

    on_event: Annotated[EventHandler | None, tyro.conf.Suppress] = None
    """Called with each `slurmrun.events.Event` of a launch (from a thread of its own: a slow
    or raising handler never stalls the launch). ``$SLURMRUN_EVENTS_FILE`` also gets them."""

    stall_timeout: float | None = None
    """Seconds without output, a result or a failure from any rank after which every rank's
    stacks are dumped once (printed, written to the log directory, a `slurmrun.events.Stalled`
    event); the run goes on. None (the default): never, as runs are often silent for long on
    purpose; set it a little above your longest quiet stretch."""

    flight_recorder: bool = False
    """Turns on torch's NCCL flight recorder: each rank's last collectives are dumped, on a
    collective's timeout, into ``flight_recorder/`` in the log directory, for ``python -m
    torch.distributed.flight_recorder.fr_trace``. NCCL only (gloo ignores it)."""

    keep_workers: Annotated[bool, tyro.conf.Suppress] = False
    """A warm launcher's runs share worker processes: each run after the first is handed to
    the last run's workers (their imports, process group and `slurmrun.worker_state()` kept),
    a message's round trip instead of new processes. After a run that fails or is stopped, or
    one whose settings or environment differ, the next run has new workers (with a warning:
    their state is empty)."""

    learn_preloads: bool = True
    """Between the runs of a warm launcher, each node imports the installed packages that the
    last run's workers imported, so that the next run's workers start with them loaded
    (packages that start threads or initialise CUDA when imported are left out; see
    `slurmrun.node.preloads`). False: workers import them at every run."""

    def run(
        self,
        func: Callable[..., T],
        func_args: Sequence[Any] = (),
        func_kwargs: dict[str, Any] | None = None,
    ) -> LaunchResult[T]:
        """Runs ``func(*func_args, **func_kwargs)`` on every worker and returns all results.

        Args:
            func: the function; shipped with cloudpickle, so lambdas and closures work.
            func_args: positional arguments for every worker.
            func_kwargs: keyword arguments for every worker.

        Returns:
            Every worker's return value (`LaunchResult.rank`, `LaunchResult.index`).

        Raises:
            ValueError, TypeError: bad options, before anything starts.
            RuntimeError: ``"slurm"`` was asked for outside a SLURM job.
            WorkerFailedError: a worker died without returning.
            AgentFailedError: an agent died, went silent, or never started.
            Exception: whatever a worker raised, re-raised with its traceback as ``__cause__``.
        """
        return self._run(func, func_args, func_kwargs)

    def stacks(self, timeout: float = 10.0) -> StackReport | None:
        """Every rank's Python stacks (all threads) during a run, from another thread.

        Workers answer themselves; one stuck in C code holding the GIL is dumped by
        faulthandler. The report is also written to the launch's log directory.

        Args:
            timeout: seconds to wait for the answers (ranks without one say so).

        Returns:
            The report (`print(report.format())`, `report.summary()`), or None when no run
            is in progress. docs/debugging.md shows one.
        """
        warm = warm_of(self)
        return None if warm is None else warm.stacks(timeout)

    def dry_run(
        self,
        func: Callable[..., Any],
        func_args: Sequence[Any] = (),
        func_kwargs: dict[str, Any] | None = None,
    ) -> DryRun:
        """What `run` would start, without starting anything (no process, socket or file).

        Checks the options and the call as `run` does, and plans the launch the way `run`
        does: where `run` would raise before starting, this raises the same error.

        Args:
            func: the function `run` would run (checked, not called).
            func_args: positional arguments for every worker.
            func_kwargs: keyword arguments for every worker.

        Returns:
            The plan: `str()` prints it (hosts, workers, the srun command line, the names of
            the variables agents get); `DryRun.as_dict` and `DryRun.to_json` for scripts.

        Raises:
            ValueError, TypeError, RuntimeError: as `run`, before anything starts.
        """
        kwargs = {} if func_kwargs is None else func_kwargs
        check_call(self, func, func_args, kwargs)
        plan = plan_dry_run(self, make_plan(self))
        return replace(plan, workers_run=describe_call(func, func_args, kwargs))

    def __enter__(self) -> Launcher:
        """Keeps the agents (and their imports) from one `run` to the next until `close`.

        Each `run` inside the ``with`` block still forks fresh workers in a new process group;
        only the agents, with their spawners and imports, are kept. See `close` for the rules.

        Example:
            >>> import slurmrun
            >>> with slurmrun.Launcher(workers_per_host=2, backend="gloo") as launcher:
            ...     first = launcher.run(lambda: 1)
            ...     second = launcher.run(lambda: 2)  # ~10x faster: no agent starts
        """
        return self.open()

    def open(self) -> Launcher:
        """Keeps the agents from one `run` to the next until `close`: a ``with`` block's start.

        For a notebook, where a ``with`` block cannot span cells: open the launcher in one
        cell, run in the next ones, close it at the end (a kernel that exits or restarts ends
        the agents too). The agents start with the first `run`.

        Example:
            >>> import slurmrun
            >>> launcher = slurmrun.Launcher(workers_per_host=2, backend="gloo").open()
            >>> launcher.run(lambda: 1).rank(0)
            1
            >>> launcher.run(lambda: 2).rank(1)  # the same agents
            2
            >>> launcher.close()
        """
        if warm_of(self) is None:
            setattr(self, WARM_ATTR, Warm())  # not a dataclass field: tyro reads those
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Closes the agents (`close`)."""
        self.close()

    def close(self) -> None:
        """Stops the agents kept by a ``with`` block (workers first); does nothing otherwise.

        Rules of a warm launcher: an agent that fails during a run (its process, its node,
        its heartbeats) fails that run with AgentFailedError and the next run starts every
        agent again (one new srun step), as does an agent that died between runs (with a
        warning); a failed worker or a Ctrl-C ends only that run's workers (and every process
        they started). Changing ``hostnames``, ``workers_per_host`` or what agents start with
        (the variable patterns, env file, heartbeat and connect timeouts, backend None)
        between runs is a ValueError: close the launcher first. The variables that
        ``default_env_vars`` and ``extra_env_vars`` select are read at every run: a change of
        ``os.environ`` between runs (``OMP_NUM_THREADS``, ``HF_HOME``) reaches the next run's
        workers, and a variable unset since is unset there. After `close`, `run` is a cold
        launch again.
        """
        warm = warm_of(self)
        if warm is not None:
            setattr(self, WARM_ATTR, None)
            warm.close()

    def _run(
        self,
        func: Callable[..., T],
        func_args: Sequence[Any],
        func_kwargs: dict[str, Any] | None,
    ) -> LaunchResult[T]:
        kwargs = {} if func_kwargs is None else func_kwargs
        payload = check_call(self, func, func_args, kwargs)
        plan = make_plan(self)
        if warm_of(self) is None:
            with self:  # a cold launch is a warm launcher used once
                return self._run_planned(plan, payload)
        return self._run_planned(plan, payload)

    def _run_planned(self, plan: Plan, payload: bytes) -> LaunchResult[Any]:
        warm = warm_of(self)
        assert warm is not None  # noqa: S101 - _run opened it
        warm.check_unchanged(self, plan)
        check_min_hosts(self, plan)
        trace = Trace(self.on_event)
        counts = plan.workers_per_host
        trace.emit(
            LaunchStarted,
            hosts=tuple(plan.hostnames),
            world_size=None if counts is None else sum(counts),
        )
        error: BaseException | None = None
        try:
            result = _attempts(self, warm, plan, payload, trace)
        except BaseException as e:
            error = e
            if isinstance(e, AgentFailedError):
                trace.emit(AgentFailed, host=e.hostname or "", message=str(e))
            raise
        finally:
            timings = trace.finish(error)
            if error is not None:
                with contextlib.suppress(AttributeError, TypeError):
                    error.timings = timings  # type: ignore[attr-defined]
        return replace(result, timings=timings)


def launch(  # noqa: PLR0917 - the signature torchrunx users know, kept positional
    func: Callable[..., T],
    func_args: Sequence[Any] = (),
    func_kwargs: dict[str, Any] | None = None,
    hostnames: list[str] | Literal["auto", "slurm"] = "auto",
    workers_per_host: int | list[int] | Literal["auto", "slurm"] = "auto",
    backend: Backend = "auto",
    timeout: float = 600,
    default_env_vars: tuple[str, ...] = DEFAULT_ENV_VARS,
    extra_env_vars: tuple[str, ...] | Mapping[str, str] = (),
    env_file: str | None = None,
    log_handlers: list[logging.Handler] | None = None,
    max_restarts: int = 0,
    hosts: int | None = None,
    min_hosts: int | None = None,
    heartbeat_timeout: float = 15.0,
    on_event: EventHandler | None = None,
    ssh_config_file: str | None = None,
    srun_args: tuple[str, ...] = (),
    agent_prefix: tuple[str, ...] = (),
    agent_python: str | None = None,
    stall_timeout: float | None = None,
    flight_recorder: bool = False,
    learn_preloads: bool = True,
) -> LaunchResult[T]:
    """Runs ``func(*func_args, **func_kwargs)`` on every worker of every host; see `Launcher`.

    Example:
        >>> import slurmrun
        >>> slurmrun.launch(lambda x: x * 2, (21,), workers_per_host=1).rank(0)
        42
    """
    return Launcher(
        hostnames=hostnames,
        workers_per_host=workers_per_host,
        backend=backend,
        timeout=timeout,
        default_env_vars=default_env_vars,
        extra_env_vars=extra_env_vars,
        env_file=env_file,
        log_handlers=log_handlers,
        max_restarts=max_restarts,
        hosts=hosts,
        min_hosts=min_hosts,
        heartbeat_timeout=heartbeat_timeout,
        on_event=on_event,
        ssh_config_file=ssh_config_file,
        srun_args=srun_args,
        agent_prefix=agent_prefix,
        agent_python=agent_python,
        stall_timeout=stall_timeout,
        flight_recorder=flight_recorder,
        learn_preloads=learn_preloads,
    ).run(func, func_args, func_kwargs)


def _attempts(
    cfg: Launcher, warm: Warm, plan: Plan, payload: bytes, trace: Trace
) -> LaunchResult[Any]:
    """Runs the call, and again after a failure, up to `Launcher.max_restarts` times."""
    lost: dict[str, str] = {}  # hosts lost (`Launcher.min_hosts`), and why
    with sigterm_as_exit():
        for attempt in range(cfg.max_restarts + 1):
            try:
                result = run_attempt(cfg, warm, plan, payload, attempt, trace)
                return replace(result, lost_hosts=dict(lost))
            except (KeyboardInterrupt, SystemExit):
                raise
            except Exception as e:
                if (
                    note_preemption(e, plan.alloc)
                    or attempt == cfg.max_restarts
                    or isinstance(e, VersionMismatchError)  # the same agents would start again
                ):
                    raise
                if isinstance(e, AgentFailedError):
                    trace.emit(AgentFailed, host=e.hostname or "", message=str(e))
                smaller = without_lost_host(cfg, plan, e)
                where = ""
                if smaller is not None and isinstance(e, AgentFailedError):
                    lost[e.hostname] = str(e).split("\n", 1)[0][:500]
                    plan = smaller
                    where = f" on {', '.join(plan.hostnames)} (lost: {', '.join(lost)})"
                trace.emit(
                    Restarting,
                    attempt=attempt + 1,
                    error=type(e).__name__,
                    hosts=tuple(plan.hostnames),
                    lost=tuple(lost),
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
