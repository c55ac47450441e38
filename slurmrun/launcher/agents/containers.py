"""The agents' command: srun options of the site's, and a container runtime around the agent.

`Launcher.srun_args` adds options to the agents' srun line; those that slurmrun sets itself
(or that would break its one-task-per-node step) are refused before anything starts.
`Launcher.agent_prefix` is a command every agent runs under (``apptainer exec img.sif``,
``ch-run /images/torch --``, ``podman-hpc run ...``): the agent, its spawner and its workers
then live inside it, while the launcher stays outside. `Launcher.agent_python` is the
interpreter inside (``python3`` by default there, the launcher's own without a container).

`AgentCommand` is that, resolved and checked once per launch (`slurmrun.launcher.plan`).
`start_hint` reads what a node said when its agent could not start, for the usual mistakes:
slurmrun missing inside the image, the runtime missing on the node, a runtime that dropped
the environment.
"""

from __future__ import annotations

import os
import site
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from slurmrun.errors import OptionsTypeError, OptionsValueError
from slurmrun.variables import SECRET_VAR
from slurmrun.versions import slurmrun_version

if TYPE_CHECKING:
    from slurmrun.launcher.options import Options

__all__ = [
    "PLAIN",
    "PYTHON",
    "AgentCommand",
    "agent_command_of",
    "driver_container",
    "launcher_path",
    "no_srun_message",
    "slurmrun_root",
    "start_hint",
]

PYTHON = "{python}"  # in `Launcher.agent_prefix`: where the interpreter goes

# srun's options that slurmrun sets on the agents' step (long name: short name, if any), and
# those that would break a step of one agent per node whose output slurmrun reads.
_OWN_OPTIONS = {
    "--nodes": "-N",
    "--ntasks": "-n",
    "--ntasks-per-node": None,
    "--nodelist": "-w",
    "--exclude": "-x",
    "--cpus-per-task": "-c",
    "--overlap": None,
    "--exclusive": None,
    "--kill-on-bad-exit": "-K",
    "--job-name": "-J",
    "--export": None,
    "--output": "-o",
    "--error": "-e",
    "--input": "-i",
    "--gres": None,
    "--gpus": "-G",
    "--gpus-per-node": None,
    "--gpus-per-task": None,
    "--ntasks-per-gpu": None,
    "--pty": None,
    "--multi-prog": None,
    "--het-group": None,
    "--jobid": None,
    "--relative": "-r",
}
_OWN_SHORT = {short: name for name, short in _OWN_OPTIONS.items() if short}
# pyxis's option: the agent runs inside that image (no prefix needed).
_PYXIS_IMAGE = "--container-image"


@dataclass(frozen=True)
class AgentCommand:
    """How each agent is started on its node, beside srun's own options.

    Attributes:
        prefix: the command the agent runs under (`Launcher.agent_prefix`), ``{python}``
            standing for the interpreter where it must not come last.
        python: the interpreter that runs the agent (`Launcher.agent_python`), resolved.
        srun_args: options added to the agents' srun line (`Launcher.srun_args`).
    """

    prefix: tuple[str, ...] = ()
    python: str = sys.executable
    srun_args: tuple[str, ...] = ()

    @property
    def contained(self) -> bool:
        """Whether the agents run in another environment than the launcher (a container)."""
        return bool(self.prefix) or any(_name(a) == _PYXIS_IMAGE for a in self.srun_args)

    def argv(self, *args: str) -> list[str]:
        """The command that runs ``python *args`` on a node, under the prefix."""
        if PYTHON not in self.prefix:
            return [*self.prefix, self.python, *args]
        return [*(self.python if word == PYTHON else word for word in self.prefix), *args]

    def agent(self) -> list[str]:
        """The agent's command: ``python -m slurmrun.node.agent_main``, under the prefix."""
        return self.argv("-m", "slurmrun.node.agent_main")


# The launcher's own interpreter, no container, no srun option: agents as they always ran.
PLAIN = AgentCommand()


