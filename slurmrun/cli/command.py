"""The ``slurmrun`` command line's shape: launcher options, then the script and its arguments.

`split_command` cuts a command line where the launcher's options end (the fields of
`slurmrun.Launcher`, parsed by tyro in `parse_launcher`) and the script's (or ``-m
MODULE``'s) begin; `slurmrun.cli.run` (``slurmrun SCRIPT.py``) and `slurmrun.cli.submit`
(``slurmrun submit SCRIPT.py``) both read it from here, and the verbs share the job folder's
option (`DEFAULT_FOLDER`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slurmrun.launcher import Launcher

__all__ = [
    "DEFAULT_FOLDER",
    "DESCRIPTION",
    "FOLDER_HELP",
    "Command",
    "UsageError",
    "check_target",
    "command_defaults",
    "launcher_options",
    "parse_launcher",
    "split_command",
]

DESCRIPTION = """\
Runs SCRIPT.py (or -m MODULE) as __main__ on every worker of the SLURM allocation (one per
GPU, or per task/CPU), as a script started by torchrun: RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT are set and the script calls dist.init_process_group() itself
(--backend gloo/nccl/auto: slurmrun initialises the group before the script instead).
Everything after the script's path belongs to the script; `--` may end the launcher options.
Exit status: 0 when every rank finished; the first failing rank's sys.exit status; 1 when a
rank raised (its traceback is printed); 128+N when a worker was killed by signal N; 130 on
Ctrl-C; 2 for bad options. --dry-run prints what would run and starts nothing.
`slurmrun info` shows what slurmrun detects in this allocation. `slurmrun submit [...]
SCRIPT.py` submits the script as a batch job; status, logs, cancel and jobs follow it."""


DEFAULT_FOLDER = "slurmrun_jobs"
FOLDER_HELP = f"the folder jobs are submitted into (default: ./{DEFAULT_FOLDER})"


class UsageError(Exception):
    """The command line names no script, or names one that does not exist."""


@dataclass
class Command:
    """A command line split into the launcher's part and the script's part.

    ``own_args`` holds the options of a verb (``slurmrun submit``'s ``--nodes``...) that the
    caller of `split_command` named; ``launcher_args`` the rest, for tyro.
    """

    launcher_args: list[str] = field(default_factory=list)
    own_args: list[str] = field(default_factory=list)
    target: str = ""
    module: bool = False
    script_args: list[str] = field(default_factory=list)
    dry_run: bool = False
    # Options whose words are srun's or a runtime's (``--srun-args '--cpu-bind=none'``,
    # ``--agent-prefix 'ch-run /img --'``): one shell-quoted value each, split here, as
    # argparse would take their words for options of its own.
    words: dict[str, tuple[str, ...]] = field(default_factory=dict)


def command_defaults() -> Launcher:
    """The command's launcher options when none is given: `Launcher`'s, but no process group.

    As torchrun, the script makes its own process group unless ``--backend`` asks for one.
    """
    from slurmrun.launcher import Launcher  # noqa: PLC0415

    return Launcher(backend=None)


def launcher_options() -> list[str]:
    """The launcher's options on the command line (``--hostnames``...): not `log_handlers`..."""
    from slurmrun.launcher import Launcher  # noqa: PLC0415

    return [
        "--" + f.name.replace("_", "-")
        for f in dataclasses.fields(Launcher)
        if "Suppress" not in str(f.type)
    ]


# Launcher fields given on the command line as one shell-quoted string (see `Command.words`).
SHELL_WORDS = {"--srun-args": "srun_args", "--agent-prefix": "agent_prefix"}


def _option_arity() -> dict[str, bool]:
    """``--option`` -> whether it takes several values, from the `Launcher` fields."""
    from slurmrun.launcher import Launcher  # noqa: PLC0415

    arity = {}
    for f in dataclasses.fields(Launcher):
        annotation = str(f.type)  # a string: launcher.py uses `from __future__ import annotations`
        arity["--" + f.name.replace("_", "-")] = any(
            t in annotation for t in ("list[", "tuple[", "Mapping[")
        )
    return arity


def _is_value(option: str, arg: str, taken: list[str]) -> bool:
    """Whether `arg` is one more value of a several-valued option (the script's path is not)."""
    if arg.startswith("-") or arg.endswith(".py"):
        return False
    if taken and taken[0] in ("auto", "slurm"):
        return False  # a literal stands alone
    if option == "--workers-per-host":
        return arg.isdigit() or (not taken and arg in ("auto", "slurm"))
    return True


def _take_own(cmd: Command, arg: str, argv: list[str], i: int, own: Mapping[str, bool]) -> int:
    """Puts a verb's own option, or a `SHELL_WORDS` one, into `cmd`; returns the next index."""
    name = arg.split("=", 1)[0]
    # --name=value, so that argparse takes a value like "--exclusive"
    if (name in SHELL_WORDS or own[name]) and "=" not in arg and i < len(argv):
        arg = f"{arg}={argv[i]}"
        i += 1
    if name not in SHELL_WORDS:
        cmd.own_args.append(arg)
    elif "=" not in arg:
        raise UsageError(f"{arg} needs a value: one shell-quoted string")
    else:
        cmd.words[SHELL_WORDS[name]] = tuple(shlex.split(arg.split("=", 1)[1]))
    return i


def split_command(argv: list[str], own: Mapping[str, bool] | None = None) -> Command:
    """Splits ``[launcher options] SCRIPT.py [args...]`` (or ``-m MODULE [args...]``).

    A one-valued option takes the next arg; a several-valued one (``--hostnames``) takes
    tokens up to the next option or ``*.py``; the first other arg is the script.

    Args:
        argv: the command line after the program's (or verb's) name.
        own: a verb's own options (option -> whether it takes a value), put in ``own_args``.

    Raises:
        UsageError: ``-m`` or ``--`` ends the command line.
    """
    arity = _option_arity()
    own = own or {}
    cmd = Command()
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg in ("--", "-m") or (arg.startswith("-m") and not arg.startswith("--")):
            name = arg[2:] if arg.startswith("-m") and len(arg) > 2 else None
            if name is None:
                if i >= len(argv):
                    raise UsageError(f"{arg} must be followed by the script or module")
                name = argv[i]
                i += 1
            cmd.target, cmd.module, cmd.script_args = name, arg != "--", argv[i:]
            return cmd
        if arg == "--dry-run":
            cmd.dry_run = True
            continue
        if not arg.startswith("-"):
            cmd.target, cmd.script_args = arg, argv[i:]
            return cmd
        name = arg.split("=", 1)[0]
        if name in SHELL_WORDS or name in own:
            i = _take_own(cmd, arg, argv, i, own)
            continue
        cmd.launcher_args.append(arg)
        if "=" in arg or name not in arity:
            continue  # tyro reports unknown options
        if not arity[name]:
            cmd.launcher_args.extend(argv[i : i + 1])
            i += 1
            continue
        # The first arg is always a value, so that tyro reports a bad one (--hostnames 2).
        taken = argv[i : i + 1] if i < len(argv) and not argv[i].startswith("-") else []
        i += len(taken)
        while i < len(argv) and _is_value(name, argv[i], taken):
            taken.append(argv[i])
            i += 1
        cmd.launcher_args.extend(taken)
    return cmd


def check_target(cmd: Command) -> None:
    """Checks that the script exists, or that the ``-m`` module can be found.

    Raises:
        UsageError: it does not.
    """
    if not cmd.target:
        raise UsageError("no script given: name SCRIPT.py [args...], or -m MODULE [args...]")
    if cmd.module:
        top = cmd.target.partition(".")[0]
        # `python -m` looks in the working directory first.
        local = os.path.exists(top + ".py") or os.path.isdir(top)
        if not local and importlib.util.find_spec(top) is None:
            raise UsageError(f"No module named {top!r} (from -m {cmd.target})")
    elif not os.path.isfile(cmd.target):
        raise UsageError(f"can't open file {os.path.abspath(cmd.target)!r}: no such file")


def parse_launcher(
    args: list[str], prog: str = "slurmrun", words: Mapping[str, tuple[str, ...]] | None = None
) -> Launcher:
    """The `Launcher` of the launcher options `args` (tyro exits with 2 on bad ones).

    Options not given keep `command_defaults`; `words` are `Command.words`.
    """
    import tyro  # noqa: PLC0415 - only the command pays for it

    from slurmrun.launcher import Launcher  # noqa: PLC0415

    launcher = tyro.cli(
        Launcher, args=args, prog=prog, description=DESCRIPTION, default=command_defaults()
    )
    words = words or {}
    return dataclasses.replace(
        launcher,
        srun_args=words.get("srun_args", launcher.srun_args),
        agent_prefix=words.get("agent_prefix", launcher.agent_prefix),
    )
