"""``slurmrun --help``: the usage lines, the verbs, and every option, wrapped for the terminal.

The launcher options' help is their `slurmrun.Launcher` field docstrings, read from its source
(not through tyro: ``--help`` stays quick) and turned from reST into plain text.
"""

from __future__ import annotations

import ast
import inspect
import re
import shlex
import shutil
import textwrap
from dataclasses import dataclass
from typing import Any

from slurmrun.cli.verbs import VERBS

__all__ = [
    "USAGE",
    "OptionHelp",
    "field_docstrings",
    "help_text",
    "launcher_option_help",
    "plain",
    "usage_text",
]

USAGE = [
    "[OPTIONS] SCRIPT [ARGS...]",
    "[OPTIONS] -m MODULE [ARGS...]",
    "--dry-run [OPTIONS] SCRIPT|-m MODULE [ARGS...]",
    "--map ARGS_FILE [OPTIONS] SCRIPT|-m MODULE [ARGS...]",
]
DESCRIPTION = [
    "Runs SCRIPT (or -m MODULE) as __main__ on every worker of the SLURM allocation (one per "
    "GPU, or per task/CPU), as torchrun would: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and "
    "MASTER_PORT are set, and the script calls dist.init_process_group() itself (--backend "
    "makes slurmrun initialise the group before the script instead). Everything from SCRIPT "
    "(or -m MODULE) on belongs to the script; -- may end the options. An option that is on or "
    "off is a flag and takes no value: --flight-recorder turns it on, --no-flight-recorder off.",
    "Exit status: 0 when every rank finished; the first failing rank's sys.exit status; 1 when "
    "a rank raised (its traceback is printed); 128+N when a worker was killed by signal N; 130 "
    "on Ctrl-C; 2 for bad options. slurmrun VERB --help shows a verb's options.",
]
OWN_OPTIONS = [
    ("-h, --help", "show this help and exit"),
    ("--version", "print slurmrun's version and exit"),
    (
        "--dry-run",
        "print what would run (the hosts, workers, the agents' command line, the script and "
        "its arguments) and start nothing",
    ),
    (
        "--map ARGS_FILE",
        "run SCRIPT once per line of ARGS_FILE, each line's words (split as a shell would; "
        "blank lines and # comments skipped) appended to its arguments, every slot of the "
        "allocation (a GPU, or a worker) at once, each run in a world of its own; at the "
        "end a table of each run's slot, time and exit status. Exit status: the first "
        "failed run's (docs/sweeps.md)",
    ),
    ("--workers-per-item N", "with --map: the workers of each run, all on one node (default 1)"),
    ("--retries N", "with --map: how many times a failed run is tried again (default 0)"),
    (
        "--item-timeout SECONDS",
        "with --map: a run that takes longer is killed, and fails with status 124",
    ),
]
HELP_COLUMN = 24  # where an option's help starts when its name is short enough
MAX_WIDTH = 100


def usage_text() -> str:
    """The usage lines (``usage: slurmrun ...``), one per form and one per verb."""
    lines = [f"slurmrun {form}" for form in USAGE]
    lines += [f"slurmrun {verb.usage:<18} {verb.help}" for verb in VERBS.values()]
    return "usage: " + "\n       ".join(lines)


def help_text(width: int | None = None) -> str:
    """The whole ``slurmrun --help``, lines at most `width` long (default: the terminal's)."""
    if width is None:
        width = shutil.get_terminal_size().columns  # $COLUMNS first
    width = max(40, min(width, MAX_WIDTH) - 1)
    out = [usage_text(), ""]
    for paragraph in DESCRIPTION:
        out += [*_wrap(plain(paragraph), width), ""]
    out.append("options (before SCRIPT or -m MODULE):")
    for name, text in [*OWN_OPTIONS, *_launcher_options()]:
        out += _option(name, text, width)
    return "\n".join(out)


def plain(text: str, fields: frozenset[str] = frozenset()) -> str:
    """Docstring reST made plain for a terminal: ````"auto"```` is auto, ```name``` name.

    A field of `fields` in single backquotes becomes its option (```max_restarts``` is
    --max-restarts); whitespace is collapsed, so paragraphs rewrap.
    """
    text = re.sub(r'``"([\w.*=-]+)"``', r"\1", text)  # ``"auto"``: typed without quotes
    text = re.sub(r"``(.+?)``", r"\1", text, flags=re.DOTALL)
    text = re.sub(
        r"`([\w.]+)`",
        lambda m: "--" + m[1].replace("_", "-") if m[1] in fields else m[1],
        text,
    )
    return " ".join(text.split())


def field_docstrings(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass `cls` (the string after ``name: type = x``)."""
    (node,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
    assert isinstance(node, ast.ClassDef)  # noqa: S101 - getsource of a class
    docs = {}
    for statement, after in zip(node.body, node.body[1:], strict=False):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[statement.target.id] = inspect.cleandoc(after.value.value)
    return docs


@dataclass(frozen=True)
class OptionHelp:
    """One launcher option as ``--help`` shows it (docs/cli.md's table too: `cli.doctables`)."""

    name: str  # ``--timeout SECONDS``; a flag's ``--flight-recorder, --no-flight-recorder``
    text: str  # its field's docstring, plain
    default: str  # the command's default (``on``/``off`` for a flag); "" when there is none


def launcher_option_help() -> list[OptionHelp]:
    """Every launcher option of the command line, in `Options`' order, as ``--help`` shows it."""
    from slurmrun.cli.command import command_defaults  # noqa: PLC0415
    from slurmrun.cli.values import ALIASES, option_specs  # noqa: PLC0415
    from slurmrun.launcher.options import Options  # noqa: PLC0415

    defaults = command_defaults()
    docs = field_docstrings(Options)  # `Launcher`'s fields are declared in `Options`
    specs = option_specs().values()
    names = frozenset(spec.name for spec in specs)
    options = []
    for spec in specs:
        value = getattr(defaults, spec.name)
        default = ("on" if value else "off") if spec.flag else _default_text(value)
        spelt = ", ".join([spec.option, *(a for a, o in ALIASES.items() if o == spec.option)])
        name = f"{spelt}, {spec.off}" if spec.flag else f"{spelt} {spec.metavar}"
        options.append(OptionHelp(name, plain(docs.get(spec.name, ""), names), default))
    return options


def _launcher_options() -> list[tuple[str, str]]:
    """(``--option METAVAR``, plain help with the command's default) per launcher option."""
    return [
        (o.name, f"{o.text} (default: {o.default})" if o.default else o.text)
        for o in launcher_option_help()
    ]


def _default_text(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return shlex.join(map(str, value))
    if isinstance(value, dict):
        return " ".join(f"{k}={shlex.quote(str(v))}" for k, v in value.items())
    return str(value)


def _option(name: str, text: str, width: int) -> list[str]:
    """An option's lines: its help beside it when the name is short, else under it."""
    indent = " " * HELP_COLUMN
    head = f"  {name}"
    if len(head) <= HELP_COLUMN - 2:
        lines = _wrap(text, width, indent) or [""]
        return [(head.ljust(HELP_COLUMN) + lines[0].lstrip()).rstrip(), *lines[1:]]
    return [head, *_wrap(text, width, indent)]


def _wrap(text: str, width: int, indent: str = "") -> list[str]:
    return textwrap.wrap(
        text,
        width,
        initial_indent=indent,
        subsequent_indent=indent,
        break_on_hyphens=False,
        break_long_words=False,
    )
