"""Type-checked by mypy (tests/test_typing.py): the public API infers result types for users."""

from __future__ import annotations

from typing import assert_type

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

error: type[Exception] = slurmrun.WorkerFailedError
agent_error: type[Exception] = slurmrun.AgentFailedError