def slurmrun_root() -> str:
    """The directory that holds this very slurmrun package (a checkout's, or site-packages)."""
    here = os.path.abspath(__file__)  # slurmrun/launcher/agents/containers.py
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(here))))


def launcher_path(contained: bool) -> list[str]:
    """The ``sys.path`` workers take from the launcher (`slurmrun.protocol.Start.sys_path`).

    Workers in a container run another interpreter, with its own standard library and
    packages (slurmrun among them): they get only the launcher's entries that are not its
    interpreter's or its slurmrun's (the script's directory, PYTHONPATH's), before their own.
    """
    paths = [p if p else os.getcwd() for p in sys.path]
    if not contained:
        return paths
    package = slurmrun_root()
    interpreter = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    if site.ENABLE_USER_SITE:
        interpreter.add(site.getusersitepackages())
    mine = [os.path.abspath(p) for p in interpreter]
    return [
        p
        for p in paths
        if os.path.abspath(p) != package
        and not any(
            os.path.abspath(p) == d or os.path.abspath(p).startswith(d + os.sep) for d in mine
        )
    ]


def agent_command_of(cfg: Options) -> AgentCommand:
    """`cfg`'s agent command, checked.

    Raises:
        OptionsValueError, OptionsTypeError: an srun option slurmrun sets itself, an option not
            given as one word, or a malformed prefix; the message says what to do.
    """
    srun_args = _words("srun_args", cfg.srun_args)
    prefix = _words("agent_prefix", cfg.agent_prefix)
    for arg in srun_args:
        _check_srun_arg(arg)
    if prefix.count(PYTHON) > 1:
        raise OptionsValueError(f"agent_prefix {list(prefix)} names {PYTHON} more than once")
    if cfg.agent_python is not None and not cfg.agent_python.strip():
        raise OptionsValueError(
            "agent_python is empty: give an interpreter, or None for the default"
        )
    command = AgentCommand(prefix=prefix, srun_args=srun_args)
    # The launcher's path means nothing inside a container.
    default = "python3" if command.contained else command.python
    return replace(command, python=cfg.agent_python or default)


def _words(name: str, value: Iterable[object]) -> tuple[str, ...]:
    if isinstance(value, str):
        raise OptionsTypeError(
            f"{name} must be a sequence of words, one per argument, not the string {value!r} "
            f"(e.g. {name}=({value.split()[0]!r}, ...))"
            if value.split()
            else f"{name} must be a sequence of words, not a string"
        )
    words: list[str] = []
    for word in value:
        if not isinstance(word, str) or not word:
            raise OptionsTypeError(
                f"{name} must hold non-empty strings, got {word!r} in {list(value)}"
            )
        words.append(word)
    return tuple(words)


def _name(arg: str) -> str:
    return arg.split("=", 1)[0]


def _check_srun_arg(arg: str) -> None:
    """Refuses an srun option that is not one word, or one that slurmrun sets itself."""
    if not arg.startswith("-"):
        raise OptionsValueError(
            f"srun_args item {arg!r} is not an option: give each option as one word, its value "
            "after '=' ('--cpu-bind=none', '--reservation=maint'), not as a word of its own"
        )
    name = _name(arg)
    if any(c.isspace() for c in name):
        raise OptionsValueError(
            f"srun_args item {arg!r} holds several words: give each option as its own item"
        )
    if arg.startswith("--"):
        # srun (getopt) takes any unambiguous start of a long option's name as the option.
        own = sorted(o for o in _OWN_OPTIONS if o.startswith(name)) if len(name) > 2 else []
    else:
        own = [_OWN_SHORT[arg[:2]]] if arg[:2] in _OWN_SHORT else []
    if own:
        raise OptionsValueError(
            f"srun_args item {arg!r} conflicts with slurmrun's own {own[0]}: slurmrun starts "
            "one agent per node with --nodes/--ntasks/--nodelist/--cpus-per-task/--gres from "
            "the job, names the step, exports the agents' variables and writes their output. "
            "Choose the nodes with hostnames= or Launcher(hosts=...), the GPUs and CPUs in the "
            "job's own options (salloc/sbatch), and leave the rest to slurmrun."
        )


