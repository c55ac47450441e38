#!/usr/bin/env bash
# slurm-cluster.sh - a throwaway multi-node SLURM cluster on ONE Linux host (root).
# (slurmrun's copy of the shared reference tool; `bash tests/run.sh` drives it, and
#  tests/slurm/conftest.py reads `env`. Default: 3 nodes.)
#
#   slurm-cluster.sh up [N]   install Slurm+munge if missing, start slurmctld + N slurmd
#                             "nodes" node1..nodeN; idempotent (healthy + same settings => no-op)
#   slurm-cluster.sh down     cancel jobs, stop everything this script started, remove
#                             namespaces, /etc/hosts block, generated configs, state
#   slurm-cluster.sh status   print state; exit 0 only if controller + all nodes healthy
#   slurm-cluster.sh logs [K] tail (K lines of) the daemon logs (for CI failure output)
#   slurm-cluster.sh env      print `export SLURM_CLUSTER_...=` lines (launcher address etc.)
#   slurm-cluster.sh firewall on|off|status   (netns mode) the firewalled variant, as sites
#                             firewall login nodes: in every node's namespace, nft drops each
#                             new TCP connection to the login side except to slurmctld's port
#                             and SrunPortRange (srun's I/O), and each new one from the login
#                             side except to slurmd's port; `off` removes the rules (`up` too)
#   slurm-cluster.sh exec CMD...  (a release's cluster only) run CMD on its login side: in its
#                             rootfs (chroot), in the current directory, with the environment
#                             kept and the host's Python first on PATH
#
# Which SLURM (SLURM_CLUSTER_RELEASE):
#   host (default)  the host's own packages (installed with apt-get if missing), config in
#                   /etc/slurm, names in /etc/hosts.
#   bookworm | trixie | sid   SLURM 22.05 / 24.11 / 26.05 from that Debian release's minbase
#                   rootfs (tests/cluster/slurm-rootfs.sh: built once, cached), beside the
#                   host's cluster and touching nothing of it: its own munged, config and
#                   /etc/hosts inside the rootfs; daemons chrooted into it inside one private
#                   mount namespace (held by a `sleep infinity`) where the host's /tmp, /dev,
#                   /sys, /run/netns, this checkout's and the host Python's top folders (e.g.
#                   /root, /work) are bind-mounted at their own paths, so tmp_path and
#                   sys.executable work there as on the host. Its own state dir, netns
#                   prefix (slurmK-nodeI), bridge (slurmKbr0), subnet (10.199.K) and ports
#                   (6817+10K, 6818+10K), K = 1, 2, 3 for bookworm, trixie, sid; netns mode only.
#                   `down` kills every process left in that mount namespace and the holder
#                   (its mounts go with it).
#
# Modes (SLURM_CLUSTER_MODE):
#   netns (default) each node = slurmd in its own network namespace (own IP, own port
#                   space) + own UTS namespace (hostname nodeX), all joined by a bridge.
#                   Controller/login side = root namespace, bridge address .1
#                   (hostname alias "slurmctl").
#   multi           Slurm "multiple slurmd" mode (Debian's build has MULTIPLE_SLURMD=Yes):
#                   all slurmds in the root network namespace on distinct ports, each
#                   still in its own UTS namespace (hostname nodeX) and with its own
#                   127.0.77.x loopback address. No netns needed, but nodes share one
#                   port space.
#   auto            netns if `ip netns add` works, else multi.
#
# Other knobs (environment):
#   SLURM_CLUSTER_CPUS=4      CPUs per node (advertised; SlurmdParameters=config_overrides)
#   SLURM_CLUSTER_GPUS=2      fake GPUs per node (gres/gpu backed by char devices 1:3)
#   SLURM_CLUSTER_MEM=4096    RealMemory (MB) per node (memory not a consumable: CR_Core)
#   SLURM_CLUSTER_SUBNET=10.199.0   /24 used by the netns bridge (only our own addresses)
#   SLURM_CLUSTER_STATE=/var/lib/slurm-cluster   spool, pids, logs, fake devices
#   SLURM_CLUSTER_NO_INSTALL=1  never run apt-get
#   SLURM_CLUSTER_TIMEOUT=60  seconds to wait for daemons/nodes
#   SLURM_CLUSTER_KEEP_ON_FAIL=1  leave a failed `up` in place for inspection
#
# Everything started is tracked by PID under $STATE/pids; `down` kills only those PIDs
# (after checking their command line) plus processes living inside the namespaces this
# script created. No pkill/killall.
set -euo pipefail
# daemons live in /usr/sbin; some CI environments leave it off PATH
case ":$PATH:" in *:/usr/sbin:*) ;; *) PATH=$PATH:/usr/sbin:/sbin ;; esac

RELEASE=${SLURM_CLUSTER_RELEASE:-host}
case $RELEASE in
  host) K=0 ;;
  bookworm) K=1 ;;
  trixie) K=2 ;;
  sid) K=3 ;;
  *) echo "slurm-cluster: ERROR: SLURM_CLUSTER_RELEASE must be host, bookworm, trixie or sid (got '$RELEASE')" >&2; exit 2 ;;
