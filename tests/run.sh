#!/usr/bin/env bash
# The project's one test command (README and .ci/run call exactly this):
#
#   bash tests/run.sh [--quick] [pytest args...]     default: the whole tests/ directory
#
# 1. installs the Python dependencies (torch==2.13.0 from pip's configured sources: the CPU
#    build where a local wheel folder holds it, PyPI's CUDA build elsewhere unless a CPU build
#    is installed already), slurmrun itself and
#    docs/requirements.txt, and builds the docs site with warnings as errors;
# 2. runs the fresh-venv legs (tests/fresh_venv.sh) in the background from the start: slurmrun
#    installed as a user installs it (`pip install torch==2.13.0 .`, declared dependencies
#    only; and on Python 3.10 without torch), running smoke launches, so that an undeclared
#    dependency fails here; their output and verdict are printed at the end;
# 3. brings up the 3-node SLURM test cluster (tests/cluster/slurm-cluster.sh; needs root,
#    installs Debian's slurm + munge packages if missing) and builds the test container image
#    (tests/containers/build-image.sh, cached by its inputs' hash), beside steps 1 and 2;
# 4. runs pytest with SLURMRUN_TEST_CLUSTER=1 on two pytest-xdist workers (`--dist loadgroup`:
#    every test of tests/slurm/ on one worker, one after the other, as they share the cluster;
#    the tests that need no cluster on the other), takes the cluster down again whatever
#    happens, prints each phase's time and the 25 slowest tests, and exits non-zero if pytest
#    or a leg failed, saying which.
#
# --quick: a developer's loop of a few minutes: no fresh-venv legs, no docs build, every test
# that needs no cluster and, of the cluster's, only those marked `quick` (one per feature).
#
# SLURMRUN_SKIP_SLURM=1 skips step 3 and the `slurm`-marked tests (for machines where you
# are not root or cannot create network namespaces). Without it, not being able to start
# the cluster is an error: the SLURM tests are the point of this project.
# SLURMRUN_SKIP_FRESH_VENV=1 skips step 2 (it needs PyPI for the dependencies).
# SLURMRUN_TEST_WORKERS=N sets pytest-xdist's workers (default 2; 0 runs pytest serially).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
CLUSTER=tests/cluster/slurm-cluster.sh
NODES=3
WORKERS=${SLURMRUN_TEST_WORKERS:-2}
QUICK=0
if [ "${1:-}" = --quick ]; then
  QUICK=1
  shift
fi

say() { echo "tests/run.sh: $*" >&2; }

if [ "${SLURMRUN_SKIP_SLURM:-0}" != 1 ] && [ "$(id -u)" != 0 ]; then
  say "ERROR: the SLURM test cluster needs root (network namespaces, slurmd, munge)."
  say "       Run as root, or set SLURMRUN_SKIP_SLURM=1 to run without the SLURM tests."
  exit 1
fi

# Each phase's wall time, printed at the end (phase "name seconds" lines).
PHASES=()
RUN_START=$SECONDS
phase_done() { PHASES+=("$(printf '%-34s %5d s' "$1" "$2")"); }
print_phases() {
  say "phases (wall time; the ones marked & ran beside the others):"
  local p
  for p in "${PHASES[@]}"; do echo "    $p" >&2; done
  printf '    %-34s %5d s\n' "whole command" $((SECONDS - RUN_START)) >&2
}

WORK="$(mktemp -d -t slurmrun-run.XXXXXX)"

# The steps run beside the rest: `in_background NAME COMMAND...` runs COMMAND in a session of
# its own, its output in $WORK/NAME.log; `wait_for NAME` waits for it, sets BG_RC and BG_SECS
# (its exit status and wall time) and records its phase.
declare -A BG_PIDS=()
in_background() {
  local name=$1
  shift
  setsid bash -c 'start=$SECONDS; rc=0; "${@:2}" >"$1.log" 2>&1 || rc=$?
                  echo "$rc $((SECONDS - start))" >"$1.rc"' bg "$WORK/$name" "$@" &
  BG_PIDS[$name]=$!
}
wait_for() {
  wait "${BG_PIDS[$1]}" 2>/dev/null || true
  unset "BG_PIDS[$1]"
  read -r BG_RC BG_SECS <"$WORK/$1.rc" || { BG_RC=1; BG_SECS=0; }
  phase_done "& $2" "$BG_SECS"
}

