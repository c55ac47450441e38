"""The ``slurmrun`` command line's shape: launcher options, then the script and its arguments.

`split_command` cuts a command line where the launcher's options end (the fields of
`slurmrun.Launcher`, converted by `slurmrun.cli.values` in `parse_launcher`) and the
script's (or ``-m MODULE``'s) begin; `slurmrun.cli.launching` (``slurmrun SCRIPT.py``) and
`slurmrun.cli.submitting` (``slurmrun submit SCRIPT.py``) both read it from here, and the verbs
share the job folder's option (`DEFAULT_FOLDER`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from slurmrun.cli.values import BadOption, Spec, find_spec, parse_values, take_values

if TYPE_CHECKING:
    from slurmrun.launcher import Launcher

__all__ = [
    "DEFAULT_FOLDER",
    "FOLDER_HELP",
    "Command",
    "UsageError",
    "check_target",
    "command_defaults",
    "launcher_options",
    "parse_launcher",
    "split_command",
]

DEFAULT_FOLDER = "slurmrun_jobs"
FOLDER_HELP = f"the folder jobs are submitted into (default: ./{DEFAULT_FOLDER})"


class UsageError(Exception):
    """The command line names no script, or names one that does not exist."""


@dataclass
class Command:
    """A command line split into the launcher's part and the script's part.

    ``own_args`` holds the options of a verb (``slurmrun submit``'s ``--nodes``...) that the
    caller of `split_command` named; ``launcher_args`` the rest, for `parse_launcher`.
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

    A flag (``--flight-recorder``, ``--no-flight-recorder``) takes no arg; a one-valued
    option takes the next; a several-valued one (``--hostnames``) takes tokens up to the next
    option or ``*.py`` (`slurmrun.cli.values.take_values`); the first other arg is the
    script.

    Args:
        argv: the command line after the program's (or verb's) name.
        own: a verb's own options (option -> whether it takes a value), put in ``own_args``.

    Raises:
        UsageError: ``-m`` or ``--`` ends the command line, or a flag is given a boolean
            word (``--flight-recorder True``) that is no file.
    """
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
        spec = None if "=" in arg else find_spec(name)
        if spec is None:
            continue  # parse_launcher reports unknown options
        if spec.flag:
            _check_flag_word(spec, arg, argv[i : i + 1])
        taken, i = take_values(spec, argv, i)
        cmd.launcher_args.extend(taken)
    return cmd


def _check_flag_word(spec: Spec, arg: str, after: list[str]) -> None:
    """Refuses ``--flight-recorder True``: a flag takes no value, and True is no script.

    Raises:
        UsageError: a boolean word, not a file, follows the flag `arg`.
    """
    if after and after[0] in ("True", "False", "true", "false") and not os.path.exists(after[0]):
        raise UsageError(
            f"argument {arg}: takes no value (got {after[0]!r}, which would be the script): "
            f"{spec.option} turns it on, {spec.off} turns it off "
            f"(e.g. slurmrun {spec.option if after[0].lower() == 'true' else spec.off} train.py)"
        )


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
    """The `Launcher` of the launcher options `args` (`Command.launcher_args`).

    Options not given keep `command_defaults`; `words` are `Command.words`. `prog` is the
    command (``slurmrun submit``), for its own options' names in the suggestions.

    Raises:
        UsageError: an option is unknown, a flag has a value, or a value is missing or bad.
    """
    own = ["--help"]
    if prog == "slurmrun":  # its own options (a map's among them), for the suggestions
        own += ["--version", "--dry-run", "--map", "--workers-per-item", "--retries"]
        own.append("--item-timeout")
    try:
        values = parse_values(args, own)
    except BadOption as e:
        raise UsageError(str(e)) from None
    words = words or {}
    values.update({name: value for name, value in words.items()})
    return dataclasses.replace(command_defaults(), **values)
