"""The public entry: `Launcher` (a dataclass of options) and `launch` (a call of it)."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import shutil
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from slurmrun import allocation, allocations, srun
from slurmrun.dryrun import DryRun
from slurmrun.environment import DEFAULT_ENV_VARS, env_file_problem, matching_env
from slurmrun.errors import AgentFailedError
from slurmrun.events import AgentFailed, EventHandler, LaunchStarted, Restarting, Trace
from slurmrun.listener import LISTEN_BACKLOG
from slurmrun.logs import LogDir, log_level, resolve_log_dir
from slurmrun.pool import AgentPool
from slurmrun.protocol import (
    ENV_FILE_VAR,
    HEARTBEAT_VAR,
    HEARTBEATS_PER_TIMEOUT,
    JOB_TASKS_VAR,
    LAUNCHER_ADDR_VAR,
    PORT_VAR,
    PRELOAD_VAR,
    RESTART_VAR,
    SECRET_VAR,
)
from slurmrun.result import LaunchResult
from slurmrun.session import Session
from slurmrun.ssh import SshAgents, ssh_hostname
from slurmrun.starters import (
    AgentStarter,
    LocalAgents,
    SrunAgents,
    agent_command,
    local_agent_env,
    package_pythonpath,
)
from slurmrun.transport import dumps, dumps_inband, new_secret

if TYPE_CHECKING:
    import tyro
else:

    class _Tyro:
        """tyro, imported when something reads `Launcher`'s annotations (``tyro.cli``).

        ``import slurmrun`` stays light: tyro is imported by the command, or a user's script.
        """

        def __getattr__(self, name: str) -> Any:
            return getattr(importlib.import_module("tyro"), name)

    tyro = _Tyro()

__all__ = ["Launcher", "check_call", "launch"]

T = TypeVar("T")
log = logging.getLogger("slurmrun")

Backend = Literal["nccl", "gloo", "mpi", "ucc", "auto"] | None
BACKENDS = ("nccl", "gloo", "mpi", "ucc", "auto", None)
_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}


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
    theirs over ssh (`slurmrun.ssh`)."""

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
    """More patterns, added to `default_env_vars`; or a mapping of names to values that agents
    and workers get on top of the variables the patterns pass (e.g. ``{"NCCL_DEBUG": "INFO"}``)."""

    env_file: str | None = None
    """A bash file that each agent sources before it starts workers; its exports reach them."""

    log_handlers: Annotated[list[logging.Handler] | None, tyro.conf.Suppress] = None
    """Handlers for agents' and workers' output records; None: rank 0 and agent 0 live in the
    terminal, and a file per worker under ``$SLURMRUN_LOG_DIR`` (see `slurmrun.logs`)."""

    max_restarts: int = 0
    """How often the whole worker group is started again after a failure (same world size;
    workers see ``SLURMRUN_RESTART_COUNT``). The error is raised after the last attempt."""

    heartbeat_timeout: float = 15.0
    """Seconds without a heartbeat (five per period, each way) after which an agent counts as
    dead (a hung node, or one the network lost), and after which agents stop their workers
    when the launcher is silent (its host vanished, or it hung)."""

    ssh_config_file: str | None = None
    """An ssh config file (``ssh -F``) for hosts started over ssh; None: ssh's own default
    (``~/.ssh/config``)."""

    on_event: Annotated[EventHandler | None, tyro.conf.Suppress] = None
    """Called with each `slurmrun.events.Event` of a launch (from a thread of its own: a slow
    or raising handler never stalls the launch). ``$SLURMRUN_EVENTS_FILE`` also gets them."""

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
        return plan_dry_run(self, _plan(self))

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
        if _warm_of(self) is None:
            setattr(self, _WARM_ATTR, _Warm())  # not a dataclass field: tyro reads those
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Closes the agents (`close`)."""
        self.close()

    def close(self) -> None:
        """Stops the agents kept by a ``with`` block (workers first); does nothing otherwise.

        Rules of a warm launcher: an agent that fails during a run (its process, its node,
        its heartbeats) fails that run with AgentFailedError and the next run starts every
        agent again (one new srun step), as does an agent that died between runs (with a
        warning); a failed worker or a Ctrl-C ends only that run's workers. Changing
        ``hostnames``, ``workers_per_host`` or what agents start with (environment, env file,
        heartbeat and connect timeouts, backend None) between runs is a ValueError: close the
        launcher first. After `close`, `run` is a cold launch again.
        """
        warm = _warm_of(self)
        if warm is not None:
            setattr(self, _WARM_ATTR, None)
            warm.close_pool()

    def _run(
        self,
        func: Callable[..., T],
        func_args: Sequence[Any],
        func_kwargs: dict[str, Any] | None,
    ) -> LaunchResult[T]:
        kwargs = {} if func_kwargs is None else func_kwargs
        payload = check_call(self, func, func_args, kwargs)
        plan = _plan(self)
        if _warm_of(self) is None:
            with self:  # a cold launch is a warm launcher used once
                return self._run_planned(plan, payload)
        return self._run_planned(plan, payload)

    def _run_planned(self, plan: _Plan, payload: bytes) -> LaunchResult[Any]:
        warm = _warm_of(self)
        assert warm is not None  # noqa: S101 - _run opened it
        warm.check_unchanged(self, plan)
        trace = Trace(self.on_event)
        counts = plan.workers_per_host
        trace.emit(
            LaunchStarted,
            hosts=tuple(plan.hostnames),
            world_size=None if counts is None else sum(counts),
        )
        error: BaseException | None = None
        try:
            result = self._attempts(warm, plan, payload, trace)
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

    def _attempts(
        self, warm: _Warm, plan: _Plan, payload: bytes, trace: Trace
    ) -> LaunchResult[Any]:
        with _sigterm_as_exit():
            for attempt in range(self.max_restarts + 1):
                try:
                    return _run_plan(self, warm, plan, payload, attempt, trace)
                except (KeyboardInterrupt, SystemExit):
                    raise
                except Exception as e:
                    if attempt == self.max_restarts:
                        raise
                    if isinstance(e, AgentFailedError):
                        trace.emit(AgentFailed, host=e.hostname or "", message=str(e))
                    trace.emit(Restarting, attempt=attempt + 1, error=type(e).__name__)
                    log.warning(
                        "slurmrun: attempt %d of %d failed (%s: %s); restarting the workers",
                        attempt + 1,
                        self.max_restarts + 1,
                        type(e).__name__,
                        e,
                    )
        raise AssertionError("unreachable")  # pragma: no cover


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
    heartbeat_timeout: float = 15.0,
    on_event: EventHandler | None = None,
    ssh_config_file: str | None = None,
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
        heartbeat_timeout=heartbeat_timeout,
        on_event=on_event,
        ssh_config_file=ssh_config_file,
    ).run(func, func_args, func_kwargs)


# ---------------------------------------------------------------------- validation


def check_call(
    cfg: Launcher, func: Callable[..., Any], func_args: Sequence[Any], func_kwargs: dict[str, Any]
) -> bytes:
    """Validates options and the call, and returns the pickled call (before anything starts)."""
    _validate(cfg, func, func_args, func_kwargs)
    return _pickle_call(func, tuple(func_args), func_kwargs)


def _validate(cfg: Launcher, func: object, func_args: object, func_kwargs: object) -> None:
    if not callable(func):
        raise TypeError(f"func must be callable (a function or lambda), got {type(func).__name__}")
    if not isinstance(func_args, Sequence) or isinstance(func_args, str | bytes):
        raise TypeError(f"func_args must be a tuple or list, got {type(func_args).__name__}")
    if not isinstance(func_kwargs, dict) or not all(isinstance(k, str) for k in func_kwargs):
        raise TypeError("func_kwargs must be a dict with str keys, or None")
    _validate_hostnames(cfg.hostnames)
    _validate_workers(cfg.workers_per_host, cfg.hostnames)
    if cfg.backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {cfg.backend!r}")
    _validate_env_and_logs(cfg)
    restarts = cfg.max_restarts
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise ValueError(f"max_restarts must be an int >= 0, got {restarts!r}")
    for name in ("heartbeat_timeout", "timeout"):
        seconds = getattr(cfg, name)
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds <= 0:
            raise ValueError(f"{name} must be a positive number of seconds, got {seconds!r}")


def _validate_env_and_logs(cfg: Launcher) -> None:
    for name in ("default_env_vars", "extra_env_vars"):
        patterns = getattr(cfg, name)
        if name == "extra_env_vars" and isinstance(patterns, Mapping):
            _validate_env_mapping(patterns)
            continue
        if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
            raise TypeError(f"{name} must be a tuple of fnmatch patterns, got {patterns!r}")
    if cfg.ssh_config_file is not None and not os.path.isfile(cfg.ssh_config_file):
        raise ValueError(f"ssh_config_file={cfg.ssh_config_file!r} is not a file")
    if cfg.on_event is not None and not callable(cfg.on_event):
        raise TypeError(f"on_event must be callable (or None), got {cfg.on_event!r}")
    problem = env_file_problem(cfg.env_file)
    if problem:
        raise ValueError(f"{problem}: pass the path of a bash file for agents to source")
    if cfg.log_handlers is not None and not all(
        isinstance(h, logging.Handler) for h in cfg.log_handlers
    ):
        raise TypeError("log_handlers must be a list of logging.Handler objects (or None)")
    log_level()  # a bad SLURMRUN_LOG_LEVEL is an error before anything starts


def _validate_env_mapping(variables: Mapping[object, object]) -> None:
    for name, value in variables.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError(
                "extra_env_vars as a mapping must map variable names to str values, got "
                f"{name!r}: {value!r}"
            )
        # Names travel in srun's comma-separated --export list.
        if not name or "=" in name or "," in name or "\0" in name or "\0" in value:
            raise ValueError(f"extra_env_vars: {name!r} is not a valid environment variable name")


def _validate_hostnames(h: object) -> None:
    if isinstance(h, str):
        if h not in ("auto", "slurm"):
            raise ValueError(
                f"hostnames must be a list of host names, 'auto' or 'slurm', got {h!r} "
                f"(for one host, pass [{h!r}])"
            )
    elif not isinstance(h, list | tuple) or not h:
        raise ValueError("hostnames is empty: pass a list of host names, 'auto' or 'slurm'")
    elif not all(isinstance(x, str) and x.strip() for x in h):
        raise ValueError(f"hostnames must be non-empty strings, got {h!r}")


def _validate_workers(w: object, h: object) -> None:
    expected = "an int, a list of ints, 'auto' or 'slurm'"
    if isinstance(w, str):
        if w not in ("auto", "slurm"):
            raise ValueError(f"workers_per_host must be {expected}, got {w!r}")
    elif isinstance(w, bool) or not isinstance(w, int | list | tuple):
        raise TypeError(f"workers_per_host must be {expected}, got {w!r}")
    elif isinstance(w, int):
        if w <= 0:
            raise ValueError(f"workers_per_host must be at least 1, got {w}")
    else:
        if not w or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in w):
            raise ValueError(f"workers_per_host must list positive ints (one per host), got {w!r}")
        if isinstance(h, list | tuple) and len(w) != len(h):
            raise ValueError(
                f"workers_per_host has {len(w)} entries but hostnames has {len(h)}: give one "
                "count per host, or a single int for all"
            )


def _pickle_call(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    try:
        return dumps_inband((func, args, kwargs))
    except Exception as first_error:
        # Say which part could not be pickled (pickling each part again costs only here).
        for what, obj in (("func", func), ("func_args", args), ("func_kwargs", kwargs)):
            try:
                dumps(obj)
            except Exception as e:
                raise TypeError(
                    f"{what} could not be pickled to send to the workers: {type(e).__name__}: "
                    f"{e}. Everything {what} holds must be picklable by cloudpickle (locks, "
                    "open files, sockets and generators are not); create such objects inside "
                    "func instead."
                ) from e
        raise TypeError(f"the call could not be pickled: {first_error}") from first_error


# ---------------------------------------------------------------------- planning


@dataclass(frozen=True)
class _Plan:
    hostnames: list[str]
    workers_per_host: list[int] | None
    alloc: allocation.SlurmAllocation | None
    local: bool
    ssh: bool = False  # agents over ssh (hosts outside SLURM)
    provider: str = ""  # the allocation provider that found the hosts ("auto")
    ssh_config_file: str | None = None


def _is_local(host: str) -> bool:
    return host in _LOCAL_NAMES or host == socket.gethostname()


def _plan(cfg: Launcher, *, check_driver_step: bool = True) -> _Plan:
    alloc = allocation.slurm_allocation()
    for name, value in (("hostnames", cfg.hostnames), ("workers_per_host", cfg.workers_per_host)):
        if value == "slurm" and alloc is None:
            raise RuntimeError(
                f"{name}='slurm' but no SLURM allocation was found (SLURM_JOB_ID is not set). "
                "Run inside salloc or an sbatch script, or pass 'auto' to fall back to localhost."
            )
    found: allocations.Hosts | None = None
    if cfg.hostnames == "auto":
        found = allocations.detect()
        hosts = list(found.hostnames)
    elif cfg.hostnames == "slurm":
        assert alloc is not None  # noqa: S101 - checked above
        hosts = list(alloc.hostnames)
    else:
        hosts = list(cfg.hostnames)
    if found is not None and found.agents != "srun":
        return _provided_plan(cfg, found)
    # A job's nodes, one of them this machine included, get their agents from srun: the agents
    # then live in the job (its SLURM_* variables, its GPUs and CPUs, its accounting) just
    # as on several nodes. Local agents are for hosts that are not the job's ("localhost").
    local = alloc is None or not all(h in alloc.hostnames for h in hosts)
    if local and not all(_is_local(h) for h in hosts):
        if alloc is None:  # hosts outside any scheduler: their agents start over ssh
            counts = _counts(cfg.workers_per_host, hosts)
            return _Plan(hosts, counts, None, False, ssh=True, ssh_config_file=cfg.ssh_config_file)
        unknown = [h for h in hosts if h not in alloc.hostnames]
        raise ValueError(
            f"hostnames {unknown} are not nodes of SLURM job {alloc.job_id}, whose nodes are "
            f"{alloc.hostnames}"
        )
    if not local and len(set(hosts)) != len(hosts):
        raise ValueError(f"hostnames lists a node twice ({hosts}); srun starts one agent per node")
    if not local and alloc is not None and check_driver_step:
        _check_driver_step(alloc)
    return _Plan(hosts, _counts(cfg.workers_per_host, hosts), alloc, local)


def _counts(w: int | list[int] | str, hosts: list[str]) -> list[int] | None:
    if isinstance(w, str):
        return None
    if isinstance(w, int):
        return [w] * len(hosts)
    if len(w) != len(hosts):
        raise ValueError(
            f"workers_per_host has {len(w)} entries but there are {len(hosts)} hosts "
            f"({hosts}): give one count per host, or a single int"
        )
    return list(w)


def _provided_plan(cfg: Launcher, found: allocations.Hosts) -> _Plan:
    """The plan for the hosts of an allocation provider whose agents are local or ssh ones."""
    hosts = list(found.hostnames)
    counts = _counts(cfg.workers_per_host, hosts)
    if counts is None and found.workers_per_host is not None:
        counts = list(found.workers_per_host)
    if found.agents == "local" and not all(_is_local(h) for h in hosts):
        raise ValueError(
            f"the allocation provider {found.provider!r} found hosts {hosts} and asks for local "
            "agents, but not all of them are this machine"
        )
    local = found.agents == "local"
    return _Plan(
        hosts,
        counts,
        None,
        local,
        ssh=not local,
        provider=found.provider,
        ssh_config_file=cfg.ssh_config_file,
    )


def _check_driver_step(alloc: allocation.SlurmAllocation) -> None:
    """Refuses to launch from each of several tasks of one step: they would share the nodes."""
    step = alloc.driver_step
    if step is None or step.num_tasks <= 1:
        return
    raise RuntimeError(
        f"slurmrun.launch runs in SLURM step {step.step_id}, which has {step.num_tasks} tasks "
        f"(this is task {step.proc_id}): every task would launch workers on every node of "
        f"job {alloc.job_id}, and they would fight over its GPUs and CPUs. Start the script "
        "that calls launch() once: `python train.py` in the batch script or the salloc "
        "shell, or `srun -N1 -n1 python train.py`. slurmrun starts one agent per node itself."
    )


# ---------------------------------------------------------------------- dry runs


def plan_dry_run(cfg: Launcher, plan: _Plan, warnings: Sequence[str] = ()) -> DryRun:
    """The `DryRun` of `plan`: built by the planning steps `_run_plan` takes, starting nothing."""
    address = _launcher_addr(plan)
    port = _wanted_port()
    log_dir = resolve_log_dir(create=False)
    control = _control(cfg, "", address.advertise, str(port or 0))
    starter, env = _starter(cfg, plan, log_dir, control)
    hosts = plan.hostnames
    if isinstance(starter, SrunAgents):
        commands = [tuple(starter.command)]
        export = next(a for a in starter.command if a.startswith("--export="))
        names = export.removeprefix("--export=").split(",")
        gres = next((a for a in starter.command if a.startswith("--gres=gpu:")), "")
        gpus = int(gres.rsplit(":", 1)[1]) if gres else 0
    elif isinstance(starter, SshAgents):
        commands = [tuple(command) for command in starter.commands(env)]
        names = sorted({*env, *local_agent_env(0, hosts[0])} - {SECRET_VAR})
        gpus = 0  # each host's own: unknown here
    else:
        per_agent = [local_agent_env(rank, host) for rank, host in enumerate(hosts)]
        commands = [
            (*(f"{k}={v}" for k, v in extra.items()), *agent_command()) for extra in per_agent
        ]
        names = sorted({*env, *per_agent[0]})
        gpus = allocation.visible_gpu_count(env)  # local agents see this machine's GPUs
    if plan.ssh and plan.workers_per_host is None:
        counts, reason = [0] * len(hosts), "each agent decides on its host (0: unknown here)"
    else:
        counts, reason = _expected_workers(plan, env, gpus)
    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if gpus > 0 else "gloo"
    return DryRun(
        job_id=plan.alloc.job_id if plan.alloc is not None else None,
        hosts=tuple(hosts),
        agents="local" if plan.local else "ssh" if plan.ssh else "srun",
        workers_per_host=None if plan.workers_per_host is None else tuple(plan.workers_per_host),
        expected_workers=tuple(counts),
        workers_reason=reason,
        backend=cfg.backend,
        expected_backend=backend,
        launcher_address=address.advertise,
        bind_address=address.bind,
        address_reason=address.reason,
        port=port,
        commands=tuple(commands),
        env_names=tuple(names),
        log_dir=log_dir.path if log_dir.keep else None,
        warnings=tuple(warnings),
    )


def _expected_workers(plan: _Plan, env: Mapping[str, str], gpus: int) -> tuple[list[int], str]:
    """Workers per host, and why: as set, or as each agent is expected to decide on its node."""
    if plan.workers_per_host is not None:
        return plan.workers_per_host, "set by workers_per_host"
    if gpus > 0:
        where = "it sees" if plan.local else f"of its step (--gres=gpu:{gpus})"
        return [gpus] * len(plan.hostnames), f"one per GPU {where}"
    if plan.local:
        counts = [
            allocation.agent_auto_workers({**env, **local_agent_env(rank, host)}, host)
            for rank, host in enumerate(plan.hostnames)
        ]
        if not (env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")):
            return counts, "no GPU: one per CPU the agent may use"
        return counts, "no GPU: the job's tasks on the node, else 1"
    alloc = plan.alloc
    assert alloc is not None  # noqa: S101 - srun agents run in a job
    if alloc.tasks_per_node is None:
        return [1] * len(plan.hostnames), "no GPU, and the job's tasks per node are unknown: 1"
    source = alloc.sources.get("tasks_per_node", "the job")
    return [alloc.tasks_per_node[alloc.node_index(h)] for h in plan.hostnames], (
        f"no GPU in its step: the job's tasks on its node ({source}, passed on as {JOB_TASKS_VAR})"
    )


# ---------------------------------------------------------------------- running


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit during a launch, so that agents are stopped on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass(frozen=True)
class _Address:
    bind: str
    advertise: str  # what agents connect to
    reason: str  # why, for people (dry runs, `slurmrun info`)


def _launcher_addr(plan: _Plan) -> _Address:
    if plan.local:
        return _Address("127.0.0.1", "127.0.0.1", "loopback: the agents run on this machine")
    override = os.environ.get(LAUNCHER_ADDR_VAR)
    if override:
        return _Address("0.0.0.0", override, f"{LAUNCHER_ADDR_VAR} is set")  # noqa: S104
    first = plan.hostnames[0]
    # An ssh host may be an alias of the ssh config: route toward the name it stands for.
    target = ssh_hostname(first, plan.ssh_config_file) if plan.ssh else first
    return _Address(
        "0.0.0.0",  # noqa: S104 - agents on other nodes must reach us
        srun.address_toward(target),
        f"this machine's address on the route toward {first}, the first node",
    )


def _agent_env(
    cfg: Launcher, control: dict[str, str], environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """What agents start with: the matching variables of ours, the given ones, the launch's."""
    environ = os.environ if environ is None else environ
    extra = cfg.extra_env_vars
    patterns = [*cfg.default_env_vars, *([] if isinstance(extra, Mapping) else extra)]
    env = matching_env(environ, patterns)
    if isinstance(extra, Mapping):
        env.update(extra)
    env.update(control)
    return env


