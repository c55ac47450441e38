#!/usr/bin/env bash
# The project's one test command (README and .ci/run call exactly this):
#
#   bash tests/run.sh [pytest args...]        default: the whole tests/ directory
#
# 1. installs the Python dependencies (torch pinned to a CPU-sized wheel), slurmrun itself and
#    docs/requirements.txt, and builds the docs site with warnings as errors;
# 2. runs the fresh-venv legs (tests/fresh_venv.sh): slurmrun installed as a user installs it
#    (`pip install torch==2.13.0 .`, declared dependencies only; and on Python 3.10 without
#    torch), running smoke launches, so that an undeclared dependency fails here; a failure
#    is reported at the end, after pytest, which runs all the same;
# 3. brings up the 3-node SLURM test cluster (tests/cluster/slurm-cluster.sh; needs root,
#    installs Debian's slurm + munge packages if missing);
# 4. runs pytest with SLURMRUN_TEST_CLUSTER=1, takes the cluster down again whatever happens,
#    and exits non-zero if pytest or a leg failed, saying which.
#
# SLURMRUN_SKIP_SLURM=1 skips step 3 and the `slurm`-marked tests (for machines where you
# are not root or cannot create network namespaces). Without it, not being able to start
# the cluster is an error: the SLURM tests are the point of this project.
# SLURMRUN_SKIP_FRESH_VENV=1 skips step 2 (it needs PyPI for the dependencies).
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
python3 -m pip install -q --root-user-action=ignore -e '.[test,frameworks]'
python3 -m pip install -q --root-user-action=ignore -r docs/requirements.txt

# The docs site, warnings as errors: a broken reference or docstring fails the run here.
say "building the docs (python -m sphinx -W -b html docs docs/_build)"
python3 -m sphinx -W -q -b html docs docs/_build

[ $# -gt 0 ] || set -- tests

# Step 2, before the cluster is up and pytest runs, so that pytest's summary closes the
# output; prints each leg's time and its verdict.
fresh_venv_legs() {
  if [ "${SLURMRUN_SKIP_FRESH_VENV:-0}" = 1 ]; then
    say "SLURMRUN_SKIP_FRESH_VENV=1: fresh-venv legs skipped"
    return 0
  fi
  say "fresh-venv legs (tests/fresh_venv.sh)"
  local start=$SECONDS
  if bash tests/fresh_venv.sh; then
    say "fresh-venv legs passed in $((SECONDS - start)) s"
  else
    say "ERROR: fresh-venv legs FAILED after $((SECONDS - start)) s (see above)"
    return 1
  fi
}

# The verdict of both parts, pytest's and the legs', named.
finish() {
  local pytest_rc="$1"
  [ "$pytest_rc" = 0 ] || say "FAILED: pytest exited with $pytest_rc"
  [ "$legs_rc" = 0 ] || say "FAILED: fresh-venv legs"
  if [ "$pytest_rc" != 0 ]; then exit "$pytest_rc"; fi
  exit "$legs_rc"
}

legs_rc=0
fresh_venv_legs || legs_rc=$?

if [ "${SLURMRUN_SKIP_SLURM:-0}" = 1 ]; then
  say "SLURMRUN_SKIP_SLURM=1: no SLURM cluster, running only the tests not marked 'slurm'"
  rc=0
  python3 -m pytest -m "not slurm" "$@" || rc=$?
  finish "$rc"
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
# --durations: the slowest tests, named in every run, to keep the suite short
python3 -m pytest --durations=15 "$@" || rc=$?

if [ "$rc" != 0 ]; then
  say "pytest exited with $rc; SLURM cluster state and daemon logs follow"
  bash "$CLUSTER" status || true
  timeout 10 squeue || true
  bash "$CLUSTER" logs 60 || true
fi
finish "$rc" # the EXIT trap takes the cluster down
