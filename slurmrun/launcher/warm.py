"""Warm launchers: the agents a `Launcher` keeps from one run to the next, and one attempt.

A cold `launch()` is a warm launcher used once (`Launcher.run` opens one for the call), so
this is the only way a run starts: `run_attempt` readies the kept pool (or starts new agents,
if there are none or they broke), runs one `Run` on it, and drops a pool that broke.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slurmrun.authentication import new_secret
from slurmrun.environment import user_env
from slurmrun.errors import AgentFailedError, OptionsValueError
from slurmrun.events import Trace
from slurmrun.launcher.address import listen
from slurmrun.launcher.agents.common import silence
from slurmrun.launcher.agents.containers import launcher_path
from slurmrun.launcher.plan import Plan
from slurmrun.launcher.pool import AgentPool, PoolBroken
from slurmrun.launcher.run import Run
from slurmrun.launcher.run_setup import Call, Output, Watching
from slurmrun.launcher.watch import StacksWanted
from slurmrun.log_dirs import LogDir, resolve_log_dir
from slurmrun.logs import log_level
from slurmrun.result import LaunchResult
from slurmrun.stacks.control import ControlServer
from slurmrun.start_parts import Surroundings
from slurmrun.variables import RESTART_VAR
from slurmrun.worker_env import flight_recorder_vars, restart_vars

if TYPE_CHECKING:
    from slurmrun.launcher.options import Options
    from slurmrun.stacks.report import StackReport

__all__ = ["MakeRun", "Warm", "run_attempt", "sigterm_as_exit"]

# What makes one attempt's run of what it is given: `Run`, or a map's.
MakeRun = Callable[[AgentPool, Call, Output, Watching], Run]

log = logging.getLogger("slurmrun")


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
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


# Beyond a stacks request's own timeout: how long its asker waits for the run's loop.
ANSWER_SLACK = 5.0
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
    "srun_args",
    "agent_prefix",
    "agent_python",
    "learn_preloads",
    "job",
)


def _agent_options(cfg: Options, plan: Plan) -> dict[str, object]:
    options: dict[str, object] = {name: repr(getattr(cfg, name)) for name in _AGENT_OPTIONS}
    if cfg.job is None:  # a reservation's nodes are its own: fewer once it lost one, or new
        options["hosts"] = plan.hostnames  # after a requeue (its pool starts again then)
    options["backend is None"] = cfg.backend is None  # the spawner imports torch or not
    return options


class Warm:
    """The agents a launcher keeps between runs (`Launcher.open` to `close`), once started."""

    def __init__(self) -> None:
        self.pool: AgentPool | None = None
        self.options: dict[str, object] | None = None
        self.env: dict[str, str] = {}  # the user's variables, as the pool's agents got them
        self.control: ControlServer | None = None  # ``slurmrun stacks``'s way in

    def env_changes(self, now: dict[str, str]) -> tuple[dict[str, str], list[str]]:
        """The user's variables that changed since the agents started, and those now unset.

        A warm launcher's agents keep the environment they started with; each run's workers
        get the variables that `default_env_vars` and `extra_env_vars` select as they are at
        that run (`now`, read once per run: `os.environ` changed between runs included).
        """
        changed = {k: v for k, v in now.items() if self.env.get(k) != v}
        return changed, sorted(k for k in self.env if k not in now)

    def check_unchanged(self, cfg: Options, plan: Plan) -> None:
        """Raises OptionsValueError when what the agents started with changed since then."""
        options = _agent_options(cfg, plan)
        if self.options is None:
            self.options = options
            return
        changed = [name for name in options if options[name] != self.options[name]]
        if changed:
            raise OptionsValueError(
                f"{', '.join(changed)} changed since this launcher started its agents "
                f"({'; '.join(f'{n}: {self.options[n]} -> {options[n]}' for n in changed)}): "
                "its agents keep what they started with. Close it (end the `with` block, or "
                "call close()) and use a new one."
            )

    def stacks(self, timeout: float) -> StackReport | None:
        """Every rank's stacks, from another thread than the run's (None: no run)."""
        found = self.stacks_dump(timeout)
        return None if found is None else found[0]

    def stacks_dump(self, timeout: float) -> tuple[StackReport, Path | None] | None:
        """`stacks`, and where the report was written."""
        pool = self.pool
        if pool is None or pool.run is None:
            return None
        wanted = StacksWanted("asked", timeout)
        pool.events.put(wanted)
        try:
            return wanted.answer.result(timeout + ANSWER_SLACK)
        except TimeoutError:
            return None

    def start_control(self, job: str | None = None) -> None:
        """Lets ``slurmrun stacks`` reach this launcher (`slurmrun.stacks.control`), once.

        It answers ``slurmrun stacks JOB_ID`` for the job it runs in, or the reservation `job`
        it runs on from outside (where that command asks first: this host).
        """
        if self.control is None:
            what = " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))
            job_id = job or os.environ.get("SLURM_JOB_ID", "")
            self.control = ControlServer(self._on_request, what=what[:200], job_id=job_id)
            self.control.start()

    def _on_request(self, op: str, args: dict[str, Any]) -> str:
        if op != "stacks":
            raise ValueError(f"unknown request {op!r}: this launcher answers 'stacks'")
        timeout = min(float(args.get("timeout", 10.0)), 300.0)
        found = self.stacks_dump(timeout)
        if found is None:
            return f"slurmrun: no run in progress in this launcher (pid {os.getpid()})\n"
        report, path = found
        written = f"\n(written to {path})" if path else ""
        return f"{report.format()}{written}\n"

    def close(self) -> None:
        """Stops the kept agents and the control socket."""
        control, self.control = self.control, None
        try:
            self.close_pool()
        finally:
            if control is not None:
                control.close()

    def close_pool(self) -> None:
        """Stops the kept agents, if any (the next run starts new ones)."""
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()

    def ready_pool(
        self, cfg: Options, plan: Plan, env: dict[str, str], trace: Trace | None = None
    ) -> AgentPool:
        """The pool for the next run: the kept one, or new agents if it broke or died idle.

        `env` is the user's variables read for this run (`user_env`): new agents start with it.
        """
        if self.pool is not None and list(self.pool.hostnames) != list(plan.hostnames):
            self.close_pool()  # it runs without a host lost in an earlier launch: plan again
        if self.pool is not None:
            try:
                self.pool.ready()
            except PoolBroken:
                self.close_pool()  # its failure was the last run's error already
            except AgentFailedError as e:
                log.warning("slurmrun: agents failed between runs (%s); starting new ones", e)
                self.close_pool()
        if self.pool is None:
            self.env = env
            self.pool = open_pool(cfg, plan, trace)
        self.pool.trace = trace
        self.start_control(cfg.job)
        return self.pool


def say(line: str) -> None:
    """Prints a line of the launcher's own to the terminal (stderr), as the default handlers do.

    The agents' start (`AgentPool.starting_note`) and a run's summary (`run_launch`) are said
    so with the default `Options.log_handlers` at ``SLURMRUN_LOG_LEVEL`` INFO or below.
    """
    print(line, file=sys.stderr, flush=True)


def open_pool(cfg: Options, plan: Plan, trace: Trace | None = None) -> AgentPool:
    """Starts and connects the agents of `plan`."""
    address = plan.address()
    server = listen(address.bind)
    log_dir: LogDir | None = None
    try:
        log_dir = resolve_log_dir()
        secret = new_secret()
        agent_silence = silence(cfg)
        start = plan.start(
            cfg,
            log_dir,
            secret=secret.hex(),
            advertise=address.advertise,
            port=str(server.getsockname()[1]),
        )
    except BaseException:
        server.close()
        if log_dir is not None and not log_dir.keep:
            shutil.rmtree(log_dir.path, ignore_errors=True)
        raise
    pool = AgentPool(
        hostnames=plan.hostnames,
        starter=start.starter,
        server=server,
        secret=secret,
        connect_timeout=float(cfg.timeout),
        silence=agent_silence,
        log_dir=log_dir,
        trace=trace,
        starting_note=say if cfg.log_handlers is None and log_level() <= logging.INFO else None,
    )
    try:
        pool.open(start.env)
    except AgentFailedError as e:
        pool.close()
        raise explained(e, pool, plan) from e.__cause__
    except BaseException:
        pool.close()
        raise
    return pool


def explained(e: AgentFailedError, pool: AgentPool, plan: Plan) -> AgentFailedError:
    """`e`, or what the plan's kind of agents knows better of why one did not start."""
    return plan.agents.explain(e, pool.starter, plan.hostnames, pool.log_dir)