esac
if [ "$K" = 0 ]; then STATE=${SLURM_CLUSTER_STATE:-/var/lib/slurm-cluster}
else STATE=${SLURM_CLUSTER_STATE:-/var/lib/slurm-cluster-$RELEASE}; fi
CPUS=${SLURM_CLUSTER_CPUS:-4}
GPUS=${SLURM_CLUSTER_GPUS:-2}
MEM=${SLURM_CLUSTER_MEM:-4096}
SUBNET=${SLURM_CLUSTER_SUBNET:-10.199.$K}
TIMEOUT=${SLURM_CLUSTER_TIMEOUT:-60}
MODE_REQ=${SLURM_CLUSTER_MODE:-netns}
MODE=$MODE_REQ
CLUSTER=slurmtest
CTL_NAME=slurmctl
BRIDGE=slurmcbr0
NS_PREFIX=slurmc-
VETH_PREFIX=slurmcv
MULTI_NET=127.0.77
CTLD_PORT=$((6817 + 10 * K))
SLURMD_PORT=$((6818 + 10 * K))
# srun's listening ports (SrunPortRange), above the kernel's ephemeral ones (32768-60999 by
# default): the firewalled variant lets the nodes reach these on the login side, and a port a
# program there binds to 0 never falls among them
SRUN_PORTS=$((61000 + 1000 * K))-$((61999 + 1000 * K))
FIREWALL_TABLE=slurm_cluster_firewall
ROOTFS=""  # a release's cluster: its root filesystem (up: built; later: $STATE/rootfs)
HOSTS=/etc/hosts
if [ "$K" != 0 ]; then
  BRIDGE=slurm${K}br0
  NS_PREFIX=slurm$K-
  VETH_PREFIX=slurm${K}v
  ROOTFS=$(cat "$STATE/rootfs" 2>/dev/null || true)
  # no rootfs recorded (not up yet): the host's /etc/hosts and /etc/slurm are the host
  # cluster's, never this one's, so `down` (also the one `up` starts with) leaves them alone
  HOSTS=${ROOTFS:+$ROOTFS/etc/hosts}  # (its own: `down` must never edit the host's)
fi
CONF_DIR=$ROOTFS/etc/slurm
[ "$K" = 0 ] || [ -n "$ROOTFS" ] || CONF_DIR=$STATE/no-rootfs/etc/slurm
CONF=$CONF_DIR/slurm.conf
GRES_CONF=$CONF_DIR/gres.conf
MARK="# generated by slurm-cluster.sh - removed by 'slurm-cluster.sh down'"
HOSTS_BEGIN="# BEGIN slurm-cluster.sh"
HOSTS_END="# END slurm-cluster.sh"
PIDS=$STATE/pids
LOGD=$STATE/log

