"""SLURM's facts, read in one place: the job's variables, scontrol, squeue and sacct.

The ground floor for everything that asks SLURM something: `job` (the job this process runs
in, from its ``SLURM_*`` variables), `step` (whether this process is a task of a step),
`scontrol` (running and reading ``scontrol``), `records` (scontrol's records, read by
fields, never by words), `job_end` (time limit, grace, preemption), `queue` (job states from
squeue and sacct), `cluster` (whether a controller answers, where a submitted job went, the
SLURM version) and `notation` (host lists, GRES).
Import from the modules; this package adds nothing.
"""