def _silence(cfg: Launcher) -> float:
    """How long an agent may be silent before it counts as dead, and the launcher for agents.

    Heartbeats must come often enough for the shorter of the two timeouts.
    """
    return float(min(cfg.timeout, cfg.heartbeat_timeout))


def _control(cfg: Launcher, secret: str, advertise: str, port: str) -> dict[str, str]:
    """The variables the launcher sets for its agents (`_starter` adds the job's tasks)."""
    control = {
        SECRET_VAR: secret,
        LAUNCHER_ADDR_VAR: advertise,
        PORT_VAR: port,
        # Modules the spawner imports before forking workers; the command's script mode asks
        # for torch although it initialises no process group.
        PRELOAD_VAR: os.environ.get(PRELOAD_VAR) or ("" if cfg.backend is None else "torch"),
        "PYTHONPATH": package_pythonpath(os.environ),
        HEARTBEAT_VAR: str(max(0.05, _silence(cfg) / HEARTBEATS_PER_TIMEOUT)),
    }
    if cfg.env_file:
        control[ENV_FILE_VAR] = os.path.abspath(cfg.env_file)
    return control


def _starter(
    cfg: Launcher, plan: _Plan, log_dir: LogDir, control: dict[str, str]
) -> tuple[AgentStarter, dict[str, str]]:
    """The agents' starter, and the environment to start them with."""
    if plan.alloc is not None and plan.alloc.tasks_per_node is not None:
        control[JOB_TASKS_VAR] = ",".join(map(str, plan.alloc.tasks_per_node))
    if plan.local:
        return LocalAgents(plan.hostnames, log_dir.path), _agent_env(cfg, control)
    if plan.ssh:
        return SshAgents(plan.hostnames, log_dir.path, cfg.ssh_config_file), _agent_env(
            cfg, control
        )
    assert plan.alloc is not None  # noqa: S101 - _plan guarantees an allocation here
    # srun runs with our environment less what would reshape the agents' step (the driver's
    # own step, SLURM_CPUS_PER_TASK...); the agents get only the names listed in --export,
    # with their values taken from srun's environment, so no value is on a command line.
    environ = srun.srun_environment(os.environ)
    agent_env = _agent_env(cfg, control, environ)
    starter = srun.srun_agents(
        plan.alloc, plan.hostnames, log_dir.path, sorted(agent_env), node_logs=log_dir.keep
    )
    return starter, {**environ, **agent_env}


