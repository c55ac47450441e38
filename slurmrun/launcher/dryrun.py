"""What a launch would start, without starting it (`Launcher.dry_run`).

`plan_dry_run` asks a plan what a run asks it (the launcher's address, the agents' environment
and starter: `Plan.address`, `Plan.start`) and starts nothing; `DryRun` shows what they gave.
"""

from __future__ import annotations

import json
import reprlib
import shlex
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from slurmrun.launcher.address import wanted_port
from slurmrun.launcher.agents import KINDS
from slurmrun.launcher.agents.starters import local_agent_env
from slurmrun.launcher.plan import Plan
from slurmrun.log_dirs import resolve_log_dir
from slurmrun.variables import JOB_ENV_VAR
from slurmrun.worker_env import preview

if TYPE_CHECKING:
    from slurmrun.launcher.options import Options

__all__ = ["DryRun", "describe_call", "plan_dry_run", "shown_value"]

_WIDTH = 96
# Names whose values a dry run does not show (case-insensitive): HF_TOKEN, WANDB_API_KEY...
SECRET_LOOKING = ("TOKEN", "KEY", "SECRET", "PASSWORD")
SECRET_SHOWN = "<set>"  # noqa: S105 - what is shown instead of a value, not a password


def shown_value(name: str, value: str) -> str:
    """What a dry run shows of variable `name`: its value, or `SECRET_SHOWN` if it looks secret."""
    upper = name.upper()
    return SECRET_SHOWN if any(word in upper for word in SECRET_LOOKING) else value