cleanup() {
  # the cluster's start is let finish (stopped mid-way, apt or dpkg may be left broken); the
  # other steps' sessions are stopped
  [ -z "${BG_PIDS[cluster]:-}" ] || wait "${BG_PIDS[cluster]}" 2>/dev/null || true
  unset "BG_PIDS[cluster]"
  local pid
  for pid in "${BG_PIDS[@]}"; do kill -- -"$pid" 2>/dev/null || true; done
  if [ "${CLUSTER_STARTED:-0}" = 1 ]; then
    bash "$CLUSTER" down || say "WARNING: 'slurm-cluster.sh down' failed"
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

# Step 2 in the background: its own venvs, so it needs nothing of steps 1 and 3.
if [ "$QUICK" = 1 ] || [ "${SLURMRUN_SKIP_FRESH_VENV:-0}" = 1 ]; then
  say "fresh-venv legs skipped ($([ "$QUICK" = 1 ] && echo --quick || echo SLURMRUN_SKIP_FRESH_VENV=1))"
else
  say "fresh-venv legs (tests/fresh_venv.sh) started in the background; output at the end"
  in_background legs bash tests/fresh_venv.sh
fi

# Step 3 in the background as well: installing SLURM and starting its daemons waits on apt
# and on the daemons, not on the CPU.
if [ "${SLURMRUN_SKIP_SLURM:-0}" != 1 ]; then
  say "starting the $NODES-node SLURM test cluster in the background"
  CLUSTER_STARTED=1
  in_background cluster bash "$CLUSTER" up "$NODES"
fi

# The container image of tests/slurm/test_containers_slurm.py, built (or taken from its cache,
# keyed by its inputs' hash) beside the rest, so that the cluster tests do not wait for it.
if [ "${SLURMRUN_SKIP_SLURM:-0}" != 1 ]; then
  say "building the test container image in the background (tests/containers/build-image.sh)"
  in_background image bash tests/containers/build-image.sh
fi

t=$SECONDS
say "installing Python dependencies"
python3 -m pip install -q --root-user-action=ignore torch==2.13.0
python3 -m pip install -q --root-user-action=ignore -e '.[test,frameworks]'
python3 -m pip install -q --root-user-action=ignore -r docs/requirements.txt
phase_done "pip install" $((SECONDS - t))

if [ "$QUICK" = 1 ]; then
  say "--quick: docs build skipped"
else
  # The docs site, warnings as errors: a broken reference or docstring fails the run here.
  t=$SECONDS
  say "building the docs (python -m sphinx -W -b html docs docs/_build)"
  python3 -m sphinx -W -q -b html docs docs/_build
  phase_done "docs build" $((SECONDS - t))
fi

# The legs' output and verdict; 0 when they passed or did not run.
legs_rc=0
legs_report() {
  [ -n "${BG_PIDS[legs]:-}" ] || return 0
  wait_for legs "fresh-venv legs"
  cat "$WORK/legs.log" >&2 || true
  if [ "$BG_RC" = 0 ]; then
    say "fresh-venv legs passed in $BG_SECS s"
  else
    say "ERROR: fresh-venv legs FAILED after $BG_SECS s (see above)"
    legs_rc=1
  fi
}

# The background image build's time (its tests, run last of the cluster's, wait for it on
# the build's lock, and build it again themselves, saying why, if it failed here).
image_report() {
  [ -n "${BG_PIDS[image]:-}" ] || return 0
  wait_for image "container image (build or cache)"
  if [ "$BG_RC" != 0 ]; then
    say "WARNING: building the container image in the background failed:"
    tail -20 "$WORK/image.log" >&2 || true
  fi
}

# The verdict of both parts, pytest's and the legs', named; pytest's summary line is repeated
# last, so that it closes the output whatever was printed after it.
finish() {
  local pytest_rc="$1"
  image_report
  legs_report
  print_phases
  [ "$pytest_rc" = 0 ] || say "FAILED: pytest exited with $pytest_rc"
  [ "$legs_rc" = 0 ] || say "FAILED: fresh-venv legs"
  if [ -s "$WORK/summary" ]; then cat "$WORK/summary"; fi
  if [ "$pytest_rc" != 0 ]; then exit "$pytest_rc"; fi
  exit "$legs_rc"
}

[ $# -gt 0 ] || set -- tests
XDIST=()
[ "$WORKERS" = 0 ] || XDIST=(-n "$WORKERS" --dist loadgroup)

# pytest, its output shown as it comes and its summary line kept for the end.
run_pytest() {
  local rc=0 t=$SECONDS
  set +e
  # -p no:benchmark: a pytest-benchmark that a machine may have (no test uses it) warns at
  # every xdist worker that it is disabled
  python3 -m pytest "${XDIST[@]}" -p no:benchmark --durations=25 "$@" 2>&1 | tee "$WORK/pytest.log"
  rc=${PIPESTATUS[0]}
  set -e
  phase_done "pytest" $((SECONDS - t))
  grep -E '^=+ .*(passed|failed|error|skipped|no tests ran).* in [0-9.]+s' "$WORK/pytest.log" \
    | tail -1 >"$WORK/summary" || true
  return "$rc"
}

if [ "${SLURMRUN_SKIP_SLURM:-0}" = 1 ]; then
  say "SLURMRUN_SKIP_SLURM=1: no SLURM cluster, running only the tests not marked 'slurm'"
  rc=0
  run_pytest -m "not slurm" "$@" || rc=$?
  finish "$rc"
fi

t=$SECONDS
wait_for cluster "cluster up (apt, daemons)"
phase_done "waiting for the cluster" $((SECONDS - t))
cat "$WORK/cluster.log" >&2
if [ "$BG_RC" != 0 ]; then
  say "ERROR: could not start the SLURM test cluster. Daemon logs:"
  bash "$CLUSTER" logs 100 || true
  say "ERROR: SLURM test cluster failed to start (set SLURMRUN_SKIP_SLURM=1 to run without it)"
  legs_report
  exit 1
fi

export SLURMRUN_TEST_CLUSTER=1
rc=0
if [ "$QUICK" = 1 ]; then
  run_pytest -m "not slurm or quick" "$@" || rc=$?
else
  run_pytest "$@" || rc=$?
fi

if [ "$rc" != 0 ]; then
  say "pytest exited with $rc; SLURM cluster state and daemon logs follow"
  bash "$CLUSTER" status || true
  timeout 10 squeue || true
  bash "$CLUSTER" logs 60 || true
fi
finish "$rc" # the EXIT trap takes the cluster down
