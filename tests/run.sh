#!/usr/bin/env bash
# The project's one test command (README and .ci/run call exactly this):
#
#   bash tests/run.sh [--quick] [--slurm-versions LIST] [pytest args...]
#                                                    default: the whole tests/ directory
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
#    the files of tests/slurm/ in one group (SLURMRUN_TEST_CLUSTER_GROUPS, below), on one
#    worker, its tests one after the other; a test that changes the whole cluster has it to
#    itself, see tests/slurm/conftest.py; the tests that need no cluster on the other worker,
#    and on both once the group is done), takes the cluster down again whatever happens, prints
#    each phase's time and the 25 slowest tests, and exits non-zero if pytest or a leg failed,
#    saying which.
#
# 5. the SLURM version legs: the SLURM tests again on a Debian release's SLURM (a rootfs
#    cluster, tests/cluster/slurm-rootfs.sh, cached; SLURM_CLUSTER_RELEASE in
#    tests/cluster/slurm-cluster.sh), pytest run inside that rootfs on the host's Python.
#    By default one leg, sid (SLURM 26.05): the tests marked `slurm_version_leg` (those that read
#    SLURM's output or build its commands, see tests/slurm/conftest.py), beside step 4.
#    --slurm-versions all: the whole tests/slurm/ (but the container tests: no ch-run in the
#    rootfs) on bookworm (22.05), trixie (24.11) and sid (26.05), one after another after
#    step 4, each release whose SLURM differs from the host's (the host's is step 4's);
#    --slurm-versions LIST: those of LIST (comma-separated: host,bookworm,trixie,sid), the
#    whole tests/slurm/ too; `host` alone: no leg. A leg's output, time and verdict are printed
#    at the end; a failed leg fails the command.
#
# --quick: a developer's loop of a few minutes: no fresh-venv legs, no docs build, every test
# that needs no cluster and, of the cluster's, only those marked `quick` (one per feature).
#
# SLURMRUN_SKIP_SLURM=1 skips step 3 and the `slurm`-marked tests (for machines where you
# are not root or cannot create network namespaces). Without it, not being able to start
# the cluster is an error: the SLURM tests are the point of this project.
# SLURMRUN_SKIP_FRESH_VENV=1 skips step 2 (it needs PyPI for the dependencies).
# SLURMRUN_TEST_CLUSTER_GROUPS=K sets how many groups of cluster tests run at once (default 1.
# With 2, on 2 cores, the whole command took 14:23-15:05 rather than about 17 minutes; the
# files whose jobs take GPUs share the first group (tests/slurm/conftest.py). It is not the
# default yet: a test whose job of 1 or 2 nodes expects node1 can find it filled for a moment
# by the other group's jobs (seen once in four runs); such tests must take whatever nodes SLURM
# gives, as tests/slurm/test_reserve_slurm.py does now);
# SLURMRUN_TEST_WORKERS=N sets pytest-xdist's workers (default K + 1; 0 runs pytest serially).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
CLUSTER=tests/cluster/slurm-cluster.sh
NODES=3
export SLURMRUN_TEST_CLUSTER_GROUPS=${SLURMRUN_TEST_CLUSTER_GROUPS:-1}
WORKERS=${SLURMRUN_TEST_WORKERS:-$((SLURMRUN_TEST_CLUSTER_GROUPS + 1))}
QUICK=0
VERSIONS=default
say() { echo "tests/run.sh: $*" >&2; }
while [ $# -gt 0 ]; do
  case $1 in
    --quick) QUICK=1; shift ;;
    --slurm-versions)
      [ $# -ge 2 ] || { say "ERROR: --slurm-versions needs a value: all, or a list of host,bookworm,trixie,sid"; exit 2; }
      VERSIONS=$2; shift 2 ;;
    --slurm-versions=*) VERSIONS=${1#*=}; shift ;;
    *) break ;;
  esac
done
# The releases whose SLURM the legs run on (whether each differs from the host's is seen later)
LEG_RELEASES=()
LEG_ALL=1  # the whole tests/slurm/ (an explicit list), or only the marked tests (default)
case $VERSIONS in
  default) LEG_RELEASES=(sid); LEG_ALL=0 ;;
  all) LEG_RELEASES=(bookworm trixie sid) ;;
  *)
    IFS=, read -r -a wanted <<<"$VERSIONS"
    for r in "${wanted[@]}"; do
      case $r in
        host) ;;
        bookworm | trixie | sid) LEG_RELEASES+=("$r") ;;
        *) say "ERROR: --slurm-versions: unknown '$r' (all, or a list of host,bookworm,trixie,sid)"; exit 2 ;;
      esac
    done ;;
esac
[ "$QUICK" = 0 ] || [ "$VERSIONS" != default ] || LEG_RELEASES=()  # --quick: no leg unless asked

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
LEGS_UP=()  # the releases' clusters brought up (taken down at the end whatever happens)
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
  local r
  for r in "${LEGS_UP[@]}"; do
    SLURM_CLUSTER_RELEASE=$r bash "$CLUSTER" down || say "WARNING: the $r cluster's 'down' failed"
  done
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