@dataclass(frozen=True)
class DryRun:
    """The plan of one launch: `str()` prints it, `as_dict()`/`to_json()` give it to scripts.

    Nothing in it is a secret: the launch secret is made only when a launch starts, and the
    environment of the agents is given by names only.

    Attributes:
        job_id: the SLURM job the agents would run in, or None outside SLURM.
        hosts: the hosts, one agent each.
        agents: how the agents start (`slurmrun.launcher.agents.KINDS`): ``"srun"`` (one srun
            step, one task per host), ``"ssh"`` (one ssh per host) or ``"local"``
            (subprocesses).
        workers_per_host: the workers each host gets when the options fix them; None when
            ``"auto"`` (each agent decides on its node when it starts).
        expected_workers: per host, what `workers_per_host` is, or what each agent is
            expected to decide.
        workers_reason: why `expected_workers` (how an agent decides).
        backend: the ``backend`` option (``"auto"``, a backend, or None: no process group).
        expected_backend: the backend workers are expected to use.
        launcher_address: the address agents would connect to.
        bind_address: the address the launcher would listen on.
        address_reason: why `launcher_address` was chosen.
        port: the port from ``SLURMRUN_LAUNCHER_PORT``; None: a free one, chosen at start.
        commands: the command lines that would start the agents (one srun line, or one per
            local agent, with the variables that differ between local agents in front).
        env_names: names of the variables the agents would get (values from the launcher's
            environment, and from the launch itself for ``SLURMRUN_*``).
        env_shown: each of `env_names` with its value, or ``<set>`` for a name that looks
            secret (``*TOKEN*``, ``*KEY*``, ``*SECRET*``, ``*PASSWORD*``, any case).
        log_dir: the log directory a launch now would create; None when files are off.
        warnings: what will go wrong, or is likely to.
        worker_env: what each worker sets on top of its agent's environment (its rank, its
            world: `slurmrun.worker_env`), with rank 0's values (secret-looking ones hidden).
        worker_unset: the names each worker removes from its agent's environment.
        workers_run: what every worker runs (``module.func(args)``, or the script and its
            arguments for the ``slurmrun`` command); empty: not shown.
        spares: hosts kept out of the run to replace a lost one (``hosts``).
        min_hosts: the fewest hosts a restart after a lost host runs on; None: every host.
        max_restarts: the restarts after a failure (a lost host uses one).
        route: how the launcher reaches agents that run already (a reservation's, ``job=``),
            and why; empty: the agents it starts connect to it.
    """

    job_id: str | None
    hosts: tuple[str, ...]
    agents: str
    workers_per_host: tuple[int, ...] | None
    expected_workers: tuple[int, ...]
    workers_reason: str
    backend: str | None
    expected_backend: str | None
    launcher_address: str
    bind_address: str
    address_reason: str
    port: int | None
    commands: tuple[tuple[str, ...], ...]
    env_names: tuple[str, ...]
    log_dir: str | None
    warnings: tuple[str, ...] = ()
    env_shown: tuple[tuple[str, str], ...] = ()
    worker_env: tuple[tuple[str, str], ...] = ()
    worker_unset: tuple[str, ...] = ()
    workers_run: str = ""
    spares: tuple[str, ...] = ()
    min_hosts: int | None = None
    max_restarts: int = 0
    route: str = ""

    @property
    def world_size(self) -> int | None:
        """The number of workers when the options fix it; None when agents decide it."""
        return None if self.workers_per_host is None else sum(self.workers_per_host)

    @property
    def expected_world_size(self) -> int:
        """The number of workers expected (`world_size` when known)."""
        return sum(self.expected_workers)

    def as_dict(self) -> dict[str, Any]:
        """The plan as plain data (lists, str, int, None), ``world_size`` included."""
        data = asdict(self)
        data["world_size"] = self.world_size
        data["expected_world_size"] = self.expected_world_size
        plain: dict[str, Any] = json.loads(json.dumps(data))  # tuples to lists, as JSON reads
        return plain

    def to_json(self, indent: int | None = 2) -> str:
        """The plan as JSON (`as_dict`)."""
        return json.dumps(self.as_dict(), indent=indent)

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def lines(self) -> list[str]:
        """The printable plan, line by line (`str()` joins them)."""
        n = len(self.hosts)
        out = [
            "slurmrun dry run (nothing was started)",
            _row("job", self.job_id or "none (not inside a SLURM job)"),
            _row("hosts", f"{', '.join(self.hosts)} ({n} host{'s' * (n != 1)})"),
            _row("a lost host", self._elastic_text()),
            _row("agents", KINDS[self.agents].shown),
            *([_row("reached", self.route)] if self.route else []),
            _row("workers per host", self._workers_text()),
            _row("world size", self._world_text()),
            _row("backend", self._backend_text()),
            *([_row("workers run", self.workers_run)] if self.workers_run else []),
            _row(
                "launcher address",
                f"{self.launcher_address}:{self.port or '<free port>'} "
                f"(listening on {self.bind_address}): {self.address_reason}",
            ),
            _row("log directory", self.log_dir or "none (SLURMRUN_LOG_DIR='')"),
            f"  command{'s' * (len(self.commands) != 1)}:",
        ]
        out += [_command_text(cmd) for cmd in self.commands]
        if KINDS[self.agents].env_on_stdin and self.env_shown:
            # ssh agents get them on stdin (never on a command line): shown here instead
            out.append(
                f"  environment of the agents ({len(self.env_shown)} variables, sent on ssh's "
                f"stdin; secret-looking ones as {SECRET_SHOWN}):"
            )
            out += [f"    {name}={shlex.quote(value)}" for name, value in self.env_shown]
            return out + self._worker_lines() + self._warning_lines()
        out.append(
            f"  environment of the agents ({len(self.env_names)} variables, names only; "
            "SLURMRUN_SECRET is made fresh by each launch):"
        )
        out += _wrapped(" ".join(self.env_names))
        return out + self._worker_lines() + self._warning_lines()

    def _worker_lines(self) -> list[str]:
        if not self.worker_env:
            return []
        out = [
            f"  each worker adds ({len(self.worker_env)} variables; rank 0's values shown, "
            "each worker has its own):"
        ]
        pairs = " ".join(f"{name}={_shown(value)}" for name, value in self.worker_env)
        if self.worker_unset:
            pairs += " and removes: " + " ".join(self.worker_unset)
        return out + _wrapped(pairs)

    def _warning_lines(self) -> list[str]:
        out: list[str] = []
        if self.warnings:
            out.append("  warnings:")
            for warning in self.warnings:
                out += textwrap.wrap(
                    warning, _WIDTH, initial_indent="    - ", subsequent_indent="      "
                )
        return out

    def _elastic_text(self) -> str:
        if self.max_restarts < 1:
            return "fails the launch (max_restarts=0)"
        if self.spares:
            return (
                f"is replaced by a spare ({', '.join(self.spares)}) at the restart: the world "
                "size stays"
            )
        if self.min_hosts is not None and self.min_hosts < len(self.hosts):
            return f"is left out at the restart, while {self.min_hosts} or more hosts remain"
        return "restarts on every host (min_hosts: none)"

    def _workers_text(self) -> str:
        counts = ", ".join(map(str, self.expected_workers))
        if self.workers_per_host is not None:
            return f"{counts} ({self.workers_reason})"
        return f"auto: decided by each agent; expected {counts} ({self.workers_reason})"

    def _world_text(self) -> str:
        if self.world_size is not None:
            return str(self.world_size)
        return f"decided when the agents connect; expected {self.expected_world_size}"

    def _backend_text(self) -> str:
        if self.backend is None:
            return "none (no process group)"
        if self.backend == "auto":
            return f"auto: nccl on GPU workers, else gloo; expected {self.expected_backend}"
        return self.backend


