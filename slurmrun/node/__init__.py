"""Each node's side of a launch: the agent, its spawner, and the workers it forks.

One agent per node; its spawner imports torch once and forks every worker. It talks to
`slurmrun.launcher` only through `slurmrun.protocol` and `slurmrun.transport`
(with `slurmrun.authentication` and `slurmrun.pickling`).
"""
