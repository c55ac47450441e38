"""``slurmrun reserve|release``: a job that keeps agents for launchers outside it.

``slurmrun reserve --nodes 2 --time-min 60`` submits the reservation (`slurmrun.reserve`) and
prints its job id, bare on stdout as ``slurmrun submit`` does; ``--wait SECONDS`` returns
only once its agents are ready. ``slurmrun release JOB_ID`` ends it and returns once SLURM
says it has ended. Exit status 1, with one line on stderr, for what SLURM or the options
refuse.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _parser(verb: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"slurmrun {verb}")
    if verb == "release":
        parser.add_argument("job_id", metavar="JOB_ID")
        parser.add_argument("--timeout", type=float, default=60.0, help="seconds (default 60)")
        return parser
    parser.add_argument("--nodes", type=int, default=None)
    parser.add_argument("--gpus-per-node", type=int, default=None)
    parser.add_argument("--workers-per-node", type=int, default=None)
    parser.add_argument("--cpus-per-worker", type=int, default=None)
    parser.add_argument("--time-min", type=int, default=60)
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=600.0,
        help="seconds with no launcher attached after which the job ends (default 600)",
    )
    parser.add_argument("--folder", default="slurmrun_jobs", help="the job's log goes there")
    parser.add_argument("--partition", default=None)
    parser.add_argument("--account", default=None)
    parser.add_argument("--job-name", default=None)
    parser.add_argument(
        "--wait", type=float, default=None, metavar="SECONDS", help="until its agents are ready"
    )
    return parser


def main(argv: Sequence[str]) -> int:
    """Runs ``slurmrun reserve ...`` or ``slurmrun release ...`` (`argv[0]` is the verb)."""
    verb, rest = argv[0], list(argv[1:])
    args = _parser(verb).parse_args(rest)
    # Only the verbs' own work imports the batch side (the command stays quick to start).
    from slurmrun.batch.reserve import release, reserve  # noqa: PLC0415

    try:
        if verb == "release":
            state = release(args.job_id, timeout=args.timeout)
            print(f"{args.job_id} {state}")
            return 0
        params = {
            key: value
            for key, value in (
                ("partition", args.partition),
                ("account", args.account),
                ("job_name", args.job_name),
            )
            if value is not None
        }
        reservation = reserve(
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            workers_per_node=args.workers_per_node,
            cpus_per_worker=args.cpus_per_worker,
            time_min=args.time_min,
            idle_timeout=args.idle_timeout,
            folder=args.folder,
            slurm_parameters=params or None,
        )
        print(reservation.job_id, flush=True)
        if args.wait is not None:
            reservation.wait(args.wait)
    except (ValueError, TypeError, RuntimeError, OSError) as e:  # TimeoutError is an OSError
        print(f"slurmrun {verb}: {e}", file=sys.stderr)
        return 1
    return 0
