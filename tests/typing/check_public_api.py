"""Type-checked by mypy (tests/test_typing.py): the public API infers result types for users."""

from __future__ import annotations

import logging
import sys
from typing import Any

if sys.version_info >= (3, 11):
    from typing import assert_type
else:  # mypy checks as Python 3.10, the oldest supported (pyproject.toml)
    from typing_extensions import assert_type

import slurmrun


def double(x: int) -> int:
    return 2 * x


def name() -> str:
    return "rank"


result = slurmrun.launch(double, (21,), workers_per_host=2)
assert_type(result, slurmrun.LaunchResult[int])
assert_type(result.rank(0), int)
assert_type(result.index("localhost", 0), int)
assert_type(result.return_values, list[list[int]])

launcher = slurmrun.Launcher(hostnames=["localhost"], workers_per_host=[2], backend="gloo")
assert_type(launcher.run(name), slurmrun.LaunchResult[str])
assert_type(launcher.run(name).values(), list[str])
kept = launcher.open()
assert_type(kept, slurmrun.Launcher)
assert_type(kept.run(double, (21,)).rank(0), int)
kept.close()

error: type[Exception] = slurmrun.WorkerFailedError
agent_error: type[Exception] = slurmrun.AgentFailedError
version_error: type[slurmrun.AgentFailedError] = slurmrun.VersionMismatchError
hang_error: type[RuntimeError] = slurmrun.HangError
unhealthy: type[slurmrun.AgentFailedError] = slurmrun.NodeUnhealthyError
hang_seconds: float = slurmrun.HangError("hung").seconds
bad_value: type[slurmrun.OptionsError] = slurmrun.OptionsValueError
bad_type: type[TypeError] = slurmrun.OptionsTypeError

allocation = slurmrun.slurm_allocation()
assert_type(allocation, slurmrun.SlurmAllocation | None)
if allocation is not None:
    assert_type(allocation.hostnames, list[str])

submitted = slurmrun.submit(double, (21,), nodes=2)
assert_type(submitted, slurmrun.SubmittedLaunch[int])
assert_type(submitted.result(timeout=60), slurmrun.LaunchResult[int])
assert_type(submitted.wait(timeout=60), str)
assert_type(slurmrun.submit(double, (21,), dry_run=True).script, str)
assert_type(slurmrun.attach("123", folder="slurmrun_jobs").state, str)
with slurmrun.reserve(nodes=2, time_min=30, idle_timeout=300) as reservation:
    assert_type(reservation, slurmrun.Reservation)
    reservation.wait(timeout=600)
    assert_type(slurmrun.launch(double, (21,), job=reservation.job_id), slurmrun.LaunchResult[int])
assert_type(slurmrun.release("123"), str)
slurmrun.reserve(nodes=2, idle_timeout="5")  # type: ignore[arg-type]  # a number of seconds
assert_type([job.state for job in slurmrun.jobs(folder="slurmrun_jobs")], list[str])
swept = slurmrun.submit_array(double, [(1,), (2,)], nodes=2, requeue=slurmrun.Requeue("USR1"))
assert_type(swept, list[slurmrun.SubmittedLaunch[int]])
assert_type(slurmrun.requeue_requested(), bool)
mapped = slurmrun.submit_map(double, range(4), workers_per_item=1, nodes=2, gpus_per_node=2)
assert_type(mapped, slurmrun.SubmittedMap[int])
assert_type(mapped.result(timeout=60), list[int])
assert_type(mapped.progress(), tuple[int, int])
assert_type(slurmrun.submit_map(double, [1], dry_run=True).script, str)
sized = slurmrun.submit(double, (21,), nodes=2, gpus_per_node=8, time_min=30, resources="gpu_x8")
assert_type(sized, slurmrun.SubmittedLaunch[int])
slurmrun.submit(double, (21,), nodes="2")  # type: ignore[call-overload]  # the keywords are typed

handlers = [
    slurmrun.stream_handler(hostname="node1", local_rank=0),
    slurmrun.file_handler("rank0.log", hostname="node1", local_rank=0),
    slurmrun.add_filter_to_handler(logging.NullHandler(), hostname="node1"),
]
assert_type(handlers, list[logging.Handler])
slurmrun.launch(double, (21,), log_handlers=handlers)


def debug_here(launcher: slurmrun.Launcher) -> None:
    slurmrun.breakpoint()
    assert_type(slurmrun.worker_state(), dict[str, Any])
    kept = slurmrun.Launcher(keep_workers=True)
    assert_type(kept.keep_workers, bool)
    report = launcher.stacks(timeout=5.0)
    if report is not None:
        assert_type(report.summary(), str)


# Events are built whole: a forgotten field is an error (the ignore would be unused otherwise).
stalled = slurmrun.events.Stalled(seconds=1.0, summary="")  # type: ignore[call-arg]

squares = slurmrun.Launcher(workers_per_host=2).map(double, [1, 2, 3], retries=1)
assert_type(squares, list[int])
for index, value in slurmrun.Launcher().imap(double, range(3), item_timeout=60):
    assert_type(index, int)
    assert_type(value, int)
try:
    pass
except slurmrun.MapFailedError as e:
    assert_type(e.results, list[object])
    assert_type(e.failed, list[int])
    timed_out = [r for r in e.results if isinstance(r, slurmrun.ItemTimeoutError)]
    assert_type(timed_out, list[slurmrun.ItemTimeoutError])