def describe_call(func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """``module.func(args...)``, each argument's repr cut short: the call every worker makes."""
    short = reprlib.Repr()
    short.maxstring = short.maxother = 40
    name = getattr(func, "__qualname__", None) or type(func).__qualname__
    module = getattr(func, "__module__", None)
    shown = [short.repr(a) for a in args] + [f"{k}={short.repr(v)}" for k, v in kwargs.items()]
    call = f"{module + '.' if module else ''}{name}({', '.join(shown)})"
    return f"{call}, each worker's return value sent back"


def _wrapped(text: str) -> list[str]:
    return textwrap.wrap(
        text, _WIDTH, initial_indent="    ", subsequent_indent="    ", break_on_hyphens=False
    )


def _shown(value: str) -> str:
    """A value for a shell, or a stand-in (``<...>``) for one known only when the run starts."""
    return value if value.startswith("<") and value.endswith(">") else shlex.quote(value)


def _row(name: str, value: str) -> str:
    return f"  {name + ':':<18}{value}"


def _command_text(cmd: tuple[str, ...]) -> str:
    """A command line, shell-quoted, one option per line."""
    return "    " + shlex.join(cmd).replace(" --", " \\\n      --")


# ---------------------------------------------------------------------- a plan's dry run


def plan_dry_run(cfg: Options, plan: Plan, warnings: Sequence[str] = ()) -> DryRun:
    """The `DryRun` of `plan`: what `run_attempt` asks of it, starting nothing."""
    address = plan.address()
    port = wanted_port()
    log_dir = resolve_log_dir(create=False)
    start = plan.start(cfg, log_dir, secret="", advertise=address.advertise, port=str(port or 0))
    env, hosts = start.env, plan.hostnames
    expected = plan.agents.dry_workers(hosts, env)
    way = plan.agents.dry_route()
    counts, reason = expected.counts, expected.reason
    if plan.workers_per_host is not None:
        counts, reason = plan.workers_per_host, "set by workers_per_host"
    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if expected.gpus > 0 else "gloo"
    worker_env: list[tuple[str, str]] = []
    worker_unset: list[str] = []
    if counts and all(counts):  # unknown counts (ssh, auto) show no worker's environment
        worker_env, worker_unset = preview(env, counts, env.get(JOB_ENV_VAR))
    return DryRun(
        job_id=way.job_id if way else plan.alloc.job_id if plan.alloc is not None else None,
        hosts=tuple(hosts),
        agents=plan.agents.name,
        workers_per_host=None if plan.workers_per_host is None else tuple(plan.workers_per_host),
        expected_workers=tuple(counts),
        workers_reason=reason,
        backend=cfg.backend,
        expected_backend=backend,
        launcher_address=address.advertise,
        bind_address=address.bind,
        address_reason=address.reason,
        port=port,
        commands=way.commands if way else start.commands,
        env_names=start.names,
        env_shown=tuple((n, shown_value(n, _dry_value(n, env, hosts))) for n in start.names),
        log_dir=log_dir.path if log_dir.keep else None,
        warnings=tuple(warnings),
        worker_env=tuple((n, shown_value(n, v)) for n, v in worker_env),
        worker_unset=tuple(worker_unset),
        spares=tuple(plan.spares),
        min_hosts=cfg.min_hosts,
        max_restarts=cfg.max_restarts,
        route=way.text if way else "",
    )


def _dry_value(name: str, env: Mapping[str, str], hosts: Sequence[str]) -> str:
    """A variable's value in a dry run (the first agent's, for those that differ by agent)."""
    return {**env, **local_agent_env(0, hosts[0])}.get(name, "")
