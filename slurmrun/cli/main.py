"""The ``slurmrun`` command: the module of a verb runs ``slurmrun VERB``, `cli.launching` the rest.

The verbs are the table `slurmrun.cli.verbs.VERBS`; without one, ``slurmrun [OPTIONS]
SCRIPT.py [ARGS...]`` runs a script on every worker. See ``docs/cli.md``.

Two parsers, on purpose: the launcher options are `slurmrun.Launcher`'s fields, converted by
their types (`slurmrun.cli.values`), so a new field is a new option with nothing else to
write; argparse parses each verb's few options of its own (``submit --nodes``, ``logs
--follow``, ``info --json``), which are no dataclass's. Both answer a bad command line in
argparse's style (``slurmrun: error: ...``, status 2).
`slurmrun.cli.command.split_command` cuts a command line between the two.
"""

from __future__ import annotations

import importlib
import signal
import sys

from slurmrun.cli.verbs import VERBS

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """The ``slurmrun`` command; returns its exit status.

    Args:
        argv: the arguments after the program's name (default: ``sys.argv[1:]``).

    Returns:
        The verb's exit status; without a verb (running a script): 0 when every rank
        finished (and after ``--help``, ``--version``); the first failing rank's ``sys.exit``
        status; 1 when a rank raised; 128+N for a worker killed by signal N; 130 on Ctrl-C;
        2 for bad options (argparse exits with 2 itself). When what reads its
        output has gone (``slurmrun status 2 | head -1``), it stops printing quietly, as
        other Unix tools: a verb ends with 141 (128+SIGPIPE); a launch runs on, and its
        status is the run's.
    """
    status: int | None = None
    try:
        status = _verb(sys.argv[1:] if argv is None else list(argv))
        sys.stdout.flush()  # a reader gone is met here, not at the interpreter's exit
    except BrokenPipeError:
        from slurmrun.terminal import silence_gone_readers  # noqa: PLC0415 - only now

        if not silence_gone_readers(sys.stdout, sys.stderr):
            raise  # not our output's pipe: a bug to show
        return 128 + signal.SIGPIPE if status is None else status
    return status


def _verb(argv: list[str]) -> int:
    """Runs the verb of `argv` (or the script it names); returns the exit status."""
    verb = VERBS.get(argv[0]) if argv else None
    # Only the module that runs is imported (here, not at the top): each pays for its own imports.
    if verb is None:
        from slurmrun.cli.launching import main as run_main  # noqa: PLC0415

        return run_main(argv)
    return int(importlib.import_module(verb.module).main(argv if verb.named else argv[1:]))