def run_attempt(  # noqa: PLR0917 - private, called twice
    cfg: Options,
    warm: Warm,
    plan: Plan,
    payload: bytes,
    attempt: int,
    trace: Trace,
    make: MakeRun = Run,
) -> LaunchResult[Any]:
    """One attempt: a run on the kept agents (new ones if there are none, or they broke).

    `make` makes the run of what it is given (a map's: `slurmrun.launcher.mapping`).
    """
    # once per run: what new agents start with, and what changed since
    env = user_env(cfg.default_env_vars, cfg.extra_env_vars)
    pool = warm.ready_pool(cfg, plan, env, trace)
    trace.mark("agents_connected")
    try:
        return _run(cfg, plan, pool, payload, attempt, trace, warm.env_changes(env), make)
    except AgentFailedError as e:
        raise explained(e, pool, plan) from e.__cause__
    finally:
        if pool.broken:  # an agent failed: the next run starts new ones
            warm.close_pool()


def _run(  # noqa: PLR0917 - private, called once
    cfg: Options,
    plan: Plan,
    pool: AgentPool,
    payload: bytes,
    attempt: int,
    trace: Trace,
    env_changes: tuple[dict[str, str], list[str]],
    make: MakeRun,
) -> LaunchResult[Any]:
    log_dir = pool.log_dir
    kept = log_dir.path if log_dir is not None and log_dir.keep else None
    changed, unset = env_changes
    if cfg.flight_recorder:
        recorder_dir = os.path.join(kept or os.getcwd(), "flight_recorder")
        os.makedirs(recorder_dir, exist_ok=True)  # torch writes its dumps there, not makes it
        changed |= flight_recorder_vars(recorder_dir)
    surroundings = Surroundings(
        sys_path=launcher_path(plan.command.contained),
        own_path=plan.command.contained,
        cwd=os.getcwd(),
        env={**changed, RESTART_VAR: str(attempt), **restart_vars(attempt, cfg.max_restarts)},
        unset=unset,
        title=plan.title,
    )
    call = Call(
        payload=payload,
        surroundings=surroundings,
        workers_per_host=plan.workers_per_host,
        backend=cfg.backend,
        timeout=float(cfg.timeout),
        local_master=plan.agents.local_master,
        keep_workers=cfg.keep_workers,
        health_check=cfg.health_check,
        gpu_check=cfg.gpu_check,
    )
    output = Output(
        handlers=cfg.log_handlers,
        log_dir=kept,
        agents_write_logs=plan.agents.writes_logs,
        log_level=log_level(),
        show_ranks=cfg.show_ranks,
    )
    watching = Watching(trace, cfg.stall_timeout, cfg.stragglers, cfg.hang_timeout)
    return make(pool, call, output, watching).run()
