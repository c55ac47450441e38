#!/usr/bin/env bash
# slurm-rootfs.sh - a Debian release's SLURM, unpacked in a minbase root filesystem, for
# tests/cluster/slurm-cluster.sh's `--release RELEASE` (root):
#
#   bash tests/cluster/slurm-rootfs.sh RELEASE      prints the rootfs's path
#
# RELEASE: bookworm (SLURM 22.05), trixie (24.11) or sid (26.05). Built once by debootstrap,
# run from its own downloaded .deb (no host package installed or touched), then Debian's
# slurmctld, slurmd, slurm-client and munge are installed inside it with its own apt, with the
# libraries the host's Python links to (the host's Python is bind-mounted into it at run time)
# and the tools the SLURM tests use on the nodes (ssh, sshd, nft, ip, ss).
#
# Cached by its inputs' hash (this script, RELEASE, the package list) under
# $SLURMRUN_IMAGE_CACHE (default /var/cache/slurmrun-tests, beside the container image):
# a second call takes well under a second. 1 to 2 minutes cold per release (300 MB).
# The archive is the one the host's apt reads (its first Debian URI), or
# $SLURMRUN_DEBIAN_MIRROR.
set -euo pipefail

RELEASE=${1:-}
CACHE=${SLURMRUN_IMAGE_CACHE:-/var/cache/slurmrun-tests}
say() { echo "tests/cluster/slurm-rootfs.sh: $*" >&2; }
die() { say "ERROR: $*"; exit 1; }

PKGS=(slurmctld slurmd slurm-client munge iproute2 procps hostname nftables
  openssh-server openssh-client
  zlib1g libbz2-1.0 liblzma5 libsqlite3-0 libncursesw6 libuuid1 libexpat1 libffi8 libnsl2
  libstdc++6 libgcc-s1)
case $RELEASE in
  bookworm) PKGS+=(libssl3 libreadline8) ;;
  trixie | sid) PKGS+=(libssl3t64 libreadline8t64) ;;
  *) die "RELEASE must be bookworm, trixie or sid (got '${RELEASE}')" ;;
esac
[ "$(id -u)" = 0 ] || die "must run as root (debootstrap, chroot)"

key=$( (cat "${BASH_SOURCE[0]}"; echo "$RELEASE ${PKGS[*]}") | sha256sum | cut -c1-16)
ROOTFS=$CACHE/slurm-$RELEASE-$key
mkdir -p "$CACHE"
exec 9>"$CACHE/.slurm-$RELEASE.lock"
flock -w 1200 9 || die "another build of $RELEASE holds $CACHE/.slurm-$RELEASE.lock"
if [ -f "$ROOTFS/.slurmrun-rootfs-done" ]; then echo "$ROOTFS"; exit 0; fi

mirror=${SLURMRUN_DEBIAN_MIRROR:-$(apt-get indextargets --format '$(REPO_URI)' 2>/dev/null \
  | grep -v -- '-security' | grep '/debian/\?$' | head -1)}
[ -n "$mirror" ] || die "no Debian archive in the host's apt sources: set SLURMRUN_DEBIAN_MIRROR"

start=$SECONDS
WORK=$(mktemp -d -t slurmrun-rootfs.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
say "building $ROOTFS (once; cached while its inputs stay the same) from $mirror"
# older keys (their inputs changed), unless a cluster still runs on one (slurm-cluster.sh
# records its rootfs in its state folder)
for old in "$CACHE/slurm-$RELEASE"-*; do
  [ -e "$old" ] || continue
  if cat /var/lib/slurm-cluster-*/rootfs 2>/dev/null | grep -qxF "$old"; then
    say "keeping $old: a cluster runs on it"
  else
    rm -rf "$old"
  fi
done

# debootstrap from its own .deb, unpacked here (the newest the host's apt knows; on a fresh
# machine after an `apt-get update`, under the test scripts' one apt lock: tests/run.sh runs
# the host cluster's apt-get beside this)
exec 8>/run/lock/slurmrun-tests-apt.lock
flock -w 900 8 || die "another test script's apt-get holds /run/lock/slurmrun-tests-apt.lock"
(cd "$WORK" && apt-get download -q debootstrap >"$WORK/download.log" 2>&1) \
  || { apt-get -o DPkg::Lock::Timeout=300 update -qq >>"$WORK/download.log" 2>&1 \
       && (cd "$WORK" && apt-get download -q debootstrap >>"$WORK/download.log" 2>&1); } \
  || { tail -5 "$WORK/download.log" >&2; die "apt-get download debootstrap failed"; }
exec 8>&-
dpkg -x "$WORK"/debootstrap_*.deb "$WORK/dbs"
DEBOOTSTRAP_DIR=$WORK/dbs/usr/share/debootstrap timeout 1200 "$WORK/dbs/usr/sbin/debootstrap" \
  --variant=minbase "$RELEASE" "$ROOTFS.part" "$mirror" >"$WORK/debootstrap.log" 2>&1 \
  || { tail -20 "$WORK/debootstrap.log" >&2; die "debootstrap $RELEASE failed"; }
say "debootstrap done in $((SECONDS - start)) s"

# apt-get install inside, in a throwaway mount namespace (its /proc goes with it); no service
# is started (policy-rc.d)
printf '#!/bin/sh\nexit 101\n' >"$ROOTFS.part/usr/sbin/policy-rc.d"
chmod +x "$ROOTFS.part/usr/sbin/policy-rc.d"
# the archive may be a snapshot older than sid's Release file's Valid-Until (a week)
echo 'Acquire::Check-Valid-Until "false";' >"$ROOTFS.part/etc/apt/apt.conf.d/99slurmrun-snapshot"
unshare -m --propagation private sh -c '
  set -e
  R=$1; shift
  mount -t proc proc "$R/proc"
  run() { chroot "$R" env -i DEBIAN_FRONTEND=noninteractive PATH=/usr/sbin:/usr/bin:/sbin:/bin "$@"; }
  run apt-get update -qq
  run apt-get install -y -qq --no-install-recommends "$@"
  run apt-get clean
' sh "$ROOTFS.part" "${PKGS[@]}" >"$WORK/apt.log" 2>&1 \
  || { tail -20 "$WORK/apt.log" >&2; die "apt-get install in the $RELEASE rootfs failed"; }
# the package's own config and service leftovers are not used: slurm-cluster.sh writes its own
rm -f "$ROOTFS.part/etc/munge/munge.key"
chroot "$ROOTFS.part" slurmd -V >"$ROOTFS.part/.slurm-version"
touch "$ROOTFS.part/.slurmrun-rootfs-done"
mv "$ROOTFS.part" "$ROOTFS"
say "$RELEASE rootfs ($(cat "$ROOTFS/.slurm-version")) built in $((SECONDS - start)) s"
echo "$ROOTFS"
