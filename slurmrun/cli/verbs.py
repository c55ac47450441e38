"""The ``slurmrun`` command's verbs: the module that runs each, and its usage and help line.

`slurmrun.cli.main` dispatches on this table and `slurmrun.cli.helptext` prints it in
``slurmrun --help``; it imports nothing, so that both read it from below.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["VERBS", "Verb"]


@dataclass(frozen=True)
class Verb:
    """One verb of the command line.

    Attributes:
        module: the module whose ``main(argv)`` runs it and returns the exit status; `argv`
            is the words after the verb (with the verb first when `named`).
        usage: its usage after ``slurmrun`` (``info [--json]``).
        help: its help line.
        named: its module serves several verbs, and reads which from ``argv[0]``.
    """

    module: str
    usage: str
    help: str
    named: bool = False


_JOBS = "slurmrun.cli.jobs"
VERBS = {
    "info": Verb("slurmrun.cli.info", "info [--json]", "show what slurmrun detects in this job"),
    "submit": Verb(
        "slurmrun.cli.submitting",
        "submit ... SCRIPT",
        "submit SCRIPT (or -m MODULE) as a batch job",
    ),
    "status": Verb(_JOBS, "status JOB_ID", "print a submitted job's state", named=True),
    "logs": Verb(_JOBS, "logs JOB_ID [-f]", "print a worker's output", named=True),
    "cancel": Verb(_JOBS, "cancel JOB_ID", "cancel a submitted job", named=True),
    "jobs": Verb(_JOBS, "jobs", "list the jobs submitted", named=True),
    "reserve": Verb(
        "slurmrun.cli.reserving",
        "reserve --nodes N",
        "keep agents for runs from here (--job)",
        named=True,
    ),
    "release": Verb("slurmrun.cli.reserving", "release JOB_ID", "end a reservation", named=True),
    "stacks": Verb(
        "slurmrun.stacks.verb", "stacks [JOB_ID]", "print the Python stacks of a running launch"
    ),
}
