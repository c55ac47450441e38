#!/usr/bin/env bash
# The test container image: a Charliecloud image directory (an unpacked root filesystem) built
# on this machine from Debian's packages and pip, never pulled from a registry:
#
#   bash tests/containers/build-image.sh        prints the image directory's path
#
# 1. the base, cached: Debian 12 (debootstrap, minbase) with python3, and a venv /opt/venv
#    holding torch (pinned, the CPU build) and slurmrun's declared dependencies, installed
#    offline from wheels this machine's pip gathered. Python 3.11 on every host: the pinned
#    torch wheel is for 3.11, and bookworm's python3 is 3.11 (on a Debian 13 host too).
#    Rebuilt only when this script or pyproject.toml's dependencies change (a stamp);
# 2. this checkout's slurmrun, installed into /opt/venv as a wheel at every call (seconds),
#    so that the image runs the same slurmrun as the launcher;
# 3. a marker the tests look for: VARIANT_ID=slurmrun-test-image in the image's
#    /etc/os-release.
#
# About 2.5 minutes the first time (1.2 GB), about 5 s afterwards.
#
# Installs Debian's charliecloud-runtime (ch-run) and debootstrap when missing (root).
# SLURMRUN_IMAGE_CACHE: where images live (default /var/cache/slurmrun-tests).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE="${SLURMRUN_IMAGE_CACHE:-/var/cache/slurmrun-tests}"
TORCH_PIN=2.13.0
SUITE=bookworm
say() { echo "tests/containers/build-image.sh: $*" >&2; }

if ! command -v ch-run >/dev/null || ! command -v debootstrap >/dev/null; then
  say "installing charliecloud-runtime and debootstrap (Debian's packages)"
  # one apt-get at a time: tests/run.sh installs SLURM's packages at the same time
  # (tests/cluster/slurm-cluster.sh takes the same lock), and `apt-get update` does not wait
  lock=(-o DPkg::Lock::Timeout=300)
  exec 8>/run/lock/slurmrun-tests-apt.lock
  flock -w 900 8 || { say "ERROR: another test script's apt-get holds the lock"; exit 1; }
  apt-get "${lock[@]}" update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get "${lock[@]}" install -y -q charliecloud-runtime debootstrap >/dev/null
  exec 8>&-
fi

deps="$(python3 - "$ROOT/pyproject.toml" <<'EOF'
import sys, tomllib
print(" ".join(d for d in tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
               if not d.startswith("torch")))
EOF
)"
key="$( (cat "${BASH_SOURCE[0]}"; echo "$deps $TORCH_PIN $SUITE") | sha256sum | cut -c1-16)"
IMAGE="$CACHE/image-$key"
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock -w 1200 9 || { say "ERROR: another build holds $CACHE/.lock"; exit 1; }

WORK="$(mktemp -d -t slurmrun-image.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT

if [ ! -f "$IMAGE/.slurmrun-base-done" ]; then
  start=$SECONDS
  say "building the base image $IMAGE (once; cached while its inputs stay the same)"
  rm -rf "$IMAGE" "$CACHE"/image-*  # older keys: their inputs changed
  debootstrap --variant=minbase --include=python3,python3-venv "$SUITE" "$IMAGE" \
    >"$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
  # The wheels, gathered by this machine's pip (its index and local files), then installed
  # inside the image with the image's own Python and no network.
  # numpy: torch warns at import without it.
  # shellcheck disable=SC2086  # $deps: one requirement per word
  python3 -m pip wheel -q --wheel-dir "$WORK/wheels" "torch==$TORCH_PIN" numpy $deps \
    >"$WORK/pip.log" 2>&1 || { tail -20 "$WORK/pip.log" >&2; exit 1; }
  USER=root ch-run -w --unset-env='PIP_*' -b "$WORK/wheels:/mnt" "$IMAGE" -- sh -c "
    python3 -m venv /opt/venv &&
    /opt/venv/bin/pip install -q --no-index --find-links /mnt torch==$TORCH_PIN numpy $deps"
  echo 'VARIANT_ID=slurmrun-test-image' >>"$IMAGE/etc/os-release"
  # ch-run binds the host's /etc/hosts (the nodes' names) over the image's only where the
  # image has one; debootstrap makes none, and gloo would then find no address for a node.
  touch "$IMAGE/etc/hosts"
  touch "$IMAGE/.slurmrun-base-done"
  say "base image built in $((SECONDS - start)) s"
fi

# This checkout's slurmrun, built from a copy of its files (nothing written into the checkout).
mkdir -p "$WORK/src"
cp -r "$ROOT/pyproject.toml" "$ROOT/README.md" "$ROOT/slurmrun" "$WORK/src/"
find "$WORK/src" -name __pycache__ -prune -exec rm -rf {} +
python3 -m pip wheel -q --no-deps --no-build-isolation --wheel-dir "$WORK/slurmrun" "$WORK/src" \
  >"$WORK/pip.log" 2>&1 || { tail -20 "$WORK/pip.log" >&2; exit 1; }
USER=root ch-run -w --unset-env='PIP_*' -b "$WORK/slurmrun:/mnt" "$IMAGE" -- sh -c \
  '/opt/venv/bin/pip install -q --no-index --no-deps --force-reinstall /mnt/*.whl'
echo "$IMAGE"