def _step_order(plan: _Plan) -> list[str]:
    """The agents' step's nodes in SLURM's task order (the job's node order)."""
    alloc = plan.alloc
    return sorted(plan.hostnames, key=alloc.node_index) if alloc else list(plan.hostnames)


def _wanted_port() -> int | None:
    """The port asked for in ``SLURMRUN_LAUNCHER_PORT``; None: any free one."""
    wanted = os.environ.get(PORT_VAR, "")
    if not wanted:
        return None
    if not wanted.isdigit() or not 0 < int(wanted) < 65536:
        raise ValueError(f"{PORT_VAR}={wanted!r} is not a TCP port number (1-65535)")
    return int(wanted)


def _listen(bind: str) -> socket.socket:
    wanted = _wanted_port()
    if wanted is None:
        return socket.create_server((bind, 0), backlog=LISTEN_BACKLOG)
    try:
        return socket.create_server((bind, wanted), backlog=LISTEN_BACKLOG)
    except OSError as e:
        raise OSError(
            e.errno,
            f"the launcher cannot listen on {PORT_VAR}={wanted} ({e.strerror}): another "
            "process (or a launch not yet finished) holds it. Free it, pick another port, or "
            f"unset {PORT_VAR} to let slurmrun choose a free one.",
        ) from e


