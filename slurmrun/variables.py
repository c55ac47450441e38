"""The environment variables slurmrun sets for its own processes, and reads back there.

The launcher sets them for its agents (their secret, where it listens, what the spawner
preloads), and for the workers through `slurmrun.protocol.Start.env`; a submitted job sets
some for its launch. Both sides import this module, and nothing of each other.
"""

from __future__ import annotations

__all__ = [
    "ENV_FILE_VAR",
    "HEARTBEAT_VAR",
    "HOSTNAME_VAR",
    "IGNORED_SIGNALS_VAR",
    "JOB_ENV_VAR",
    "JOB_TASKS_VAR",
    "LAUNCHER_ADDR_VAR",
    "LEARN_PRELOADS_VAR",
    "LOG_DIR_MARK_VAR",
    "NODE_RANK_VAR",
    "PORT_VAR",
    "PRELOAD_LATER_VAR",
    "PRELOAD_VAR",
    "RESTART_VAR",
    "SECRET_STDIN_VAR",
    "SECRET_VAR",
    "WORKER_UMASK_VAR",
]

# Set by the launcher for its agents:
SECRET_VAR = "SLURMRUN_SECRET"  # noqa: S105 - the variable's name, not a secret
LAUNCHER_ADDR_VAR = "SLURMRUN_LAUNCHER_ADDR"  # also read from the user: the address to advertise
PORT_VAR = "SLURMRUN_LAUNCHER_PORT"  # also read from the user: the port to listen on
# "1": the secret comes on stdin, which stays open for the agent's life (ssh agents)
SECRET_STDIN_VAR = "SLURMRUN_SECRET_STDIN"  # noqa: S105 - a variable's name
PRELOAD_VAR = "SLURMRUN_PRELOAD"  # modules the spawner imports (comma-separated)
# ... and those it imports only after the first run (torch when no process group is asked for)
PRELOAD_LATER_VAR = "SLURMRUN_PRELOAD_LATER"
# "1": the spawner imports, between runs, what the last run's workers imported
LEARN_PRELOADS_VAR = "SLURMRUN_LEARN_PRELOADS"
HEARTBEAT_VAR = "SLURMRUN_HEARTBEAT_INTERVAL"  # seconds between heartbeats, each way
ENV_FILE_VAR = "SLURMRUN_ENV_FILE"  # a bash file the agent sources before forking its spawner
# srun rewrites SLURM_TASKS_PER_NODE with the step's layout (1 per node for the agents' step),
# so the job's own layout travels to agents under this name (comma-separated counts).
JOB_TASKS_VAR = "SLURMRUN_JOB_TASKS_PER_NODE"
# srun reads some of the job's variables as its options, so they travel to srun agents under
# this name (JSON, `slurmrun.worker_env.job_vars`), for the workers to see the job's values.
JOB_ENV_VAR = "SLURMRUN_JOB_ENV"
# A file the launcher wrote in the log directory that srun agents write into (`--output`): an
# agent that cannot see it writes where the launcher never reads (SLURM 24.11+ creates the
# missing folders instead of failing the task), and says so in its hello.
LOG_DIR_MARK_VAR = "SLURMRUN_LOG_DIR_MARK"
# Local agents only (srun agents are known by their node name):
NODE_RANK_VAR = "SLURMRUN_NODE_RANK"
HOSTNAME_VAR = "SLURMRUN_HOSTNAME"
# Set by the launcher for workers (through `Start.env`):
RESTART_VAR = "SLURMRUN_RESTART_COUNT"
# Set in a submitted job: signals (names, comma-separated) that workers keep ignored, as their
# agent set them, instead of restoring the default action (SLURM's --signal=USR2@90).
IGNORED_SIGNALS_VAR = "SLURMRUN_IGNORED_SIGNALS"
# Set in a submitted job (octal): the umask workers take, the submitter's; the job's own
# processes run under 077, so that what they write into the job's folder is private.
WORKER_UMASK_VAR = "SLURMRUN_WORKER_UMASK"