def start_hint(text: str, host: str) -> str | None:
    """What to do about the usual reasons an agent could not start, from its node's output.

    Args:
        text: the last lines of the agent's output on its node (and srun's).
        host: its node ("" when unknown).
    """
    where = f" on {host}" if host else ""
    if "No module named 'slurmrun'" in text or "No module named slurmrun" in text:
        return (
            f"slurmrun is not importable by the agents' Python{where}. Install slurmrun "
            f"{slurmrun_version()} (the launcher's version) in the Python that runs them there: "
            f"in a container image, `pip install slurmrun=={slurmrun_version()}` (or the path "
            "of this checkout) when you build it; or bind-mount the launcher's environment into "
            "the container and set agent_python to its interpreter. docs/containers.md"
        )
    if ") cannot import '" in text and "which slurmrun needs" in text:  # `missing_dependency`
        return (
            f"the agents' Python{where} lacks a package slurmrun needs (the last lines below "
            "says which, and how to install it). docs/containers.md"
        )
    missing = _missing_program(text)
    if missing is not None:
        return (
            f"{missing!r} was not found{where} (srun could not execute it): install it there, "
            "load its module in the job's environment, or give its full path in agent_prefix "
            "(or agent_python)."
        )
    if f"{SECRET_VAR} is not set" in text:
        return (
            f"the agent{where} started without slurmrun's variables (the launch secret travels "
            "among them): a container runtime that does not pass the environment on drops "
            "them. Apptainer and Charliecloud pass it by default (not with --cleanenv or "
            "--unset-env); podman needs --env-host, or --env=SLURMRUN_* with the other "
            "variables named."
        )
    return None


def _missing_program(text: str) -> str | None:
    """The program that srun (slurmstepd) could not execute: ``execve(): NAME: No such ...``."""
    marker = "execve(): "
    for line in text.splitlines():
        at = line.find(marker)
        if at >= 0 and "No such file or directory" in line:
            return line[at + len(marker) :].split(":", 1)[0].strip()
    return None


# What container runtimes leave in the environment of what they run.
_RUNTIME_VARS = (
    ("APPTAINER_CONTAINER", "Apptainer"),
    ("SINGULARITY_CONTAINER", "Singularity"),
    ("CH_RUNNING", "Charliecloud"),
)
# ... and in the filesystem: podman's and docker's marker files.
_RUNTIME_FILES = (("/run/.containerenv", "podman"), ("/.dockerenv", "docker"))


def driver_container(environ: Mapping[str, str], root: str = "/") -> str | None:
    """The container runtime this process runs under, when it tells; None: none seen.

    Args:
        environ: this process's environment.
        root: the filesystem root to look for marker files under (tests give another).
    """
    for name, runtime in _RUNTIME_VARS:
        if environ.get(name):
            return runtime
    for path, runtime in _RUNTIME_FILES:
        if os.path.exists(os.path.join(root, path.lstrip("/"))):
            return runtime
    if environ.get("container"):  # systemd's convention, set by podman and others
        return environ["container"]
    return None


def no_srun_message(environ: Mapping[str, str] | None = None, root: str = "/") -> str:
    """Why the launcher cannot start agents in a SLURM job here, and what to do."""
    environ = os.environ if environ is None else environ
    runtime = driver_container(environ, root)
    if runtime is None:
        return (
            "srun was not found on PATH, but a SLURM allocation was detected: load SLURM's "
            "client (its module, or add its bin directory to PATH)"
        )
    return (
        f"srun was not found on PATH, but a SLURM allocation was detected: this process runs "
        f"inside a container ({runtime}), and images rarely hold SLURM's client (nor could it "
        "talk to slurmctld from there). Run the launcher outside the container, on the node or "
        "the login node, and the agents inside it: agent_prefix=('apptainer', 'exec', "
        "'img.sif') or ('ch-run', '/path/to/image', '--'), or with pyxis "
        "srun_args=('--container-image=...',). See docs/containers.md."
    )