# ---------------------------------------------------------------------- warm launchers

_WARM_ATTR = "_slurmrun_warm"
# What the agents were started with: changing one between runs would need new agents.
_AGENT_OPTIONS = (
    "hostnames",
    "workers_per_host",
    "default_env_vars",
    "extra_env_vars",
    "env_file",
    "heartbeat_timeout",
    "timeout",
    "ssh_config_file",
)


def _warm_of(cfg: Launcher) -> _Warm | None:
    warm: _Warm | None = getattr(cfg, _WARM_ATTR, None)
    return warm


def _agent_options(cfg: Launcher, plan: _Plan) -> dict[str, object]:
    options: dict[str, object] = {name: repr(getattr(cfg, name)) for name in _AGENT_OPTIONS}
    options["hosts"] = plan.hostnames
    options["backend is None"] = cfg.backend is None  # the spawner imports torch or not
    return options


class _Warm:
    """The agents a launcher keeps between runs (`Launcher.__enter__`), once started."""

    def __init__(self) -> None:
        self.pool: AgentPool | None = None
        self.options: dict[str, object] | None = None

    def check_unchanged(self, cfg: Launcher, plan: _Plan) -> None:
        options = _agent_options(cfg, plan)
        if self.options is None:
            self.options = options
            return
        changed = [name for name in options if options[name] != self.options[name]]
        if changed:
            raise ValueError(
                f"{', '.join(changed)} changed since this launcher started its agents "
                f"({'; '.join(f'{n}: {self.options[n]} -> {options[n]}' for n in changed)}): "
                "its agents keep what they started with. Close it (end the `with` block, or "
                "call close()) and use a new one."
            )

    def close_pool(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()

    def ready_pool(self, cfg: Launcher, plan: _Plan, trace: Trace | None = None) -> AgentPool:
        """The pool for the next run: the kept one, or new agents if it broke or died idle."""
        if self.pool is not None:
            try:
                self.pool.ready()
            except AgentFailedError as e:
                if self.pool.broken != "closed" and "cannot run again" not in str(e):
                    log.warning("slurmrun: agents failed between runs (%s); starting new ones", e)
                self.close_pool()
        if self.pool is None:
            self.pool = _open_pool(cfg, plan, trace)
        self.pool.trace = trace
        return self.pool


def _open_pool(cfg: Launcher, plan: _Plan, trace: Trace | None = None) -> AgentPool:
    """Starts and connects the agents of `plan`."""
    address = _launcher_addr(plan)
    server = _listen(address.bind)
    log_dir: LogDir | None = None
    try:
        log_dir = resolve_log_dir()
        secret = new_secret()
        control = _control(cfg, secret.hex(), address.advertise, str(server.getsockname()[1]))
        starter, env = _starter(cfg, plan, log_dir, control)
    except BaseException:
        server.close()
        if log_dir is not None and not log_dir.keep:
            shutil.rmtree(log_dir.path, ignore_errors=True)
        raise
    pool = AgentPool(
        hostnames=plan.hostnames,
        starter=starter,
        server=server,
        secret=secret,
        connect_timeout=float(cfg.timeout),
        silence=_silence(cfg),
        log_dir=log_dir,
        trace=trace,
    )
    try:
        pool.open(env)
    except AgentFailedError as e:
        pool.close()
        raise _explained(e, pool, plan) from e.__cause__
    except BaseException:
        pool.close()
        raise
    return pool


def _explained(e: AgentFailedError, pool: AgentPool, plan: _Plan) -> AgentFailedError:
    """`e`, or the node log srun could not open that explains it."""
    starter, log_dir = pool.starter, pool.log_dir
    if not isinstance(starter, SrunAgents) or log_dir is None or not log_dir.keep:
        return e
    failure = srun.log_open_failure(starter.log_path, _step_order(plan), log_dir.path)
    if failure is None:
        return e
    host, message = failure
    error = AgentFailedError(
        message, hostname=host, log_file=starter.log_path, stderr_tail=e.stderr_tail
    )
    error.__cause__ = e
    return error


def _run_plan(  # noqa: PLR0917 - private, called once
    cfg: Launcher, warm: _Warm, plan: _Plan, payload: bytes, attempt: int, trace: Trace
) -> LaunchResult[Any]:
    """One attempt: a run on the kept agents (new ones if there are none, or they broke)."""
    pool = warm.ready_pool(cfg, plan, trace)
    trace.mark("agents_connected")
    try:
        return _run_session(cfg, plan, pool, payload, attempt, trace)
    except AgentFailedError as e:
        raise _explained(e, pool, plan) from e.__cause__
    finally:
        if pool.broken:  # an agent failed: the next run starts new ones
            warm.close_pool()


def _run_session(  # noqa: PLR0917 - private, called once
    cfg: Launcher, plan: _Plan, pool: AgentPool, payload: bytes, attempt: int, trace: Trace
) -> LaunchResult[Any]:
    log_dir = pool.log_dir
    session = Session(
        pool=pool,
        workers_per_host=plan.workers_per_host,
        backend=cfg.backend,
        timeout=float(cfg.timeout),
        grace=3.0,
        payload=payload,
        start_header={
            "sys_path": [p if p else os.getcwd() for p in sys.path],
            "cwd": os.getcwd(),
            "env": {RESTART_VAR: str(attempt)},
        },
        local_master=plan.local,
        handlers=cfg.log_handlers,
        log_dir=log_dir.path if log_dir is not None and log_dir.keep else None,
        agents_write_logs=isinstance(pool.starter, (LocalAgents, SrunAgents)),
        log_level=log_level(),
        trace=trace,
    )
    return session.run()
