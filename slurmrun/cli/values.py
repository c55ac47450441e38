"""The launcher options on the command line: each `slurmrun.Launcher` field's words, by its type.

Each field that is an option (all but tyro's ``Suppress`` ones: `log_handlers`, `on_event`,
`keep_workers`) has a `Spec`, read from the field's type: a bool is a flag (``--x`` turns it
on, ``--no-x`` off, and takes no value, so the next word stays the script's); a list or tuple
takes several words; a literal, an int, a float, a string or None takes one. A new field is a
new option with nothing else to write; `SHAPES` gives the known ones a metavar, what they
allow and an example, for ``--help`` and for the errors, which are argparse's style
(`slurmrun.cli.command.UsageError`: ``slurmrun: error: argument --timeout: ...``, status 2).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

__all__ = [
    "SHAPES",
    "BadOption",
    "Spec",
    "find_spec",
    "option_specs",
    "parse_values",
    "take_values",
]

# field: (metavar, what it allows, an example). A field missing here gets them from its type.
SHAPES: dict[str, tuple[str, str, str]] = {
    "hostnames": ("auto|slurm|HOST...", "auto, slurm, or host names", "--hostnames node1 node2"),
    "workers_per_host": (
        "auto|slurm|N...",
        "auto, slurm, a number of workers for every host, or one number per host",
        "--workers-per-host 2, or --workers-per-host 4 2 on two hosts",
    ),
    "backend": (
        "auto|nccl|gloo|mpi|ucc|None",
        "auto, nccl, gloo, mpi, ucc, or None (no process group)",
        "--backend gloo",
    ),
    "timeout": ("SECONDS", "a number of seconds", "--timeout 60"),
    "default_env_vars": (
        "PATTERN...",
        "patterns of variable names",
        "--default-env-vars PATH 'CUDA_*'",
    ),
    "extra_env_vars": (
        "PATTERN|NAME=VALUE...",
        "patterns of variable names, or NAME=VALUE words",
        "--extra-env-vars 'WANDB_*' NCCL_DEBUG=INFO",
    ),
    "env_file": ("FILE", "a bash file's path", "--env-file env.sh"),
    "show_ranks": (
        "all|RANK,...",
        "all, or global ranks (0 or more) separated by commas or spaces",
        "--ranks all, or --ranks 0,3",
    ),
    "max_restarts": ("N", "a whole number, 0 or more", "--max-restarts 2"),
    "hosts": ("N", "a number of hosts", "--hosts 4"),
    "min_hosts": ("N", "a number of hosts", "--min-hosts 2"),
    "heartbeat_timeout": ("SECONDS", "a number of seconds", "--heartbeat-timeout 30"),
    "ssh_config_file": ("FILE", "an ssh config file's path", "--ssh-config-file ssh_config"),
    "srun_args": (
        "'SRUN-OPTIONS'",
        "srun options, in one quoted string",
        "--srun-args '--cpu-bind=none --mpi=pmix'",
    ),
    "agent_prefix": (
        "'COMMAND'",
        "a command, in one quoted string",
        "--agent-prefix 'ch-run /images/torch --'",
    ),
    "agent_python": ("PYTHON", "an interpreter's path", "--agent-python /opt/venv/bin/python"),
    "stall_timeout": ("SECONDS", "a number of seconds", "--stall-timeout 300"),
    "health_check": (
        "'COMMAND'",
        "a shell command, in one quoted string",
        "--health-check 'nvidia-smi -L'",
    ),
    "gpu_check": ("auto|on|off", "auto, on or off", "--gpu-check on"),
    "hang_timeout": (
        "SECONDS|auto",
        "a number of seconds, or auto",
        "--hang-timeout 600, or --hang-timeout auto",
    ),
}
# Other words for an option: ``--ranks`` is short for ``--show-ranks`` (torchrun users' habit).
ALIASES = {"--ranks": "--show-ranks"}
# What a type that `SHAPES` does not name takes: metavar, what it allows, an example word.
_PLAIN = {int: ("N", "a whole number", "1"), float: ("NUMBER", "a number", "1.5")}


class BadOption(Exception):
    """A launcher option on the command line is unknown, lacks its value, or has a bad one."""


@dataclass(frozen=True)
class Spec:
    """One launcher option: its field, the members of its type, and its help's words."""

    name: str
    option: str
    members: tuple[Any, ...]
    metavar: str
    allowed: str
    example: str

    @property
    def flag(self) -> bool:
        """Whether it is a flag (a bool): ``--x`` turns it on, ``--no-x`` off."""
        return self.members == (bool,)

    @property
    def off(self) -> str:
        """A flag's ``--no-x``."""
        return "--no-" + self.option.removeprefix("--")

    @property
    def several(self) -> bool:
        """Whether it takes several words (a list, a tuple or a mapping)."""
        return any(get_origin(m) in (list, tuple, Mapping) for m in self.members)

    def convert(self, words: Sequence[str]) -> Any:
        """The field's value of `words`: its type's first member that takes them.

        Raises:
            BadOption: no member takes them (the message says what was given, what is
                allowed, and shows an example).
        """
        if not words:
            raise BadOption(
                f"argument {self.option}: expected a value: {self.allowed} (e.g. {self.example})"
            )
        for member in self.members:
            try:
                return _convert(member, words)
            except ValueError:
                continue
        raise BadOption(
            f"argument {self.option}: invalid value {' '.join(map(repr, words))}: "
            f"give {self.allowed} (e.g. {self.example})"
        )


