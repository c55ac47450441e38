#!/usr/bin/env bash
# The project's one test command (README and .ci/run call exactly this):
#
#   bash tests/run.sh [pytest args...]        default: the whole tests/ directory
#
# 1. installs the Python dependencies (torch pinned to a CPU-sized wheel) and slurmrun itself;
# 2. brings up the 3-node SLURM test cluster (tests/cluster/slurm-cluster.sh; needs root,
#    installs Debian's slurm + munge packages if missing);
# 3. runs pytest with SLURMRUN_TEST_CLUSTER=1, takes the cluster down again whatever happens,
#    and exits with pytest's exit code.
#
# SLURMRUN_SKIP_SLURM=1 skips steps 2 and the `slurm`-marked tests (for machines where you
# are not root or cannot create network namespaces). Without it, not being able to start
# the cluster is an error: the SLURM tests are the point of this project.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
CLUSTER=tests/cluster/slurm-cluster.sh
NODES=3

say() { echo "tests/run.sh: $*" >&2; }

if [ "${SLURMRUN_SKIP_SLURM:-0}" != 1 ] && [ "$(id -u)" != 0 ]; then
  say "ERROR: the SLURM test cluster needs root (network namespaces, slurmd, munge)."
  say "       Run as root, or set SLURMRUN_SKIP_SLURM=1 to run without the SLURM tests."
  exit 1
fi

say "installing Python dependencies"
python3 -m pip install -q --root-user-action=ignore torch==2.13.0
python3 -m pip install -q --root-user-action=ignore -e '.[test]'

[ $# -gt 0 ] || set -- tests

if [ "${SLURMRUN_SKIP_SLURM:-0}" = 1 ]; then
  say "SLURMRUN_SKIP_SLURM=1: no SLURM cluster, running only the tests not marked 'slurm'"
  exec python3 -m pytest -m "not slurm" "$@"
fi

cluster_down() { bash "$CLUSTER" down || say "WARNING: 'slurm-cluster.sh down' failed"; }
trap cluster_down EXIT

say "starting the $NODES-node SLURM test cluster"
if ! bash "$CLUSTER" up "$NODES"; then
  say "ERROR: could not start the SLURM test cluster. Daemon logs:"
  bash "$CLUSTER" logs 100 || true
  say "ERROR: SLURM test cluster failed to start (set SLURMRUN_SKIP_SLURM=1 to run without it)"
  exit 1
fi

export SLURMRUN_TEST_CLUSTER=1
rc=0
python3 -m pytest "$@" || rc=$?

if [ "$rc" != 0 ]; then
  say "pytest exited with $rc; SLURM cluster state and daemon logs follow"
  bash "$CLUSTER" status || true
  timeout 10 squeue || true
  bash "$CLUSTER" logs 60 || true
fi
exit "$rc"
