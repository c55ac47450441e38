"""A launch's options: the fields of `slurmrun.Launcher`, read by tyro for the command line.

The ground floor of `slurmrun.launcher`: it imports nothing of the rest of the package's
launcher side, which reads a launch's options from here (`Options`). `Launcher` adds the
running to them (`slurmrun.launcher.driver`); `LaunchOptions` is the keyword arguments of
`slurmrun.launch`, the same options but ``keep_workers`` (a warm launcher's).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypedDict, TypeVar

from slurmrun.environment import DEFAULT_ENV_VARS
from slurmrun.events import EventHandler
from slurmrun.keywords import check_keywords

if TYPE_CHECKING:
    import tyro
else:

    class _Tyro:
        """tyro, imported when something reads `Options`' annotations (``tyro.cli``).

        ``import slurmrun`` stays light: tyro is imported by the command, or a user's script.
        """

        def __getattr__(self, name: str) -> Any:
            return getattr(importlib.import_module("tyro"), name)

    tyro = _Tyro()

__all__ = ["Backend", "LaunchOptions", "Options", "option_names"]

_O = TypeVar("_O", bound="Options")
Backend = Literal["nccl", "gloo", "mpi", "ucc", "auto"] | None


@dataclass
class Options:
    """The options of a launch: `slurmrun.Launcher`'s fields (see there), one per line below.

    Each field's docstring is its documentation: ``slurmrun --help`` and tyro show it, the options
    tables of docs/api.md and docs/cli.md are generated from it (`slurmrun.cli.doctables`).
    """

    # The literals first: tyro tries the union's members in order ("auto" is a list of one).
    hostnames: Literal["auto", "slurm"] | list[str] = "auto"
    """Hosts to run on. ``"auto"``: what the allocation providers find (`slurmrun.allocations`:
    the SLURM job's nodes, else ``$SLURMRUN_HOSTFILE``'s hosts, else ``["localhost"]``).
    ``"slurm"``: the job's nodes, and an error outside a job. Agents on the job's nodes start
    with srun (in a one-node job too); outside a job, hosts other than this machine get
    theirs over ssh (`slurmrun.launcher.agents.ssh`)."""

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
    """Handlers for agents' and workers' output records; None: agent 0 and the ranks of
    `show_ranks` live in the terminal, and a file per worker under ``$SLURMRUN_LOG_DIR`` (see
    `slurmrun.logs`)."""

    show_ranks: Literal["all"] | tuple[int, ...] = (0,)
    """The global ranks whose output the terminal shows (with the default `log_handlers`):
    rank 0, or ``"all"``, or some, ``(0, 3)``; each worker's file has its output either way.
    On the command line ``--ranks all``, ``--ranks 0,3``. As torchrun's
    ``--local-ranks-filter``, but of global ranks."""

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
    """Seconds without output, a result or a failure from any rank (counted from its workers'
    start, not while they start) after which every rank's stacks are dumped once (printed,
    written to the log directory, a `slurmrun.events.Stalled` event); the run goes on. None
    (the default): never, as runs are often silent for long on purpose; set it a little above
    your longest quiet stretch."""

    stragglers: bool = True
    """True (the default): samples every rank's Python stack four times a second while a run
    of 2 ranks or more goes on (under 0.5 % of a rank's time: docs/stuck.md) to find the rank
    that works while the others wait for it in a collective: a warning naming the rank, its
    node and where it works, a `slurmrun.events.Straggler` event, and a report in the log
    directory. A rank that waits for a busy CPU is not named. False: no sampling (unless
    `hang_timeout` is set)."""

    hang_timeout: float | Literal["auto"] | None = None
    """Seconds after which a run whose ranks are all stuck, some waiting in a collective and
    none beginning another, fails with `slurmrun.HangError` (naming the ranks that are not
    in it, and where each rank is), so that `max_restarts` can restart it. ``"auto"``: 4
    times the longest gap between collectives seen so far, at least 5 s. None (the default):
    never (the process group's `timeout` still ends a collective). From sampled stacks, as
    `stragglers`: no change to your code (docs/stuck.md)."""

    health_check: str | None = None
    """A shell command each node runs before its workers start (``"nvidia-smi -L"``, a script
    of your site's checks; ``GROUP_RANK`` is the node's index); a node where it fails (exit
    status not 0, or still running after 60 s) is lost: with `min_hosts` or spares (`hosts`)
    the restart leaves it out, else `slurmrun.NodeUnhealthyError` names the node and the
    command's last lines. None (the default): no check. Built-in checks come first: the log
    directory is writable, and the node's GPUs (`gpu_check`)."""

    gpu_check: Literal["auto", "on", "off"] = "auto"
    """The built-in check of the GPUs the job gave each node (``CUDA_VISIBLE_DEVICES``, SLURM's
    gres) before its workers start: ``nvidia-smi -L`` lists them and a tensor can be made on
    each (in a child process: the agent never touches CUDA); a node that fails it is lost as
    one failing `health_check`. ``"auto"`` (the default): on a node with NVIDIA's driver only
    (a node without one, whose GPUs SLURM names, is not judged); ``"on"``: there too, which
    fails saying that the node has no driver; ``"off"``: no check."""

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

    job: str | None = None
    """A reservation's SLURM job id (`slurmrun.reserve`, ``slurmrun reserve``): the launch runs
    on the agents that job keeps, from outside it (the login node); None: as `hostnames` says.
    """

    learn_preloads: bool = True
    """A warm launcher's nodes learn the installed packages that a run's workers import: a
    fork of each node's spawner imports them while the run goes on and serves the next run,
    whose workers start with them loaded; no run waits for it (packages that start threads or
    initialise CUDA when imported are left out; see `slurmrun.node.preloads`). False: workers
    import them at every run. A cold launch (`slurmrun.launch`, `Launcher.run` outside a
    ``with`` block, the command's script mode) learns nothing: no run follows on its agents."""

    def __new__(cls: type[_O], *args: Any, **kwargs: Any) -> _O:
        """Refuses a misspelt option by the name of the class called (``Launcher``).

        Raises:
            OptionsTypeError: a keyword is no option (``did you mean workers_per_host?``).
        """
        check_keywords(cls.__name__, kwargs, option_names())
        return super().__new__(cls)


def option_names() -> list[str]:
    """The options' names (`Options`' fields), in their order."""
    return [f.name for f in fields(Options)]


class LaunchOptions(TypedDict, total=False):
    """`slurmrun.launch`'s keyword arguments: `Options`' fields but ``keep_workers``.

    Each is documented on its `Options` field, with its default; tests/test_typing.py checks
    that both name the same options, and mypy that their types agree (``Launcher(**options)``).
    """

    hostnames: Literal["auto", "slurm"] | list[str]
    workers_per_host: Literal["auto", "slurm"] | int | list[int]
    backend: Backend
    timeout: float
    default_env_vars: tuple[str, ...]
    extra_env_vars: tuple[str, ...] | Mapping[str, str]
    env_file: str | None
    log_handlers: list[logging.Handler] | None
    show_ranks: Literal["all"] | tuple[int, ...]
    max_restarts: int
    hosts: int | None
    min_hosts: int | None
    heartbeat_timeout: float
    ssh_config_file: str | None
    srun_args: tuple[str, ...]
    agent_prefix: tuple[str, ...]
    agent_python: str | None
    on_event: EventHandler | None
    stall_timeout: float | None
    stragglers: bool
    hang_timeout: float | Literal["auto"] | None
    health_check: str | None
    gpu_check: Literal["auto", "on", "off"]
    flight_recorder: bool
    job: str | None
    learn_preloads: bool
