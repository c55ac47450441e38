"""``slurmrun [launcher options] SCRIPT.py [args...]`` (or ``-m MODULE``): the command's run.

The launcher options are the fields of `slurmrun.Launcher`
(`slurmrun.cli.command.parse_launcher`); everything from the script's path (or ``-m MODULE``)
on belongs to the script, as with ``python`` and ``torchrun``. The script runs on every
worker through `slurmrun.cli.script.run_script` (`slurmrun.cli.launching`). See ``docs/cli.md``.
"""

from __future__ import annotations

from slurmrun.cli.command import UsageError, check_target, parse_launcher, split_command
from slurmrun.cli.helptext import help_text
from slurmrun.cli.launching import run_command, usage_error
from slurmrun.versions import slurmrun_version

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """``slurmrun [OPTIONS] SCRIPT [ARGS...]``; returns its exit status.

    Args:
        argv: the arguments after the program's name.

    Returns:
        0 when every rank finished (and after ``--help``, ``--version``); the first failing
        rank's ``sys.exit`` status; 1 when a rank raised; 128+N for a worker killed by signal
        N; 130 on Ctrl-C; 2 for bad options (``slurmrun: error: ...``, as argparse).
    """
    try:
        cmd = split_command(argv)
    except UsageError as e:
        return usage_error(str(e))
    # Only before the script: `slurmrun train.py --help` gives --help to the script.
    if {"-h", "--help", "--version"} & set(cmd.launcher_args):
        asked_help = {"-h", "--help"} & set(cmd.launcher_args)
        print(help_text() if asked_help else f"slurmrun {slurmrun_version()}")
        return 0
    try:
        launcher = parse_launcher(cmd.launcher_args, words=cmd.words)
        check_target(cmd)
    except UsageError as e:
        return usage_error(str(e))
    return run_command(launcher, cmd)