log() { echo "slurm-cluster: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

need_root() { [ "$(id -u)" = 0 ] || die "must run as root"; }

# ---------------------------------------------------------------- a release's rootfs
holder() { cat "$STATE/holder.pid" 2>/dev/null || true; }
# already inside the rootfs (a test run by `exec` reads `status` and `env`): no chroot needed
inside_rootfs() { [ -f /.slurmrun-rootfs-done ]; }
# S CMD...: a SLURM or munge client command of this cluster's SLURM (a rootfs's: chrooted
# into it in the holder's mount namespace, clean environment)
S() {
  if [ -z "$ROOTFS" ] || inside_rootfs; then "$@"; return; fi
  local h; h=$(holder)
  [ -n "$h" ] && [ -e "/proc/$h/ns/mnt" ] || return 1
  nsenter --mount="/proc/$h/ns/mnt" -- chroot "$ROOTFS" \
    env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 "$@"
}
# ENTER CMD...: CMD in the holder's mount namespace (host root), or as it is for the host's
ENTER() { if [ -z "$ROOTFS" ]; then "$@"; else nsenter --mount="/proc/$(holder)/ns/mnt" -- "$@"; fi; }

# The host folders the rootfs sees at their own paths: /tmp (pytest's tmp_path), and the top
# folder of this checkout and of the host's Python (its prefix, a venv's, the user site);
# a path under a system folder (/var, /opt...) is bound itself. A Python under /usr cannot be
# (the rootfs has its own /usr).
host_binds() {
  local p top seen=" /tmp "
  echo /tmp
  for p in "$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)" \
    $(python3 -c 'import site, sys; print(sys.prefix, sys.base_prefix, site.getusersitepackages())'); do
    p=$(readlink -f "$p" 2>/dev/null || echo "$p")
    case $p in
      /usr | /usr/*) die "the host's Python lives in /usr ($p), hidden by the rootfs's own /usr: use a Python installed elsewhere (pyenv, uv, a Python built under /opt)" ;;
      /tmp | /tmp/*) continue ;;
    esac
    top=/$(echo "$p" | cut -d/ -f2)
    case $top in /etc | /var | /opt | /srv | /run | /lib* | /bin | /sbin | /boot | /dev | /proc | /sys | /) top=$p ;; esac
    [ -e "$top" ] || continue
    case $seen in *" $top "*) continue ;; esac
    seen="$seen$top "
    echo "$top"
  done
}

start_holder() {  # the private mount namespace of every process of a release's cluster
  setsid unshare --mount --propagation private sleep infinity </dev/null >/dev/null 2>&1 9>&- &
  echo $! >"$STATE/holder.pid"
  wait_until 10 pid_alive "$(holder)" "sleep infinity" || die "mount namespace holder did not start"
  wait_until 10 sh -c '[ "$(readlink /proc/'"$(holder)"'/ns/mnt)" != "$(readlink /proc/self/ns/mnt)" ]' \
    || die "mount namespace holder did not unshare"
  local d binds
  binds=$(host_binds)
  # shellcheck disable=SC2016
  ENTER sh -c '
    set -e
    R=$1 S=$2; shift 2
    # the rootfs a mount point of its own: a chrooted `unshare -m --propagation private`
    # (as tests do) changes the propagation of its "/", which must be a mount
    mount --bind "$R" "$R"
    mount -t proc proc "$R/proc"
    mount --rbind /dev "$R/dev"
    mount --rbind /sys "$R/sys"
    mkdir -p "$R/run/netns" "$R$S"
    mount --rbind /run/netns "$R/run/netns"
    mount --bind "$S" "$R$S"
    for d in "$@"; do mkdir -p "$R$d"; mount --rbind "$d" "$R$d"; done
  ' sh "$ROOTFS" "$STATE" $binds || die "mounts in the rootfs failed"
}

stop_holder() {  # kill every process in the holder's mount namespace, then the holder
  local h mnt d p
  h=$(holder)
  if pid_alive "$h" "sleep infinity"; then
    mnt=$(readlink "/proc/$h/ns/mnt")
    for d in /proc/[0-9]*; do
      p=${d#/proc/}
      [ "$p" = "$h" ] && continue
      [ "$(readlink "$d/ns/mnt" 2>/dev/null)" = "$mnt" ] || continue
      log "killing leftover $p ($(tr '\0' ' ' <"$d/cmdline" 2>/dev/null | cut -c1-80))"
      kill -KILL "$p" 2>/dev/null || true
    done
    kill -KILL "$h" 2>/dev/null || true   # its mount namespace (all our mounts) goes with it
    wait_until 10 sh -c "! [ -d /proc/$h ]" || log "WARN: holder $h still there"
  fi
  rm -f "$STATE/holder.pid"
  # and whatever runs chrooted in the rootfs from a mount namespace of its own (a test's
  # `unshare -m` in a job)
  [ -n "$ROOTFS" ] || return 0
  for d in /proc/[0-9]*; do
    [ "$(readlink "$d/root" 2>/dev/null)" = "$ROOTFS" ] || continue
    log "killing leftover ${d#/proc/} ($(tr '\0' ' ' <"$d/cmdline" 2>/dev/null | cut -c1-80))"
    kill -KILL "${d#/proc/}" 2>/dev/null || true
  done
}

# ---------------------------------------------------------------- helpers
pid_alive() {  # pid expected-substring-of-cmdline
  local pid=$1 want=$2 cmd
  [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
  cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
  [[ $cmd == *"$want"* ]]
}

# startup check: the PID exists and is not a zombie. (Right after `cmd &` the child is
# still a fork of this script - its cmdline does not name the daemon yet - so a
# cmdline test here would report a just-started daemon as dead.)
proc_running() {
  local st
  [ -n "$1" ] && st=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
  [ -n "$st" ] && [ "$st" != Z ]
}

# kill a PID we recorded, only if its cmdline still matches; TERM, wait, KILL
kill_recorded() {  # pidfile expected-cmd
  local f=$1 want=$2 pid i
  [ -f "$f" ] || return 0
  pid=$(cat "$f" 2>/dev/null || true)
  if pid_alive "$pid" "$want"; then
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 50); do pid_alive "$pid" "$want" || break; sleep 0.2; done
    if pid_alive "$pid" "$want"; then
      log "pid $pid ($want) ignored SIGTERM, sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      sleep 0.2
    fi
  fi
  rm -f "$f"
}

wait_until() {  # timeout-seconds command...
  local t=$1; shift
  local end=$((SECONDS + t))
  while [ $SECONDS -lt $end ]; do
    local rc=0
    "$@" >/dev/null 2>&1 || rc=$?
    [ $rc = 0 ] && return 0
    [ $rc = 2 ] && return 1   # condition says: will never succeed
    sleep 0.3
  done
  return 1
}

node_ip() {  # i
  if [ "$(cat "$STATE/mode" 2>/dev/null || echo "$MODE")" = multi ]; then echo "$MULTI_NET.$((10 + $1))"; else echo "$SUBNET.$((10 + $1))"; fi
}

# ---------------------------------------------------------------- install
install_pkgs() {
  local missing=()
  command -v slurmctld >/dev/null || missing+=(slurmctld)
  command -v slurmd >/dev/null || missing+=(slurmd)
  command -v srun >/dev/null || missing+=(slurm-client)
  command -v munged >/dev/null || missing+=(munge)
  command -v ip >/dev/null || missing+=(iproute2)
  command -v unshare >/dev/null || missing+=(util-linux)
  command -v hostname >/dev/null || missing+=(hostname)
  command -v nft >/dev/null || missing+=(nftables)  # tests cut a node off from the launcher
  [ -x /usr/sbin/sshd ] || missing+=(openssh-server)  # ssh agents: sshd in node namespaces
  command -v ssh >/dev/null || missing+=(openssh-client)
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "${SLURM_CLUSTER_NO_INSTALL:-0}" = 1 ] && die "missing packages: ${missing[*]} (SLURM_CLUSTER_NO_INSTALL=1)"
  log "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # wait for the dpkg/apt locks instead of failing when another apt-get is still running;
  # `apt-get update` does not wait for its lists' lock: tests/run.sh starts this beside
  # tests/containers/build-image.sh, which installs its packages too (one lock for both)
  local lock=(-o DPkg::Lock::Timeout=300)
  exec 8>/run/lock/slurmrun-tests-apt.lock
  flock -w 900 8 || die "another test script's apt-get holds /run/lock/slurmrun-tests-apt.lock"
  timeout 600 apt-get "${lock[@]}" update -qq || die "apt-get update failed"
  timeout 900 apt-get "${lock[@]}" install -y -qq --no-install-recommends "${missing[@]}" >"/tmp/slurm-cluster-apt.log" 2>&1 \
    || { tail -20 /tmp/slurm-cluster-apt.log >&2; die "apt-get install failed"; }
  exec 8>&-
}

# ---------------------------------------------------------------- munge
# (unmunge exits 2 while munged is starting: wait_until's "never" code, so it is made 1)
munge_ok() { S sh -c 'timeout 5 munge -n 2>/dev/null | timeout 5 unmunge >/dev/null 2>&1' || return 1; }

start_munge_rootfs() {  # the rootfs's own munged, own key, socket in the rootfs's /run/munge
  if [ ! -s "$ROOTFS/etc/munge/munge.key" ]; then
    S mungekey --create --keyfile=/etc/munge/munge.key --force
    S chown munge:munge /etc/munge/munge.key
    chmod 0600 "$ROOTFS/etc/munge/munge.key"
  fi
  S install -d -o munge -g munge -m 0755 /run/munge
  S install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
  local user; user=$(awk -F: '$1=="munge"{print $3":"$4}' "$ROOTFS/etc/passwd")
  setsid nsenter --mount="/proc/$(holder)/ns/mnt" -- chroot --userspec="$user" "$ROOTFS" \
    /usr/sbin/munged -F </dev/null >>"$LOGD/munged.stdout" 2>&1 9>&- &
  echo $! >"$PIDS/munged.pid"
  wait_until 10 munge_ok || die "munged not answering ($(tail -3 "$LOGD/munged.stdout"))"
  log "started munged pid $(cat "$PIDS/munged.pid") (the $RELEASE rootfs's)"
}

start_munge() {
  if munge_ok; then log "munge already working (not started by us)"; return 0; fi
  if [ ! -s /etc/munge/munge.key ]; then
    install -d -o munge -g munge -m 0700 /etc/munge
    if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key --force
    else dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; fi
    chown munge:munge /etc/munge/munge.key; chmod 0600 /etc/munge/munge.key
  fi
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
  # munged daemonizes and writes its own pid file; it refuses to run as root -> user munge
  runuser -u munge -- /usr/sbin/munged 9>&- 2>>"$LOGD/munged.start" || die "munged failed to start ($(cat "$LOGD/munged.start"))"
  wait_until 10 munge_ok || die "munged not answering"
  cp /run/munge/munged.pid "$PIDS/munged.pid"
  log "started munged pid $(cat "$PIDS/munged.pid")"
}

# ---------------------------------------------------------------- network
setup_netns() {  # N
  local n=$1 i ns
  ip link add "$BRIDGE" type bridge
  ip addr add "$SUBNET.1/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  for i in $(seq 1 "$n"); do
    ns=${NS_PREFIX}node$i
    ip netns add "$ns"
    ip link add "$VETH_PREFIX$i" type veth peer name eth0 netns "$ns"
    ip link set "$VETH_PREFIX$i" master "$BRIDGE"
    ip link set "$VETH_PREFIX$i" up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "$(node_ip "$i")/24" dev eth0
    ip -n "$ns" link set eth0 up
    # deliberately no default route: a node can reach only the bridge subnet
  done
}

teardown_netns() {
  local ns pids
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^${NS_PREFIX}node" || true); do
    # every process inside a namespace we created was started (indirectly) by us
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    if [ -n "$pids" ]; then
      log "killing leftover processes in $ns: $(echo $pids)"
      kill -KILL $pids 2>/dev/null || true
      sleep 0.3
    fi
    ip netns del "$ns" 2>/dev/null || log "WARN: could not delete netns $ns"
  done
  ip link show "$BRIDGE" >/dev/null 2>&1 && ip link del "$BRIDGE" || true
  # leftover host-side veths (normally removed together with the namespace)
  for v in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep "^$VETH_PREFIX" || true); do
    ip link del "$v" 2>/dev/null || true
  done
}

# leftover processes of multi mode: those sharing the UTS namespace of a node we started
teardown_multi_procs() {
  local f uts p pid mine
  mine=$(readlink /proc/self/ns/uts)
  for f in "$STATE"/uts.node*; do
    [ -f "$f" ] || continue
    uts=$(cat "$f")
    # only a real, private UTS namespace that we created for a node (never the host's)
    if [[ $uts == uts:\[*\] ]] && [ "$uts" != "$mine" ]; then
      for p in /proc/[0-9]*; do
        pid=${p#/proc/}
        [ "$pid" -gt 1 ] || continue
        [ "$(readlink "$p/ns/uts" 2>/dev/null)" = "$uts" ] || continue
        log "killing leftover process $pid in ${f##*.} ($uts)"
        kill -KILL "$pid" 2>/dev/null || true
      done
    fi
    rm -f "$f"
  done
}

hosts_remove() {
  [ -n "$HOSTS" ] && [ -f "$HOSTS" ] || return 0
  grep -qF "$HOSTS_BEGIN" "$HOSTS" || return 0
  local tmp; tmp=$(mktemp)
  sed "/^$HOSTS_BEGIN\$/,/^$HOSTS_END\$/d" "$HOSTS" >"$tmp"
  cat "$tmp" >"$HOSTS"   # rewrite in place: /etc/hosts may be a bind mount
  rm -f "$tmp"
}

hosts_add() {  # N ctl_ip
  local n=$1 ctl_ip=$2 i
  hosts_remove
  # a rootfs's /etc/hosts: the host's names (its own hostname...) without the host cluster's
  [ -z "$ROOTFS" ] || sed "/^$HOSTS_BEGIN\$/,/^$HOSTS_END\$/d" /etc/hosts >"$HOSTS"
  {
    echo "$HOSTS_BEGIN"
    echo "$ctl_ip $CTL_NAME"
    for i in $(seq 1 "$n"); do echo "$(node_ip "$i") node$i"; done
    echo "$HOSTS_END"
  } >>"$HOSTS"
}

# ---------------------------------------------------------------- config
write_conf() {  # N ctl_ip
  local n=$1 ctl_ip=$2 i gres_node="" gres_line=""
  if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    die "$CONF exists and was not written by this script; move it away first"
  fi
  mkdir -p "$CONF_DIR"
  if [ "$GPUS" -gt 0 ]; then
    gres_node=" Gres=gpu:$GPUS"
    mkdir -p "$STATE/dev"
    for i in $(seq 0 $((GPUS - 1))); do
      # gres/gpu in 22.05 drops GPUs without File=, and File must stat() as a
      # char/block device -> clones of /dev/null (major 1, minor 3)
      [ -c "$STATE/dev/gpu$i" ] || mknod "$STATE/dev/gpu$i" c 1 3
    done
    if [ "$GPUS" -eq 1 ]; then gres_line="NodeName=node[1-$n] Name=gpu File=$STATE/dev/gpu0"
    else gres_line="NodeName=node[1-$n] Name=gpu File=$STATE/dev/gpu[0-$((GPUS - 1))]"; fi
  fi
  {
    echo "$MARK"
    cat <<EOF
ClusterName=$CLUSTER
SlurmctldHost=$CTL_NAME($ctl_ip)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job may start again once its step credentials expired: 10 s (SLURM allows 5), not 120, for tests.
AuthInfo=cred_expire=10
CredType=cred/munge
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SrunPortRange=$SRUN_PORTS
StateSaveLocation=$STATE/spool/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$LOGD/slurmctld.log
SlurmdLogFile=$LOGD/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# Schedule every second, not every 60 s (main loop) and 30 s (backfill, which also skips a pass
# when no job or node changed): a requeued job, held until its credentials expired, starts
# as soon as it may (11 s after the requeue), not up to 30 s later (seen: 29 s per requeue).
SchedulerParameters=batch_sched_delay=0,sched_interval=1,bf_interval=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmdParameters=config_overrides
GresTypes=gpu
ReturnToService=2
KillWait=5
InactiveLimit=0
MinJobAge=300
SlurmdTimeout=60
EOF
    if [ "$MODE" = multi ]; then
      for i in $(seq 1 "$n"); do
        echo "NodeName=node$i NodeAddr=$(node_ip "$i") Port=$((SLURMD_PORT + i)) CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$MEM$gres_node State=UNKNOWN"
      done
    else
      for i in $(seq 1 "$n"); do
        echo "NodeName=node$i NodeAddr=$(node_ip "$i") CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$MEM$gres_node State=UNKNOWN"
      done
    fi
    # Preemption as on shared GPU clusters: a job of `urgent` requeues jobs of `debug` (the
    # default) that hold its nodes; tests set debug's GraceTime with `scontrol update`.
    echo "PartitionName=debug Nodes=node[1-$n] Default=YES MaxTime=INFINITE State=UP PriorityTier=1"
    echo "PartitionName=urgent Nodes=node[1-$n] MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF"
  } >"$CONF"
  { echo "$MARK"; [ -n "$gres_line" ] && echo "$gres_line"; } >"$GRES_CONF" || true
  # 24.11+ in a rootfs: no cgroup plugin (22.05 has no `disabled`; it uses the host's /sys
  # bound in, as the host's 22.05 does)
  if [ -n "$ROOTFS" ] && [ "$RELEASE" != bookworm ]; then
    printf '%s\nCgroupPlugin=disabled\n' "$MARK" >"$CONF_DIR/cgroup.conf"
  fi
}

remove_conf() {
  local f
  for f in "$CONF" "$GRES_CONF" "$CONF_DIR/cgroup.conf"; do
    [ -f "$f" ] && grep -qF "$MARK" "$f" && rm -f "$f"
  done
  return 0
}

# ---------------------------------------------------------------- health
ctld_up() { S timeout 5 scontrol ping 2>/dev/null | grep -q 'is UP'; }

nodes_ready() {  # N : all N nodes responding and usable (idle/alloc/mix/comp, no drain)
  local n=$1 states
  states=$(S timeout 5 sinfo -h -N -p debug -o '%N %T' 2>/dev/null | sort -u) || return 1
  # "planned": the backfill scheduler holds the node for a job (for a moment after a
  # preemption, with the queue already empty): usable all the same.
  [ "$(echo "$states" | grep -cE '^node[0-9]+ (idle|allocated|mixed|completing|planned)$')" -eq "$n" ]
}

ctld_up_or_dead() {
  proc_running "$(cat "$PIDS/slurmctld.pid")" || return 2
  ctld_up
}

nodes_ready_or_dead() {  # succeed when ready; exit early (fail) when a daemon died
  local n=$1 i
  proc_running "$(cat "$PIDS/slurmctld.pid")" || { log "slurmctld died"; return 2; }
  for i in $(seq 1 "$n"); do
    proc_running "$(cat "$PIDS/slurmd-node$i.pid")" || { log "slurmd node$i died"; return 2; }
  done
  nodes_ready "$n"
}

is_healthy() {
  [ -f "$STATE/nodes" ] || return 1
  local n i mode
  n=$(cat "$STATE/nodes"); mode=$(cat "$STATE/mode")
  pid_alive "$(cat "$PIDS/slurmctld.pid" 2>/dev/null)" slurmctld || return 1
  for i in $(seq 1 "$n"); do
    pid_alive "$(cat "$PIDS/slurmd-node$i.pid" 2>/dev/null)" slurmd || return 1
  done
  [ -z "$ROOTFS" ] || pid_alive "$(holder)" "sleep infinity" || return 1
  munge_ok && ctld_up && nodes_ready "$n"
}

# ---------------------------------------------------------------- up / down
record_uts() {  # N : remember each node's private UTS namespace (for leftover cleanup)
  local i pid u
  for i in $(seq 1 "$1"); do
    pid=$(cat "$PIDS/slurmd-node$i.pid" 2>/dev/null || true)
    pid_alive "$pid" slurmd || continue
    u=$(readlink "/proc/$pid/ns/uts" 2>/dev/null || true)
    [ -n "$u" ] && echo "$u" >"$STATE/uts.node$i"
  done
  return 0
}

adopt_pidfiles() {  # N : prefer the PID each daemon wrote itself, if it is alive
  local i p
  p=$(cat "$STATE/run/slurmctld.pid" 2>/dev/null || true)
  if pid_alive "$p" slurmctld; then echo "$p" >"$PIDS/slurmctld.pid"; fi
  for i in $(seq 1 "$1"); do
    p=$(cat "$STATE/run/slurmd-node$i.pid" 2>/dev/null || true)
    if pid_alive "$p" "slurmd -D -N node$i"; then echo "$p" >"$PIDS/slurmd-node$i.pid"; fi
  done
  return 0
}

start_daemons() {  # N ctl_ip
  # Each daemon (and every slurmstepd it forks) works in /, not in the caller's directory,
  # which may be a checkout removed while the cluster runs on (a job's steps then say
  # "Unable to get current working directory").
  local n=$1 ctl_ip=$2 i CHROOT="" ENTER_NS=()
  [ -z "$ROOTFS" ] || { CHROOT="chroot $ROOTFS"; ENTER_NS=(nsenter "--mount=/proc/$(holder)/ns/mnt" --); }
  # controller: own UTS namespace so its hostname matches SlurmctldHost on any machine
  setsid "${ENTER_NS[@]}" unshare --uts sh -c "cd / && hostname $CTL_NAME && exec $CHROOT slurmctld -D -i" \
    </dev/null >>"$LOGD/slurmctld.stdout" 2>&1 9>&- &
  echo $! >"$PIDS/slurmctld.pid"
  # from here on the recorded PID must name the daemon (kill_recorded checks cmdline)
  wait_until 10 pid_alive "$(cat "$PIDS/slurmctld.pid")" "slurmctld -D" || true
  wait_until "$TIMEOUT" ctld_up_or_dead || { tail -20 "$LOGD/slurmctld.log" >&2 || true; die "slurmctld did not come up"; }
  for i in $(seq 1 "$n"); do
    if [ "$MODE" = multi ]; then
      setsid unshare --uts sh -c "cd / && hostname node$i && exec slurmd -D -N node$i" \
        </dev/null >>"$LOGD/slurmd-node$i.stdout" 2>&1 9>&- &
    else
      # nsenter, not `ip netns exec`: the latter remounts /sys, hiding /sys/fs/cgroup, and
      # slurmd 22.05 always inits its cgroup plugin -> "No filesystem mounted on /sys/fs/cgroup"
      setsid "${ENTER_NS[@]}" nsenter --net="/run/netns/${NS_PREFIX}node$i" unshare --uts sh -c "cd / && hostname node$i && exec $CHROOT slurmd -D -N node$i" \
        </dev/null >>"$LOGD/slurmd-node$i.stdout" 2>&1 9>&- &
    fi
    echo $! >"$PIDS/slurmd-node$i.pid"
    wait_until 10 pid_alive "$(cat "$PIDS/slurmd-node$i.pid")" "slurmd -D -N node$i" || true
  done
  local ready=0
  wait_until "$TIMEOUT" nodes_ready_or_dead "$n" || ready=1
  adopt_pidfiles "$n"
  record_uts "$n"
  if [ $ready != 0 ]; then
    S sinfo -N -o '%N %T %E' >&2 || true
    for i in $(seq 1 "$n"); do tail -5 "$LOGD/slurmd-node$i.log" >&2 2>/dev/null || true; done
    die "nodes did not become idle within ${TIMEOUT}s"
  fi
}

cmd_up() {
  local n=${1:-3}
  [[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 60 ] || die "N must be 1..60"
  [[ $CPUS =~ ^[1-9][0-9]*$ && $GPUS =~ ^[0-9]+$ && $MEM =~ ^[1-9][0-9]*$ ]] \
    || die "SLURM_CLUSTER_CPUS/GPUS/MEM must be integers"
  [[ $SUBNET =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "SLURM_CLUSTER_SUBNET must look like 10.199.0"
  need_root
  local rootfs=""
  if [ "$K" = 0 ]; then
    install_pkgs
  else
    [ "$MODE_REQ" = netns ] || die "a release's cluster ($RELEASE) runs in netns mode only"
    command -v ip >/dev/null && command -v nsenter >/dev/null || die "needs ip (iproute2) and nsenter (util-linux)"
    rootfs=$(bash "$(dirname "${BASH_SOURCE[0]}")/slurm-rootfs.sh" "$RELEASE") || die "no $RELEASE rootfs"
  fi
  mkdir -p "$STATE"
  exec 9>"$STATE/lock"
  flock -w 120 9 || die "another slurm-cluster.sh is running"

  # this script's own hash: a changed slurm.conf (or any other change here) means a new cluster
  local params="mode=$MODE_REQ nodes=$n cpus=$CPUS gpus=$GPUS mem=$MEM subnet=$SUBNET rootfs=$rootfs script=$(sha256sum <"$0" | cut -c1-16)"
  if [ "$(cat "$STATE/params" 2>/dev/null)" = "$params" ] && is_healthy; then
    log "already up and healthy ($params) - nothing to do"
    firewall_off   # a test that died with the firewall on leaves the cluster as `up` makes it
    cmd_status_locked; return 0
  fi
  if [ -f "$STATE/nodes" ]; then
    log "existing cluster is different or unhealthy - tearing it down first"
  fi
  down_locked   # idempotent; also cleans leftovers of a crashed/partial run
  if [ -n "$rootfs" ]; then
    ROOTFS=$rootfs; CONF_DIR=$ROOTFS/etc/slurm; CONF=$CONF_DIR/slurm.conf; GRES_CONF=$CONF_DIR/gres.conf
    HOSTS=$ROOTFS/etc/hosts
    echo "$ROOTFS" >"$STATE/rootfs"
  fi

  MODE=$MODE_REQ
  if [ "$MODE" = auto ] || [ "$MODE" = netns ]; then
    if ip netns add "${NS_PREFIX}probe" 2>/dev/null; then
      ip netns del "${NS_PREFIX}probe"; MODE=netns
    elif [ "$MODE" = auto ]; then
      log "network namespaces unavailable -> multi mode"; MODE=multi
    else
      die "ip netns add failed (try SLURM_CLUSTER_MODE=multi)"
    fi
  fi
  [ "$MODE" = netns ] || [ "$MODE" = multi ] || die "unknown SLURM_CLUSTER_MODE=$MODE"

  local t0=$SECONDS ctl_ip
  # a failed `up` tears down what it started (unless SLURM_CLUSTER_KEEP_ON_FAIL=1)
  trap 'rc=$?; if [ $rc != 0 ] && [ "${SLURM_CLUSTER_KEEP_ON_FAIL:-0}" != 1 ]; then
          log "up failed (rc=$rc) - log tails follow, then teardown"; cmd_logs 15 >&2 || true
          down_locked || true; fi' EXIT
  rm -rf "${STATE:?}/spool" "$STATE/run" "$PIDS"
  mkdir -p "$STATE/spool/ctld" "$STATE/run" "$PIDS" "$LOGD"
  for i in $(seq 1 "$n"); do mkdir -p "$STATE/spool/node$i"; done
  rm -f "$LOGD"/*
  echo "$MODE" >"$STATE/mode"

  if [ "$MODE" = netns ]; then ctl_ip=$SUBNET.1; setup_netns "$n"; else ctl_ip=$MULTI_NET.1; fi
  [ -z "$ROOTFS" ] || start_holder   # after the netns: it sees them in /run/netns
  hosts_add "$n" "$ctl_ip"
  write_conf "$n" "$ctl_ip"
  if [ -z "$ROOTFS" ]; then start_munge; else start_munge_rootfs; fi
  local version
  if [ -z "$ROOTFS" ]; then version=$(slurmd -V | awk '{print $2}'); else version=$(awk '{print $2}' "$ROOTFS/.slurm-version"); fi
  echo "$n" >"$STATE/nodes"
  echo "$params" >"$STATE/params"
  cat >"$STATE/cluster.env" <<EOF
SLURM_CLUSTER_MODE=$MODE
SLURM_CLUSTER_NODES=$n
SLURM_CLUSTER_NODELIST=node[1-$n]
SLURM_CLUSTER_CPUS=$CPUS
SLURM_CLUSTER_GPUS=$GPUS
SLURM_CLUSTER_MEM=$MEM
SLURM_CLUSTER_CONTROLLER=$CTL_NAME
SLURM_CLUSTER_LAUNCHER_ADDR=$ctl_ip
SLURM_CLUSTER_NODE_ADDRS="$(for i in $(seq 1 "$n"); do printf '%s ' "$(node_ip "$i")"; done | sed 's/ $//')"
SLURM_CLUSTER_LOGS=$LOGD
SLURM_CLUSTER_STATE=$STATE
SLURM_CLUSTER_NETNS_PREFIX=$NS_PREFIX
SLURM_CLUSTER_RELEASE=$RELEASE
SLURM_CLUSTER_SLURM_VERSION=$version
SLURM_CLUSTER_ROOTFS=$ROOTFS
EOF
  start_daemons "$n" "$ctl_ip"
  trap - EXIT
  log "up: $n nodes, mode $MODE, SLURM $version ($RELEASE), in $((SECONDS - t0))s"
  cmd_status_locked
}

down_locked() {
  local i f
  if [ -f "$PIDS/slurmctld.pid" ] && ctld_up; then
    local jobs
    jobs=$(S timeout 10 squeue -h -o %A 2>/dev/null || true)
    if [ -n "$jobs" ]; then
      log "cancelling jobs: $(echo $jobs)"
      S timeout 10 scancel $jobs 2>/dev/null || true
      jobs_gone() { [ -z "$(S squeue -h -o %A 2>/dev/null)" ]; }
      wait_until 20 jobs_gone || log "WARN: jobs still listed after 20s"
    fi
  fi
  for f in "$PIDS"/slurmd-*.pid; do [ -e "$f" ] && kill_recorded "$f" slurmd; done
  teardown_multi_procs
  kill_recorded "$PIDS/slurmctld.pid" slurmctld
  kill_recorded "$PIDS/munged.pid" munged
  stop_holder     # a release's cluster: whatever is left in its mount namespace, its mounts
  teardown_netns
  hosts_remove
  remove_conf
  rm -rf "${STATE:?}/spool" "${STATE:?}/run" "${STATE:?}/dev" "${STATE:?}/pids" "${STATE:?}/nodes" "${STATE:?}/mode" "${STATE:?}/params" "${STATE:?}/cluster.env" "${STATE:?}/rootfs"
  # logs are kept in $STATE/log until the next `up`
}

cmd_down() {
  need_root
  mkdir -p "$STATE"
  exec 9>"$STATE/lock"
  flock -w 120 9 || die "another slurm-cluster.sh is running"
  local rootfs=$ROOTFS
  down_locked
  if [ -n "$rootfs" ]; then  # a release's cluster: nothing of it may be left
    local left="" d
    for d in /proc/[0-9]*; do
      [ "$(readlink "$d/root" 2>/dev/null)" = "$rootfs" ] && left="$left process ${d#/proc/}"
    done
    left="$left$(ip netns list 2>/dev/null | awk '{print $1}' | grep "^${NS_PREFIX}node" | sed 's/^/ netns /' | tr '\n' ' ' || true)"
    ip link show "$BRIDGE" >/dev/null 2>&1 && left="$left bridge $BRIDGE"
    [ -z "$left" ] || die "down left behind:$left"
  fi
  log "down"
}

cmd_status_locked() {
  if [ ! -f "$STATE/nodes" ] || [ ! -f "$STATE/cluster.env" ]; then echo "slurm-cluster: DOWN"; return 1; fi
  local n mode ok=0 ctl_ip i pid st
  # shellcheck disable=SC1091
  . "$STATE/cluster.env"
  n=$SLURM_CLUSTER_NODES; mode=$SLURM_CLUSTER_MODE; ctl_ip=$SLURM_CLUSTER_LAUNCHER_ADDR
  is_healthy || ok=1
  echo "slurm-cluster: $([ $ok = 0 ] && echo UP || echo UNHEALTHY) mode=$mode nodes=$n cpus/node=$SLURM_CLUSTER_CPUS gpus/node=$SLURM_CLUSTER_GPUS"
  echo "controller: $CTL_NAME $ctl_ip:$CTLD_PORT pid=$(cat "$PIDS/slurmctld.pid" 2>/dev/null) alive=$(pid_alive "$(cat "$PIDS/slurmctld.pid" 2>/dev/null)" slurmctld && echo yes || echo no)"
  echo "launcher/login address reachable from nodes: $ctl_ip (hostname $CTL_NAME)"
  for i in $(seq 1 "$n"); do
    pid=$(cat "$PIDS/slurmd-node$i.pid" 2>/dev/null || true)
    st=$(S timeout 5 sinfo -h -n "node$i" -o '%T' 2>/dev/null || echo '?')
    echo "node$i $(echo "$SLURM_CLUSTER_NODE_ADDRS" | cut -d' ' -f"$i") slurmd pid=$pid alive=$(pid_alive "$pid" slurmd && echo yes || echo no) state=$st"
  done
  echo "config: $CONF  logs: $LOGD  env: $STATE/cluster.env"
  return $ok
}

cmd_env() {  # machine-readable facts for tests: eval "$(slurm-cluster.sh env)"
  [ -f "$STATE/cluster.env" ] || { echo "slurm-cluster: DOWN" >&2; return 1; }
  sed 's/^/export /' "$STATE/cluster.env"
}

cmd_status() { cmd_status_locked; }

cmd_exec() {  # CMD... on a release's cluster's login side: its rootfs, this directory, env kept
  [ -n "$ROOTFS" ] || die "exec: only for a release's cluster (SLURM_CLUSTER_RELEASE=bookworm|trixie|sid), and it is not up"
  pid_alive "$(holder)" "sleep infinity" || die "the $RELEASE cluster is not up"
  [ $# -gt 0 ] || die "exec: no command"
  local py
  py=$(dirname "$(python3 -c 'import sys; print(sys.executable)')")
  exec nsenter --mount="/proc/$(holder)/ns/mnt" -- chroot "$ROOTFS" env -u SLURM_CONF \
    PATH="$py:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" SLURM_CLUSTER_RELEASE="$RELEASE" \
    sh -c 'cd "$1" && shift && exec "$@"' sh "$PWD" "$@"
}

# ---------------------------------------------------------------- the firewalled variant
node_netns() { ip netns list 2>/dev/null | awk '{print $1}' | grep "^${NS_PREFIX}node" || true; }

firewall_off() {
  local ns
  for ns in $(node_netns); do
    nsenter --net="/run/netns/$ns" nft delete table inet "$FIREWALL_TABLE" 2>/dev/null || true
  done
  return 0
}

cmd_firewall() {  # on | off | status
  need_root
  [ -f "$STATE/cluster.env" ] || die "the cluster is not up"
  [ "$(cat "$STATE/mode")" = netns ] || die "firewall: netns mode only (the nodes' own namespaces)"
  command -v nft >/dev/null || die "firewall: nft is missing (apt-get install nftables)"
  local ctl_ip ns ranges conf=$CONF
  inside_rootfs && conf=/etc/slurm/slurm.conf   # a test's, run by `exec`
  ctl_ip=$(. "$STATE/cluster.env" && echo "$SLURM_CLUSTER_LAUNCHER_ADDR")
  case "${1:-}" in
    on)
      grep -qx "SrunPortRange=$SRUN_PORTS" "$conf" \
        || die "firewall: $conf has no SrunPortRange=$SRUN_PORTS (brought up by an older script): bring the cluster up again"
      ranges="$CTLD_PORT, $SRUN_PORTS"
      firewall_off
      for ns in $(node_netns); do
        # SYN without ACK: a new connection (stateless: no conntrack needed); dropped, not
        # refused, as firewalls do: the other side waits until its own timeout
        nsenter --net="/run/netns/$ns" nft -f - <<EOF || die "firewall: nft failed in $ns"
table inet $FIREWALL_TABLE {
  chain out {
    type filter hook output priority 0; policy accept;
    ip daddr $ctl_ip tcp dport { $ranges } accept
    ip daddr $ctl_ip tcp flags & (syn | ack) == syn drop
  }
  chain in {
    type filter hook input priority 0; policy accept;
    ip saddr $ctl_ip tcp dport $SLURMD_PORT accept
    ip saddr $ctl_ip tcp flags & (syn | ack) == syn drop
  }
}
EOF
      done
      log "firewall on: the nodes reach $ctl_ip on $ranges only, and it reaches them on $SLURMD_PORT only"
      ;;
    off) firewall_off; log "firewall off" ;;
    status)
      for ns in $(node_netns); do
        if nsenter --net="/run/netns/$ns" nft list table inet "$FIREWALL_TABLE" >/dev/null 2>&1; then
          echo "$ns on"; else echo "$ns off"; fi
      done
      ;;
    *) die "firewall: on, off or status" ;;
  esac
}

cmd_logs() {
  local f
  for f in "$LOGD"/*; do [ -f "$f" ] || continue; echo "==== $f"; tail -n "${1:-40}" "$f"; done
}

case "${1:-}" in
  up) shift; cmd_up "$@" ;;
  down) cmd_down ;;
  status) cmd_status ;;
  logs) shift; cmd_logs "$@" ;;
  env) cmd_env ;;
  exec) shift; cmd_exec "$@" ;;
  firewall) shift; cmd_firewall "$@" ;;
  *) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 2 ;;
esac
