#!/bin/bash
# A batch job whose Python driver calls slurmrun.launch:
#   sbatch examples/sbatch_job.sh
# The driver runs once, here on the job's first node; launch() starts
# one agent per node with srun, and one worker per GPU (or, on nodes
# without GPUs, per task: 2 here). quickstart.py keeps that default
# ("auto"); QUICKSTART_WORKERS=<n> would set n workers per node instead.
#SBATCH --job-name=slurmrun-example
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --time=5
set -euo pipefail

# sbatch runs a copy of this script: SLURM_SUBMIT_DIR is where sbatch ran.
cd "${SLURM_SUBMIT_DIR:-.}"
python3 "${EXAMPLES_DIR:-examples}/quickstart.py"