# The default version leg's cluster (sid), its rootfs built or taken from its cache, beside
# the host's cluster; its pytest starts beside the main one, once the dependencies are in.
if [ "${SLURMRUN_SKIP_SLURM:-0}" != 1 ] && [ "$LEG_ALL" = 0 ] && [ ${#LEG_RELEASES[@]} -gt 0 ]; then
  say "starting the ${LEG_RELEASES[0]} SLURM cluster (a Debian rootfs) in the background"
  LEGS_UP+=("${LEG_RELEASES[0]}")
  in_background leg_up env SLURM_CLUSTER_RELEASE="${LEG_RELEASES[0]}" bash "$CLUSTER" up "$NODES"
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

# A version leg: RELEASE's cluster (up already, or brought up here), pytest inside its rootfs
# on the host's Python with `pytest args...`, the cluster taken down after. Output in
# $WORK/leg-RELEASE.log; skipped (rc 0, said why) when RELEASE's SLURM is the host's.
LEG_RCS=()
leg_body() {  # RELEASE pytest-args...
  local r=$1 rc=0 rootfs v host_v
  shift
  rootfs=$(bash tests/cluster/slurm-rootfs.sh "$r") || { echo "no $r rootfs"; return 1; }
  v=$(awk '{print $2}' "$rootfs/.slurm-version")
  host_v=$(slurmd -V 2>/dev/null | awk '{print $2}')
  if [ "$v" = "$host_v" ]; then
    echo "SLURM $v of $r is the host's: its tests ran in the main run"
  else
    if ! SLURM_CLUSTER_RELEASE=$r bash "$CLUSTER" status >/dev/null 2>&1; then
      SLURM_CLUSTER_RELEASE=$r bash "$CLUSTER" up "$NODES" || { echo "the $r cluster did not come up"; return 1; }
    fi
    echo "== SLURM $v ($r): pytest $*"
    SLURM_CLUSTER_RELEASE=$r SLURMRUN_TEST_CLUSTER=1 bash "$CLUSTER" exec python3 -m pytest \
      -p no:benchmark -p no:cacheprovider --basetemp="$WORK/pytest-$r" --durations=10 "$@" || rc=$?
  fi
  # `down` fails when it left a process, namespace or bridge of the cluster behind
  SLURM_CLUSTER_RELEASE=$r bash "$CLUSTER" down || rc=1
  return "$rc"
}
run_leg() {  # RELEASE pytest-args...
  local r=$1 rc=0 t=$SECONDS
  leg_body "$@" >"$WORK/leg-$r.log" 2>&1 || rc=$?
  echo "$rc $((SECONDS - t))" >"$WORK/leg-$r.rc"
  return "$rc"
}
leg_report() {  # RELEASE
  local r=$1 rc secs
  read -r rc secs <"$WORK/leg-$r.rc" || { rc=1; secs=0; }
  phase_done "SLURM version leg: $r" "$secs"
  cat "$WORK/leg-$r.log" >&2 || true
  if [ "$rc" = 0 ]; then say "SLURM version leg $r passed in $secs s"
  else say "ERROR: SLURM version leg $r FAILED (exit $rc) after $secs s (see above)"; LEG_RCS+=("$r"); fi
}

# The verdict of both parts, pytest's and the legs', named; pytest's summary line is repeated
# last, so that it closes the output whatever was printed after it.
finish() {
  local pytest_rc="$1"
  image_report
  legs_report
  if [ "${DEFAULT_LEG:-0}" = 1 ]; then
    [ -z "${BG_PIDS[leg]:-}" ] || wait "${BG_PIDS[leg]}" 2>/dev/null || true
    unset "BG_PIDS[leg]"
    leg_report "${LEG_RELEASES[0]}"
  fi
  print_phases
  [ "$pytest_rc" = 0 ] || say "FAILED: pytest exited with $pytest_rc"
  [ "$legs_rc" = 0 ] || say "FAILED: fresh-venv legs"
  [ ${#LEG_RCS[@]} = 0 ] || { say "FAILED: SLURM version legs: ${LEG_RCS[*]}"; [ "$legs_rc" != 0 ] || legs_rc=1; }
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
# The default version leg beside the main pytest (its cluster started with the host's)
if [ -n "${BG_PIDS[leg_up]:-}" ]; then
  DEFAULT_LEG=1
  wait_for leg_up "${LEG_RELEASES[0]} cluster up (rootfs, daemons)"
  cat "$WORK/leg_up.log" >&2
  if [ "$BG_RC" != 0 ]; then
    say "ERROR: the ${LEG_RELEASES[0]} cluster did not come up"
    echo "1 0" >"$WORK/leg-${LEG_RELEASES[0]}.rc"; : >"$WORK/leg-${LEG_RELEASES[0]}.log"
  else
    say "SLURM version leg ${LEG_RELEASES[0]} started beside the main pytest; output at the end"
    run_leg "${LEG_RELEASES[0]}" -q -m slurm_version_leg tests/slurm &
    BG_PIDS[leg]=$!
  fi
fi
rc=0
if [ "$QUICK" = 1 ]; then
  run_pytest -m "not slurm or quick" "$@" || rc=$?
else
  run_pytest "$@" || rc=$?
fi
# --slurm-versions: each release's whole tests/slurm/, one after another
if [ "$LEG_ALL" = 1 ]; then
  for r in "${LEG_RELEASES[@]}"; do
    say "SLURM version leg $r (tests/slurm/)"
    LEGS_UP+=("$r")
    run_leg "$r" -q tests/slurm --deselect tests/slurm/test_containers_slurm.py || true
    leg_report "$r"
  done
fi

if [ "$rc" != 0 ]; then
  say "pytest exited with $rc; SLURM cluster state and daemon logs follow"
  bash "$CLUSTER" status || true
  timeout 10 squeue || true
  bash "$CLUSTER" logs 60 || true
fi
finish "$rc" # the EXIT trap takes the cluster down