def _convert(member: Any, words: Sequence[str]) -> Any:
    """`words` as the type `member`; raises ValueError when they are not one."""
    origin = get_origin(member)
    if origin in (list, tuple):
        item = get_args(member)[0]
        if item is int:  # numbers: "0,3" as "0 3"
            words = [part for word in words for part in word.split(",")]
        items = [_convert(item, [w]) for w in words]
        return items if origin is list else tuple(items)
    if len(words) != 1:
        raise ValueError(words)
    (word,) = words
    if origin is Literal:
        for value in get_args(member):
            if str(value) == word:
                return value
    elif member is type(None):
        if word == "None":
            return None
    elif member in (int, float, str):
        return member(word)
    raise ValueError(word)


@functools.cache
def option_specs() -> dict[str, Spec]:
    """``--option`` -> its `Spec`, for every `Launcher` field that is an option, in order."""
    from slurmrun.launcher import options  # noqa: PLC0415 - the command's import, not slurmrun's

    namespace = vars(options)
    specs = {}
    for f in dataclasses.fields(options.Options):
        if "Suppress" in str(f.type):
            continue
        # a string (`from __future__ import annotations`), read in its module
        hint = eval(str(f.type), namespace)  # noqa: S307 - our own module's annotation
        union = get_origin(hint) in (Union, types.UnionType)
        members = get_args(hint) if union else (hint,)
        option = "--" + f.name.replace("_", "-")
        metavar, allowed, example = SHAPES.get(f.name) or _shape(option, members)
        if members == (bool,):
            allowed, example = "no value", option
        specs[option] = Spec(f.name, option, members, metavar, allowed, example)
    return specs


def _shape(option: str, members: tuple[Any, ...]) -> tuple[str, str, str]:
    """The metavar, what it allows and an example, of a field that `SHAPES` does not name."""
    plain = [m for m in members if m is not type(None)]
    metavar, allowed, word = (
        _PLAIN.get(plain[0], ("TEXT", "a word", "x")) if plain else ("", "", "")
    )
    return metavar, allowed, f"{option} {word}"


def find_spec(option: str) -> Spec | None:
    """The `Spec` of ``--option`` (or of a flag's ``--no-option``); None for no option."""
    specs = option_specs()
    spec = specs.get(ALIASES.get(option, option))
    if spec is None and option.startswith("--no-"):
        spec = specs.get("--" + option.removeprefix("--no-"))
        return spec if spec is not None and spec.flag else None
    return spec


def take_values(spec: Spec, argv: Sequence[str], i: int) -> tuple[list[str], int]:
    """The words from ``argv[i]`` on that are `spec`'s values, and the index after them.

    A one-valued option takes the next word (``--max-restarts -1`` too); a several-valued one
    takes words up to the next option or ``*.py`` (the script), the first one always (but an
    option), so that a bad one is reported; a flag takes none.
    """
    if spec.flag:
        return [], i
    if not spec.several:
        taken = list(argv[i : i + 1])
        return taken, i + len(taken)
    taken = list(argv[i : i + 1]) if i < len(argv) and not argv[i].startswith("-") else []
    i += len(taken)
    while i < len(argv) and _is_value(spec, argv[i], taken):
        taken.append(argv[i])
        i += 1
    return taken, i


def _is_value(spec: Spec, arg: str, taken: list[str]) -> bool:
    """Whether `arg` is one more value of a several-valued option (the script's path is not)."""
    if arg.startswith("-") or arg.endswith(".py"):
        return False
    if taken and taken[0] in ("auto", "slurm", "all"):
        return False  # a literal stands alone
    if spec.name in ("workers_per_host", "show_ranks"):
        return arg.replace(",", "").isdigit()
    return True


def parse_values(args: Sequence[str], own: Sequence[str] = ()) -> dict[str, Any]:
    """The fields given by the launcher options `args` (`split_command`'s), converted.

    Args:
        args: the launcher options and their words.
        own: the command's options of its own (``--help``...), for the suggestions.

    Raises:
        BadOption: an option is unknown (with the closest one), a flag has a value, or a
            value is missing or bad.
    """
    values: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        option, eq, value = arg.partition("=")
        spec = find_spec(option) if option.startswith("--") else None
        if spec is None:
            raise BadOption(_unknown(arg, option, own))
        if spec.flag:
            if eq:
                raise BadOption(
                    f"argument {option}: takes no value (got {value!r}): "
                    f"{spec.option} turns it on, {spec.off} turns it off"
                )
            values[spec.name] = option == spec.option
            continue
        words, i = ([value], i) if eq else take_values(spec, args, i)
        values[spec.name] = spec.convert(words)
    return values


def _unknown(arg: str, option: str, own: Sequence[str]) -> str:
    """The error of an unknown option: it, and the closest known one."""
    known = [*own]
    for spec in option_specs().values():
        known += [spec.option, spec.off] if spec.flag else [spec.option]
    close = difflib.get_close_matches(option, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    return f"unrecognized option {arg}: {hint}(--help lists the options)"
