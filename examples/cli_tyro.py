"""Launcher options from the command line: `python examples/cli_tyro.py --workers-per-host 2`.

`tyro.cli(slurmrun.Launcher)` turns every field of the `Launcher` dataclass into an option
(`--help` lists them, documented from the fields' docstrings); `.run` then launches.
"""

from __future__ import annotations

import tyro

import slurmrun


def hello(greeting: str) -> str:
    """Each worker greets from its rank."""
    import torch.distributed as dist

    return f"{greeting} from rank {dist.get_rank()} of {dist.get_world_size()}"


if __name__ == "__main__":
    launcher = tyro.cli(slurmrun.Launcher)
    result = launcher.run(hello, ("hello",))
    for line in result.values():
        print(line)
